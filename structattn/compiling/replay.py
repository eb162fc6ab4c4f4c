"""Compile once per input signature: read the declaration once, replay only its tensor work.

``CompiledModule.forward`` reads a declaration under the ``Marginalise`` reading: node-set
checks, supports, prior tables, the operator per family, the loop structure — Python work
that does not depend on the data, only on the *signature* of the call: the inputs' shapes,
dtypes, devices and ``requires_grad``; the parameters' identity and layout; the grad and
validation modes; the options passed. A ``Plan`` records, once per signature, what that
reading does to tensors — with ``make_fx`` (``torch.fx``), at PyTorch's pre-dispatch level,
so composite operators (``linear``, ``scaled_dot_product_attention``) stay whole and autograd,
grad-mode switches and random draws replay as they ran — and later calls run only that graph.

- **When**: the first call with a signature is read as before (so a shape seen once costs
  nothing more); the second records the plan — traced once on fake tensors (no tensor
  work), then its graph run once on the call's tensors to check its torch bindings, that
  run's outputs serving the call (``plans.plan.serve``): the recording call computes once;
  later calls replay it. ``torch.compile`` and
  ``torch.export`` trace the reading themselves and bypass plans.
- **Validation**: every value check the reading makes (``_validation.passes``) becomes a
  tensor in the graph; the replay fuses them into one finite sum and one boolean and reads
  them once per call. A failed flag — or an error inside the graph — re-reads the call,
  which raises the check's own message. Parameters are checked once per change of them
  (``stamp``: version counter, storage and offset, so ``p.data = …`` is a change too).
- **Constants**: in a plan nothing is differentiated through, what depends on the parameters
  alone is computed once per change of them (``_split_constants``).
- **What cannot be replayed**: a reading that branches on tensor *values* (a tolerance loop,
  data-dependent window sizes, a value pulled into Python) makes ``make_fx`` refuse; the
  signature is then read every call, as before, and ``Plan.reason`` says why.
- **Invalidation**: a new signature records anew; so does assigning an attribute of the
  declaration (``Declaration.__setattr__`` bumps its ``structure_version``). Parameter values
  are inputs of the graph, so training never re-records. ``CompiledModule.reset()`` drops
  every plan (e.g. after changing an attribute of a plain sub-module).
- **Threads**: one recording or reading at a time in the process (``_RECORDING``:
  ``make_fx``'s tracing state is global, and its patch of ``nn.Module.__call__`` reaches every
  thread's calls); replays run concurrently, but not while a trace has swapped fake tensors
  into the declaration they read (``plans.plan.SWAP``: they wait for it).

The compiler's parts (``structattn.plans``): ``plan`` (a plan, naming tensors' values between
calls, the replay), ``record`` (tracing a reading), ``simplify`` (the graph rewrites, the
constants split) and ``fast_path`` (the generated function a repeated signature runs). This
module holds ``Plans``, a compiled module's plans by signature, which decides per call.
"""

from __future__ import annotations

import warnings
from functools import partial

import torch

from .. import kernels, reading
from ..checking import _validation
from ..checking.verdicts import Verdicts, parameters_failed, queued_on
from ..latent import iteration_overrides
from ..plans.fast_path import _Last
from ..plans.internals import autocast_modes
from ..plans.plan import (
    _FAILED,
    _RECORDING,
    MISSED,
    Plan,
    _leaf_key,
    _read,
    _split,
    hold,
    replay,
    serve,
    stamp,
    unswapped,
)
from ..plans.record import record, withdraw

__all__ = ["MAX_PLANS", "MISSED", "Plan", "Plans", "hold", "record", "replay", "stamp"]

#: how many signatures one module records by default before it reads new ones every call
#: (``sa.compile(model, max_plans=…)``; like dynamo's cache size limit: a stream of ever-new
#: shapes should not fill memory with graphs); it warns once when that happens
MAX_PLANS = 32
#: how many recently replayed plans keep their fast path in reach (``Plans.replay_recent``):
#: a module called in turn with gradients and under ``no_grad`` (training and evaluation), or
#: with two input shapes in turn, replays each without building a signature
RECENT = 4


