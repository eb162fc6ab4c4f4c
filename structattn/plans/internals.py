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
- ``trace_symbolic(fn, static, dynamic)``: the same on fake tensors of a ``ShapeEnv`` of
  its own, every size of ``dynamic`` a symbol (no duck sizing), and ``size_guard``: the
  guards the tracing (and the passes after it) put on those sizes, as one compiled
  expression, and whether it fixed every one of them (``specialized``);
- ``autocast_modes()``: autocast's state on every device type, as a signature holds it
  (``torch._C._is_any_autocast_enabled``, then ``torch.is_autocast_enabled`` and
  ``torch.get_autocast_dtype`` per device type: ``torch.is_autocast_enabled()`` alone is
  CUDA's);
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

#: whether autocast is on for any device type: one C call, which the fast path makes on
#: every call
any_autocast = torch._C._is_any_autocast_enabled

#: the device types autocast may be on for (``torch.amp.is_autocast_available``)
AUTOCAST_DEVICES = tuple(d for d in ("cpu", "cuda", "xpu", "mps", "hpu", "xla", "mtia")
                         if torch.amp.is_autocast_available(d))


def autocast_modes():
    """Autocast's state: False where it is off on every device type, else ``((device type,
    dtype), …)`` for each one it is on for — a plan recorded under one state replays only
    under the same: a reading may branch on it (``kinds.key_bias.folds_terms``)."""
    if not any_autocast():
        return False
    return tuple((d, torch.get_autocast_dtype(d)) for d in AUTOCAST_DEVICES
                 if torch.is_autocast_enabled(d))


#: ``t``'s version counter and its storage's address as source expressions of ``{}`` (the
#: tensor's name), for the generated fast path, where a function call per tensor costs
VERSION = "{}._version"
STORAGE = "_sa_storage_address({})"
#: the address of a tensor's StorageImpl: one C call (``untyped_storage()._cdata`` makes a
#: storage object first, which older torch releases without the call do)
storage_address = getattr(torch._C, "_storage_address", None) \
    or (lambda t: t.untyped_storage()._cdata)

tracing_state = torch._C._get_tracing_state


def trace(fn):
    """``fn`` traced by ``make_fx`` at the pre-dispatch level (call the result on tensors)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn, pre_dispatch=True)


def trace_fake(fn, tensors: list):
    """``fn(*tensors)`` traced by ``make_fx`` at the pre-dispatch level on fake copies of
    ``tensors`` (their sizes, strides, dtypes, devices and ``requires_grad``; fixed sizes):
    the trace runs no tensor work — tensors the function reaches that are not its arguments
    (a closure's) are taken as constants of the graph."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = [mode.from_tensor(t, static_shapes=True) for t in tensors]
    with mode:
        return make_fx(fn, pre_dispatch=True)(*fakes)


def trace_symbolic(fn, static: list, dynamic: list):
    """``fn(*static, *dynamic)`` traced by ``make_fx`` at the pre-dispatch level with symbolic
    sizes: ``static`` (the parameters) keep theirs, every dimension of each ``dynamic`` tensor
    is a symbol of its own (sizes equal at the recording are not tied). Returns the graph and
    the fake ``dynamic`` tensors (for ``size_guard``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    mode = FakeTensorMode(shape_env=ShapeEnv(duck_shape=False), allow_non_fake_inputs=True)
    fixed = [mode.from_tensor(t, static_shapes=True) for t in static]
    free = [mode.from_tensor(t, symbolic_context=StatelessSymbolicContext(
        dynamic_sizes=[DimDynamic.DYNAMIC] * t.dim())) for t in dynamic]
    with mode:
        graph = make_fx(fn, pre_dispatch=True)(*fixed, *free)
    graph.shape_env = mode.shape_env
    return graph, free


def size_guard(graph, fakes: list):
    """``(guard, text, specialized)`` for a graph of ``trace_symbolic``: ``guard(tensors)``,
    True where the tensors' sizes satisfy every guard the tracing recorded on ``fakes``'
    sizes (``text``: those guards, or None: any sizes); ``specialized``: every size symbol
    was fixed to a number (the reading read each one as an int), so the graph serves only the
    recorded sizes."""
    from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

    env = graph.shape_env
    text = env.produce_guards_expression(fakes, ignore_static=False)
    symbols = [d.node.expr for t in fakes for d in t.shape if isinstance(d, torch.SymInt)]
    specialized = all(env.replacements.get(s, s).is_number for s in symbols)
    if text is None:
        return (lambda tensors: True), None, specialized
    code = compile(text, "<structattn size guard>", "eval")
    names = [f"t{i}" for i in range(len(fakes))]

    def guard(tensors) -> bool:
        return bool(eval(code, SYMPY_INTERP, {"L": dict(zip(names, tensors, strict=True))}))

    return guard, text, specialized


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
    return storage_address(t)


def storage_ref(t: torch.Tensor) -> StorageWeakRef:
    """A weak reference to ``t``'s storage: while held, no new storage takes its address."""
    return StorageWeakRef(t.untyped_storage())


def tensor_guards(tensors, free: int = 0):
    """A function of tensors: True when they match ``tensors`` in type, dtype, device, shape
    and ``requires_grad`` (dynamo's ``TensorGuards``, checked in C++) — but for the sizes of
    the first ``free`` tensors, which may be any (a plan with symbolic sizes)."""
    from torch._C._dynamo.guards import TensorGuards

    sizes = [[None] * t.dim() if i < free else list(t.shape) for i, t in enumerate(tensors)]
    guards = TensorGuards(*tensors, dynamic_dims_sizes=sizes,
                          dynamic_dims_strides=[[None] * t.dim() for t in tensors])
    return guards.check


__all__ = ["GLOBAL_HOOKS", "OpOverload", "STORAGE", "VERSION", "reparametrized", "size_guard",
           "storage_id", "storage_ref", "tensor_guards", "trace", "trace_fake",
           "trace_symbolic",
           "tracing_state", "version"]
