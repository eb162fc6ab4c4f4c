"""Every torch internal the plan compiler touches, named here once (``tests/plans/
test_internals.py`` checks each contract, so that a torch release that changes one fails
there, by name, not somewhere in a replay):

- ``trace(fn)``: ``make_fx`` at the pre-dispatch level (composite operators such as
  ``linear`` and ``scaled_dot_product_attention`` stay one node), and ``reparametrized``:
  ``torch.nn.utils.stateless._reparametrize_module``, a module's parameters swapped for the
  tracer's;
- ``OpOverload`` (``torch._ops``): what an aten node's target is;
- ``version(t)``, ``storage_id(t)`` (``Tensor._version``, ``untyped_storage()._cdata``) and
  ``storage_ref`` (``StorageWeakRef``): how a tensor's values are named between calls, and
  ``VERSION`` / ``STORAGE``, the same as expressions for the generated fast path;
- ``tensor_guards(tensors)``: dynamo's C++ ``TensorGuards``, which accepts a call's tensors
  when their type, dtype, device, shape and ``requires_grad`` are the recorded ones;
- ``tracing_state()`` (``torch._C._get_tracing_state``: inside ``torch.jit.trace``) and
  ``GLOBAL_HOOKS``: ``nn.Module``'s global hook dicts, which the compiled module's own
  ``__call__`` must honour when it bypasses ``nn.Module.__call__``.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.modules import module as _module

OpOverload = torch._ops.OpOverload

#: the global hook dicts of ``nn.Module`` (forward pre, forward, backward, backward pre):
#: torch registers into these very dicts, so a reference held here sees every registration
GLOBAL_HOOKS = (_module._global_forward_pre_hooks, _module._global_forward_hooks,
                _module._global_backward_hooks, _module._global_backward_pre_hooks)

#: ``t``'s version counter and its storage's address as source expressions of ``{}`` (the
#: tensor's name), for the generated fast path, where a function call per tensor costs
VERSION = "{}._version"
STORAGE = "{}.untyped_storage()._cdata"

tracing_state = torch._C._get_tracing_state


def trace(fn):
    """``fn`` traced by ``make_fx`` at the pre-dispatch level (call the result on tensors)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn, pre_dispatch=True)


def reparametrized(module: torch.nn.Module, tensors: dict):
    """A context in which ``module``'s parameters and buffers named in ``tensors`` are those
    tensors (the tracer's proxies)."""
    from torch.nn.utils.stateless import _reparametrize_module

    return _reparametrize_module(module, tensors)


def version(t: torch.Tensor) -> int:
    """``t``'s version counter: moved by every in-place write to its storage through it."""
    return t._version


def storage_id(t: torch.Tensor) -> int:
    """The address of ``t``'s storage (unique while a ``storage_ref`` to it is held)."""
    return t.untyped_storage()._cdata


def storage_ref(t: torch.Tensor) -> StorageWeakRef:
    """A weak reference to ``t``'s storage: while held, no new storage takes its address."""
    return StorageWeakRef(t.untyped_storage())


def tensor_guards(tensors):
    """A function of tensors: True when they match ``tensors`` in type, dtype, device, shape
    and ``requires_grad`` (dynamo's ``TensorGuards``, checked in C++)."""
    from torch._C._dynamo.guards import TensorGuards

    guards = TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                          dynamic_dims_strides=[[None] * t.dim() for t in tensors])
    return guards.check


__all__ = ["GLOBAL_HOOKS", "OpOverload", "STORAGE", "VERSION", "reparametrized", "storage_id",
           "storage_ref", "tensor_guards", "trace", "tracing_state", "version"]