class Plans:
    """A compiled module's plans by signature (not state: excluded from ``state_dict``; copies
    and pickles start empty). ``record_after``: how many times a signature is read before its
    plan is recorded (recording costs tens of milliseconds: a shape seen once should not pay
    it). ``dynamic``: once two sizes of the same inputs (ranks, dtypes, devices, options)
    have plans, one plan with symbolic sizes is recorded for them all (``dynamic_plans``), and
    serves every further size its guards accept."""

    def __init__(self, enabled: bool = True, record_after: int = 1, max_plans: int = MAX_PLANS,
                 dynamic: bool = True):
        self.enabled, self.record_after, self.max_plans = enabled, record_after, max_plans
        self.dynamic = dynamic
        self.dynamic_plans: dict = {}  # sizes-free signature → its plan with symbolic sizes
        self.full_warned = False  # whether the warning that no plan is left was given
        self.plans: dict = {}
        self.reads: dict = {}  # signature → readings so far
        self._modules = None  # (structure version, [(prefix, module)])
        self._checked = None  # (the parameter versions last looked at, whether all were finite)
        self._last = None  # the last plan replayed, with its guard (``_replay_last``)
        self._recent = ()  # the fast paths (``_Last``) of the plans replayed last, newest first
        self.verdicts = Verdicts()  # its calls' checks in flight on a GPU (``structattn.checking.verdicts``)

    def __deepcopy__(self, memo):
        return Plans(self.enabled, self.record_after, self.max_plans, self.dynamic)

    def __getstate__(self):
        return {**Plans(self.enabled, self.record_after, self.max_plans, self.dynamic).__dict__}

    def clear(self) -> None:
        self.plans.clear()
        self.reads.clear()
        self.dynamic_plans.clear()
        self._modules = self._checked = self._last = None
        self._recent = ()

    # -- the signature -------------------------------------------------------------------
    def state(self, module: torch.nn.Module) -> list:
        """The declaration's parameters and buffers, in a fixed order. The module tree is
        walked again when the declaration's ``structure_version`` moves; the tensors are read
        from it every call (a parameter replaced in a sub-module is seen)."""
        version = getattr(module, "structure_version", 0)
        if self._modules is None or self._modules[0] != version:
            mods = [m for _, m in module.named_modules(remove_duplicate=True)]
            dicts = [m._parameters for m in mods] + [m._buffers for m in mods]
            tensors = [t for d in dicts for t in d.values() if t is not None]
            shared = len({id(t) for t in tensors}) != len(tensors)  # tied weights
            self._modules = (version, dicts, shared)
        _, dicts, shared = self._modules

        def read():
            tensors = [t for d in dicts for t in d.values() if t is not None]
            return list({id(t): t for t in tensors}.values()) if shared else tensors

        return unswapped(read)

    def names(self, module: torch.nn.Module) -> list:
        """The dotted names of ``state(module)``'s tensors, in its order."""
        version = getattr(module, "structure_version", 0)
        named = [(f"{p}.{n}" if p else n, t) for p, m in module.named_modules(remove_duplicate=True)
                 for n, t in m._parameters.items() if t is not None]
        named += [(f"{p}.{n}" if p else n, t) for p, m in module.named_modules(remove_duplicate=True)
                  for n, t in m._buffers.items() if t is not None]
        assert version == getattr(module, "structure_version", 0)
        first = {}
        for n, t in named:
            first.setdefault(id(t), n)
        return [first[id(t)] for t in self.state(module)]

    def signature(self, layer, inputs: tuple, kwargs: dict, state: list) -> tuple | None:
        """The call's signature, or None when an argument is not hashable (no plan)."""
        context = reading.context()
        key = [getattr(layer.declaration, "structure_version", 0), torch.is_grad_enabled(),
               torch.is_inference_mode_enabled(), autocast_modes(),
               _validation.is_validating(), kernels._enabled(),
               context.triton_on_cpu, context.flex]
        try:
            for x in inputs:
                key.append((x.shape, x.dtype, x.device, x.requires_grad, x.layout)
                           if type(x) is torch.Tensor else _leaf_key(x))
            for t in state:
                key.append((id(t), t.shape, t.dtype, t.device, t.requires_grad))
            if kwargs:
                key.append(tuple((k, _leaf_key(v)) for k, v in sorted(kwargs.items())))
            over = iteration_overrides()
            if over:
                key.append(tuple(sorted(over.items())))
            hash(key[-1])
        except TypeError:
            return None
        return tuple(key)

    def parameters_finite(self, state: list, module=None) -> bool:
        """Whether the parameters and buffers are finite — found again only when one changed
        since the last time (``stamp``: an optimizer step, a load, ``p.data = …``): one fused
        pass over them all. (An input is checked every call; a parameter only when it moved.)
        ``module``, their declaration, while validating on a GPU: the verdict is queued
        (``structattn.checking.verdicts``; a failure raises naming the parameter) and True returned."""
        stamps = [(id(t), *stamp(t)) for t in state]
        checked = self._checked
        if checked is not None and stamps == checked[0]:
            return checked[1]
        floats = [t.detach() for t in state
                  if t.is_floating_point() and t.numel() and t.device.type != "meta"]
        total = torch.stack([n.to(torch.float64) for n in torch._foreach_norm(floats)]).sum() \
            if floats else None
        refs = hold(state)
        if total is None:
            finite = True
        elif module is not None and queued_on(total.device) and _validation.is_validating():
            self.verdicts.put((total,), partial(self._parameters_failed, module, stamps, refs))
            finite = True
        else:
            finite = _validation.verdict(total)
        self._checked = (stamps, finite, refs)
        return finite

    def _parameters_failed(self, module, stamps: list, refs: list) -> None:
        """A queued parameter check failed: the parameters at ``stamps`` (``refs`` holding
        their storages) are noted non-finite and the fast paths dropped, so that every call
        while they stay so raises in the call, as without the queue; then the error."""
        self._checked = (stamps, False, refs)
        self._last, self._recent = None, ()
        for plan in self.plans.values():
            plan.last = None
        parameters_failed(module)

    def check_parameters(self, layer, state: list) -> None:
        """While validating: a ValueError naming the first non-finite parameter, if any."""
        if not self.parameters_finite(state, layer.declaration):
            _validation.check_parameters(layer.declaration)

    def _dynamic(self, layer, inputs: tuple, kwargs: dict, state: list, key: tuple):
        """``(plan, queue)``: the plan with symbolic sizes that serves this call — recorded
        now if two sizes of these inputs have plans (or no signature is left) and none was
        tried yet — or None when there is none or its guards refuse these sizes."""
        family = _sizes_free(key)
        plan, queue = self.dynamic_plans.get(family), (self.verdicts, layer, inputs, kwargs)
        if plan is None:
            seen = [k for k in self.plans if _sizes_free(k) == family]  # its sizes with plans
            if len(seen) < 2 and len(self.plans) < self.max_plans \
                    or len(self.dynamic_plans) >= self.max_plans:
                return None
            with _RECORDING:
                plan = self.dynamic_plans.get(family)
                if plan is None:
                    plan = record(layer, self.names(layer.declaration), state, inputs, kwargs,
                                  symbolic=True)
                    plan = self.dynamic_plans[family] = _serves_seen(
                        plan, seen, len(_split(inputs)[0]))
                    queue = None  # the recording call checks in the call
        if plan.graph is None or not plan.guard(_split(inputs)[0]):
            return None
        return plan, queue

    # -- one call ------------------------------------------------------------------------
    def replay_recent(self, layer, inputs: tuple, kwargs: dict):
        """A call the last plan's fast path missed, served by the fast path of another plan
        replayed recently (``RECENT``), which becomes the last; or ``MISSED``. Each fast path
        checks everything its plan depends on, so the plan that serves a call is one that
        would serve it as the last plan."""
        recent = self._recent  # a tuple, replaced whole: another thread sees one or the other
        for last in recent[1:]:
            out = last.run(layer, inputs, kwargs)
            if out is not MISSED:
                self._remember(last)
                return out
        return MISSED

    def _remember(self, last) -> None:
        """``last`` (a plan's ``_Last``) is the last plan replayed, first among the recent."""
        self._last = last
        if self._recent[:1] != (last,):
            self._recent = (last, *(r for r in self._recent if r is not last))[:RECENT]

    def __call__(self, layer, inputs: tuple, kwargs: dict):
        """A call that ``_Last.run`` (tried first, by ``CompiledModule.forward``) did not
        serve: its signature's plan, recorded when due, or a reading."""
        if self.verdicts.queue:  # an earlier call's failed check raises first
            self.verdicts.settle()
        state = self.state(layer.declaration)
        if _validation.is_validating():
            self.check_parameters(layer, state)
        elif not self.parameters_finite(state):  # unchecked plans hold no carrier for them:
            return _read(layer, inputs, kwargs)  # the reading carries NaN its own way
        key = self.signature(layer, inputs, kwargs, state) if self.enabled else None
        if key is None:
            return _read(layer, inputs, kwargs)
        plan = self.plans.get(key)
        dynamic = self._dynamic(layer, inputs, kwargs, state, key) if plan is None \
            and self.dynamic else None
        if dynamic is not None:
            plan, queue = dynamic
        elif plan is None:
            reads = self.reads.get(key, 0)
            full = len(self.plans) >= self.max_plans
            if reads < self.record_after or full:
                if len(self.reads) >= 64 * max(1, self.max_plans):  # ever-new signatures
                    self.reads.clear()
                if full and reads >= self.record_after and not self.full_warned:
                    self.full_warned = True
                    warnings.warn(
                        f"structattn: {type(layer.declaration).__name__}'s compiled module holds "
                        f"max_plans={self.max_plans} plans (one per input signature: shapes, "
                        f"dtypes, options), so calls with a new signature are read from the "
                        f"declaration every time, several times slower; compile with a larger "
                        f"max_plans (sa.compile(model, max_plans=…)) or give the inputs fewer "
                        f"shapes (pad them to a few lengths)", RuntimeWarning, stacklevel=4)
                self.reads[key] = reads + 1
                return _read(layer, inputs, kwargs)
            self.reads.pop(key, None)
            with _RECORDING:  # another thread may have recorded it while this one waited
                plan = self.plans.get(key)
                if plan is None:
                    plan = self.plans[key] = record(layer, self.names(layer.declaration),
                                                    state, inputs, kwargs)
            queue = None  # the recording call checks in the call
        else:
            queue = (self.verdicts, layer, inputs, kwargs)
        if plan.graph is None:
            return _read(layer, inputs, kwargs)
        try:
            out = serve(plan, state, inputs, queue=queue)
        except Exception:  # e.g. an index out of range, which the checks (read after the
            out = _FAILED  # graph) would have refused: the reading raises their message
        if out is _FAILED:
            return _read(layer, inputs, kwargs)
        if all(type(x) is torch.Tensor for x in inputs) and all(
                v is None or type(v) in (bool, int, float, str) for v in kwargs.values()):
            if plan.last is None:  # one per plan: the signature fixes what it guards
                with _RECORDING:  # generated code: CPython's compiler is not thread-safe
                    if plan.last is None:
                        plan.last = _Last(layer, self, plan, inputs, kwargs, state)
            self._remember(plan.last)
        return out


def _is_tensor_key(entry) -> bool:
    """Whether a signature entry is a tensor input's: ``(shape, dtype, device, …)``."""
    return type(entry) is tuple and bool(entry) and type(entry[0]) is torch.Size


def _sizes_free(key: tuple) -> tuple:
    """A signature without its tensor inputs' sizes (their ranks instead): what one plan with
    symbolic sizes serves. (A parameter's entry starts with its identity, not a shape.)"""
    return tuple((len(k[0]), *k[1:]) if _is_tensor_key(k) else k for k in key)


def _serves_seen(plan: Plan, seen: list, n_tensors: int) -> Plan:
    """``plan``, or, where its guards accept none of the sizes ``seen`` (the signatures of its
    family that have plans: the reading fixed the sizes, e.g. by reading one as a number, so
    the plan would serve only the sizes recorded), a plan that says so (no graph).
    ``n_tensors``: the tensors its guard reads (fewer at the top of a signature where inputs
    nest tensors in lists: then it is kept as it is)."""
    if plan.graph is None or not seen:
        return plan
    for key in seen:  # the seen inputs' layout (contiguous), without their values
        tensors = [torch.empty(k[0], dtype=k[1], device="meta") for k in key if _is_tensor_key(k)]
        if len(tensors) != n_tensors or plan.guard(tensors):
            return plan
    withdraw(plan)  # the call is read: its draws are the reading's
    return Plan(reason="the reading fixes the sizes of its inputs (it reads one as a number), "
                       "so a plan with symbolic sizes would serve only these; each size has its "
                       "own plan")
