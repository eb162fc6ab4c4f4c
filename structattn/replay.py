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
  nothing more); the second records the plan; later calls replay it. ``torch.compile`` and
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
  thread's calls); replays run concurrently.
"""

from __future__ import annotations

import math
import os
import threading
import warnings
from dataclasses import dataclass, field
from functools import partial
from math import isfinite

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree

from . import _validation, kernels, triton_kernels
from .certified import Certified
from .iterate import Trace
from .latent import _overrides, iteration_overrides
from .verdicts import DEVICES, Verdicts, call_failed, parameters_failed
from .windows.history import MeanFieldHistory

# what a reading returns beside tensors: flattened so that their tensors are graph outputs
for _cls in (Trace, MeanFieldHistory, Certified):
    pytree.register_dataclass(_cls)

#: how many signatures one module records by default before it reads new ones every call
#: (``sa.compile(model, max_plans=…)``; like dynamo's cache size limit: a stream of ever-new
#: shapes should not fill memory with graphs); it warns once when that happens
MAX_PLANS = 32


@dataclass
class Plan:
    """What one signature's calls replay: ``graph`` (``torch.fx.GraphModule``, flat tensors
    in: parameters, buffers, the tensor inputs, then the folded constants' values; flat
    tensors out, then the fused check flags), the output's ``spec`` and non-tensor leaves
    (``literals``); or, when the reading could not be recorded, ``graph`` None and
    ``reason``."""

    graph: torch.fx.GraphModule | None = None
    spec: object = None
    literals: dict = field(default_factory=dict)  # output leaf position → non-tensor value
    n_tensors: int = 0
    flags: tuple = ()  # the fused checks' kinds, the graph's last outputs: "finite", "true"
    reason: str | None = None
    calls: int = 0  # replays served
    single: bool = False  # the output is one tensor
    #: what depends on the parameters alone, computed once per change of them (inference
    #: plans): its graph, the parameters' versions it was computed at, and its values
    constants_graph: torch.fx.GraphModule | None = None
    constants_versions: list | None = None  # their ``stamp``s
    constants_refs: list = field(default_factory=list)  # ``hold``s their storages
    constants_values: list = field(default_factory=list)
    captured: list = field(default_factory=list)  # tensors the constants read besides the state
    #: its generated fast path (``_Last``), made on its first replay and kept: calls that
    #: alternate between plans (checks on and off, two shapes) would otherwise generate anew
    last: object = None


def _tensor_key(t: torch.Tensor) -> tuple:
    return (t.shape, t.dtype, t.device, t.requires_grad, t.layout)


def _leaf_key(x):
    if isinstance(x, torch.Tensor):
        return _tensor_key(x)
    if x is None or isinstance(x, (bool, int, float, str)):
        return (type(x), x)
    if isinstance(x, (tuple, list)):
        return (type(x), tuple(_leaf_key(v) for v in x))
    hash(x)  # an unhashable argument: no plan (TypeError, caught by the caller)
    return (type(x), x)


def stamp(t: torch.Tensor) -> tuple:
    """What identifies a tensor's values between two calls: its version counter (moved by an
    in-place write: an optimizer step, ``load_state_dict``), its storage and its offset in it.
    ``p.data = …`` and ``torch.nn.utils.vector_to_parameters`` give a parameter new values in
    another storage and leave its version counter as it was: only the storage shows them. A
    storage is named by its address, which stays unique while ``hold`` keeps a weak reference
    to it (its memory is released, its address not reused). A tensor without a storage of its
    own (a subclass) is named by its identity, which its values may then change under."""
    try:
        return (t._version, t.untyped_storage()._cdata, t.storage_offset())
    except (RuntimeError, NotImplementedError, TypeError):
        return (t._version, id(t), None)


def hold(tensors) -> list:
    """Weak references to the tensors' storages: while held, no new storage can take the
    address a ``stamp`` names (see ``stamp``)."""
    refs = []
    for t in tensors:
        try:
            refs.append(StorageWeakRef(t.untyped_storage()))
        except (RuntimeError, NotImplementedError, TypeError):
            pass
    return refs


#: one recording or reading at a time in the process: ``make_fx`` keeps its tracing state
#: (the pre-dispatch mode stack, the fx patcher) in globals, and two threads recording at once
#: corrupt each other's (tested: 8 threads' first calls released together); while one records,
#: fx's patch of ``nn.Module.__call__`` routes another thread's reading through its tracer,
#: and the two hung (seen once in eight threads' first calls of a shared layer); the fast
#: path's code generation too (``ast`` and ``compile`` from two threads at once raised
#: CPython 3.11's "AST constructor recursion depth mismatch"). Re-entrant: a reading may call
#: another compiled module.
_RECORDING = threading.RLock()


def _read(layer, inputs: tuple, kwargs: dict):
    """The declaration read for one call (no plan), one reading or recording at a time."""
    with _RECORDING:
        return layer.interpret(*inputs, **kwargs)


class Plans:
    """A compiled module's plans by signature (not state: excluded from ``state_dict``; copies
    and pickles start empty). ``record_after``: how many times a signature is read before its
    plan is recorded (recording costs tens of milliseconds: a shape seen once should not pay
    it)."""

    def __init__(self, enabled: bool = True, record_after: int = 1, max_plans: int = MAX_PLANS):
        self.enabled, self.record_after, self.max_plans = enabled, record_after, max_plans
        self.full_warned = False  # whether the warning that no plan is left was given
        self.plans: dict = {}
        self.reads: dict = {}  # signature → readings so far
        self._modules = None  # (structure version, [(prefix, module)])
        self._checked = None  # (the parameter versions last looked at, whether all were finite)
        self._last = None  # the last plan replayed, with its guard (``_replay_last``)
        self.verdicts = Verdicts()  # its calls' checks in flight on a GPU (``structattn.verdicts``)

    def __deepcopy__(self, memo):
        return Plans(self.enabled, self.record_after, self.max_plans)

    def __getstate__(self):
        return {**Plans(self.enabled, self.record_after, self.max_plans).__dict__}

    def clear(self) -> None:
        self.plans.clear()
        self.reads.clear()
        self._modules = self._checked = self._last = None

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
        tensors = [t for d in dicts for t in d.values() if t is not None]
        return list({id(t): t for t in tensors}.values()) if shared else tensors

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
        key = [getattr(layer.declaration, "structure_version", 0), torch.is_grad_enabled(),
               torch.is_inference_mode_enabled(), torch.is_autocast_enabled(),
               _validation.is_validating(), kernels._enabled(),
               triton_kernels._cpu.__dict__.get("depth")]
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
        (``structattn.verdicts``; a failure raises naming the parameter) and True returned."""
        stamps = [(id(t), *stamp(t)) for t in state]
        checked = self._checked
        if checked is not None and stamps == checked[0]:
            return checked[1]
        floats = [t.detach() for t in state
                  if t.is_floating_point() and t.numel() and t.device.type != "meta"]
        total = torch.stack([n.to(torch.float64) for n in torch._foreach_norm(floats)]).sum() \
            if floats else None
        if total is None:
            finite = True
        elif (module is not None and _validation._QUEUED and total.device.type in DEVICES
              and _validation.is_validating()):
            self.verdicts.put((total,), ("finite",),
                              partial(parameters_failed, module, self, stamps, hold(state)))
            finite = True
        else:
            finite = math.isfinite(float(total))
        self._checked = (stamps, finite, hold(state))
        return finite

    def check_parameters(self, layer, state: list) -> None:
        """While validating: a ValueError naming the first non-finite parameter, if any."""
        if not self.parameters_finite(state, layer.declaration):
            _validation.check_parameters(layer.declaration)

    # -- one call ------------------------------------------------------------------------
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
        if plan is None:
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
            out = replay(plan, state, inputs, queue=queue)
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
            self._last = plan.last
        return out


_FAILED = object()


#: the environment as ``os.environ`` keeps it (its ``_data`` dict, which its assignments
#: update): ``os.environ.get`` is three Python frames, which after a call's tensor work cost
#: as much as a small kernel (measured: 7–10 µs in place at B=1, N=16)
_environ = getattr(os.environ, "_data", os.environ)
_KERNELS_KEY = os.environ.encodekey("STRUCTATTN_KERNELS") if _environ is not os.environ \
    else "STRUCTATTN_KERNELS"


def _modes(declaration) -> tuple:
    """The global part of a signature: what every reading depends on besides its arguments
    (the same as ``Plans.signature``'s, read without function calls of our own: this runs on
    every call)."""
    return (declaration.__dict__.get("structure_version", 0), torch.is_grad_enabled(),
            torch.is_inference_mode_enabled(), torch.is_autocast_enabled(),
            _validation._local.__dict__.get("override"), _validation._DEFAULT,
            _environ.get(_KERNELS_KEY), kernels._off.__dict__.get("depth"),
            triton_kernels._cpu.__dict__.get("depth"),
            _overrides.__dict__.get("options"))  # replaced, never changed in place


class _Last:
    """The plan a module replayed last, and what must hold for a call to replay it without
    building its signature: the same modes, the same parameter tensors, found finite, and
    tensor inputs (no keyword options) that dynamo's C++ ``TensorGuards`` accepts — the same
    type, dtype, device, shape and ``requires_grad``. A stream of calls with one signature,
    the common case, costs this check and the graph.

    ``run(layer, inputs)`` is one function generated for this plan (``_fast_path``): the
    modes, the parameters fetched from their modules' dicts by name and compared by identity,
    their versions, the guard, the graph and the flags, in straight-line code. Measured in
    place, after the tensor work of a call, each Python frame and loop costs several times what
    it costs in a loop of its own: at B=1, N=16 one frame less is a percent."""

    __slots__ = ("declaration", "plan", "run", "guard")

    def __init__(self, layer, plans, plan, inputs, kwargs, state):
        from torch._C._dynamo.guards import TensorGuards

        tensors = (*inputs, *state)
        self.declaration = layer.declaration
        self.plan = plan
        self.guard = TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                                  dynamic_dims_strides=[[None] * t.dim() for t in tensors])
        self.run = _fast_path(self, plans, len(inputs), kwargs, state,
                              queueable=any(t.device.type in DEVICES for t in tensors))


def _fast_path(last, plans, n_inputs: int, kwargs: dict, state: list, queueable: bool = False):
    """Generate ``run(layer, inputs, kwargs)`` for ``last`` (``kwargs``: the options of its
    calls, plain values compared by type and value): its plan replayed, a re-reading when a
    check fails, or ``MISSED`` when the call is not this plan's. The plan's graph is inlined
    (``_inlined``); every name of the prologue and epilogue starts with ``_sa_``, which no
    node of an fx graph is called, so the graph's locals cannot shadow them. ``queueable``:
    the plan runs on a GPU, where its checks' verdicts are queued (``structattn.verdicts``)."""
    declaration, plan = last.declaration, last.plan
    _, dicts, shared = plans._modules
    env = {"_sa_D": declaration, "_sa_MISSED": _MISSED, "_sa_guard": last.guard.check,
           "_sa_M": _modes(declaration), "_sa_modes": _modes, "_sa_plan": plan,
           "_sa_plans": plans, "_sa_isfinite": isfinite, "_sa_constants": _constants,
           "_sa_output": _output, "_sa_stamp": stamp, "_sa_hold": hold,
           "_sa_Exception": Exception, "_sa_len": len, "_sa_float": float,
           "_sa_KeyError": KeyError, "_sa_id": id, "_sa_Q": plans.verdicts,
           "_sa_VAL": _validation, "_sa_partial": partial, "_sa_call_failed": call_failed,
           "_sa_read": _read}
    ins = [f"_sa_i{i}" for i in range(n_inputs)]
    st = [f"_sa_s{i}" for i in range(len(state))]
    env.update(_sa_type=type, _sa_bool=bool, _sa_int=int, _sa_float=float, _sa_str=str)
    same_options = "".join(f" or _sa_type(_sa_kw.get({k!r})) is not _sa_{type(v).__name__}"
                           f" or _sa_kw[{k!r}] != {v!r}" for k, v in kwargs.items()
                           ) if all(v is not None for v in kwargs.values()) else None
    env["_sa_K"] = dict(kwargs)
    if same_options is None:  # a None among them: compared as the dict it is
        same_options = " or _sa_kw != _sa_K or any(_sa_type(v) is not _sa_type(_sa_K[k]) " \
                       "for k, v in _sa_kw.items())"
    lines = ["def run(_sa_layer, _sa_inputs, _sa_kw):",  # (``layer.declaration``: __getattr__'s)
             "    if _sa_Q.queue:  # an earlier call's failed check raises first",
             "        _sa_Q.settle()",
             f"    if _sa_layer._modules.get('declaration') is not _sa_D "
             f"or _sa_len(_sa_inputs) != {n_inputs} or _sa_len(_sa_kw) != {len(kwargs)}"
             f"{same_options}:",
             "        return _sa_MISSED",
             f"    {', '.join(ins)}, = _sa_inputs" if ins else "    pass",
             "    if _sa_modes(_sa_D) != _sa_M:",
             "        return _sa_MISSED"]
    if shared or not state:  # tied weights: the module's own walk, which drops duplicates
        env["_sa_ids"] = [id(t) for t in state]
        lines += ["    _sa_state = _sa_plans.state(_sa_D)",
                  "    if [_sa_id(t) for t in _sa_state] != _sa_ids:",
                  "        return _sa_MISSED"]
        if st:
            lines.append(f"    {', '.join(st)}, = _sa_state")
    else:  # every tensor fetched by name from its dict, the dicts' sizes unchanged
        where = {id(t): i for i, t in enumerate(state)}
        fetch, same = [], []
        for k, d in enumerate(dicts):
            env[f"_sa_d{k}"] = d
            same.append(f"_sa_len(_sa_d{k}) != {len(d)}")
            for name, t in d.items():
                if t is None:
                    same.append(f"_sa_d{k}[{name!r}] is not None")
                else:
                    i = where[id(t)]
                    env[f"_sa_S{i}"] = t
                    fetch.append(f"_sa_s{i} = _sa_d{k}[{name!r}]")
                    same.append(f"_sa_s{i} is not _sa_S{i}")
        lines += ["    try:"] + [f"        {f}" for f in fetch] + [
            "    except _sa_KeyError:",
            "        return _sa_MISSED",
            f"    if {' or '.join(same)}:",
            "        return _sa_MISSED"]
    # What the plan computes from the parameters alone (its constants graph) and the checks
    # among those values: refreshed when a parameter (or a tensor the constants captured)
    # moves, not looked at every call
    n = plan.n_tensors
    held = plan.constants_graph is not None and bool(st)
    constant_flags = _constant_flags(plan, len(state) + n_inputs) if held else {}
    if held:
        values = _constants(plan, state)
        env.update(_sa_CV=list(values), _sa_CF=[_flags_pass(plan, values, constant_flags)],
                   _sa_flags_pass=_flags_pass, _sa_CFI=constant_flags,
                   _sa_VC=[stamp(t) for t in plan.captured], _sa_WC=hold(plan.captured))
        for i, t in enumerate(plan.captured):
            env[f"_sa_C{i}"] = t
    if st:  # a parameter changed (an optimizer step, ``p.data = …``): found finite again
        stamps = [stamp(t) for t in state]
        env.update(_sa_V=[v for v, _, _ in stamps], _sa_P=[p for _, p, _ in stamps],
                   _sa_O=[o for _, _, o in stamps], _sa_W=hold(state))
        # ``stamp`` inlined: the version, the storage's address and the offset compared
        moved = " or ".join(
            f"{s}._version != _sa_V[{i}] or {s}.untyped_storage()._cdata != _sa_P[{i}] "
            f"or {s}.storage_offset() != _sa_O[{i}]" if stamps[i][2] is not None
            else f"_sa_stamp({s})[:2] != (_sa_V[{i}], _sa_P[{i}])" for i, s in enumerate(st))
        now = ", ".join(st)
        lines += [f"    if {moved}:",
                  f"        if not _sa_plans.parameters_finite([{now}], _sa_D):",
                  "            return _sa_MISSED"]
        refresh = [f"        _sa_CV[:] = _sa_constants(_sa_plan, [{now}])",
                   "        _sa_CF[0] = _sa_flags_pass(_sa_plan, _sa_CV, _sa_CFI)"] if held else []
        # the stamps last: another thread that sees them new sees the constants new too
        lines += refresh + [
            f"        _sa_T = [_sa_stamp(t) for t in ({now},)]",
            "        _sa_W[:] = _sa_hold([" + now + "])",
            "        _sa_V[:] = [t[0] for t in _sa_T]",
            "        _sa_P[:] = [t[1] for t in _sa_T]",
            "        _sa_O[:] = [t[2] for t in _sa_T]"]
        if held and plan.captured:
            cap = [f"_sa_C{i}" for i in range(len(plan.captured))]
            lines += ["    if " + " or ".join(f"_sa_stamp({c}) != _sa_VC[{i}]"
                                          for i, c in enumerate(cap)) + ":",
                      *refresh,
                      f"        _sa_WC[:] = _sa_hold([{', '.join(cap)}])",
                      f"        _sa_VC[:] = [{', '.join(f'_sa_stamp({c})' for c in cap)}]"]
    lines += ["    try:",
              f"        if not _sa_guard({', '.join(ins + st)}):",
              "            return _sa_MISSED",
              "    except _sa_Exception:  # an input that is not a tensor",
              "        return _sa_MISSED",
              "    try:"]
    args = ", ".join(st + ins)
    if held:
        args += ", *_sa_CV"
    elif plan.constants_graph is not None:
        args += ", *_sa_constants(_sa_plan, [" + ", ".join(st) + "])"
    lines += [f"        {line}" for line in _inlined(plan.graph, args, env)]
    checks = [f"not _sa_isfinite(_sa_float(_sa_result[{n + k}]))" if kind == "finite"
              else f"not _sa_result[{n + k}]" for k, kind in enumerate(plan.flags)
              if k not in constant_flags]
    queued = [f"_sa_result[{n + k}]" for k in range(len(plan.flags)) if k not in constant_flags]
    if constant_flags:
        checks.insert(0, "not _sa_CF[0]")
    if queueable and queued:  # on a GPU: the verdicts go to the host without waiting
        env["_sa_KINDS"] = tuple(kind for k, kind in enumerate(plan.flags)
                                 if k not in constant_flags)
        lines += ["        if _sa_VAL._QUEUED:",
                  f"            _sa_Q.put(({', '.join(queued)},), _sa_KINDS, _sa_partial("
                  f"_sa_call_failed, _sa_read, _sa_layer, _sa_inputs, _sa_kw))",
                  f"            _sa_failed = {'not _sa_CF[0]' if constant_flags else 'False'}",
                  "        else:",
                  f"            _sa_failed = {' or '.join(checks)}"]
    elif checks:
        lines += [f"        _sa_failed = {' or '.join(checks)}"]
    reread = "        return _sa_layer.interpret(*_sa_inputs, **_sa_kw)"
    lines += ["    except _sa_Exception:  # inside the graph: the reading raises the check's message",
              "        _sa_failed = True" if checks else reread]
    if checks:
        lines += ["    if _sa_failed:", reread]
    lines.append("    _sa_plan.calls += 1")
    lines.append("    return _sa_result[0]" if plan.single
                 else "    return _sa_output(_sa_plan, _sa_result)")
    code = "\n".join(lines)
    exec(compile(code, f"<structattn replay of {type(declaration).__name__}>", "exec"), env)
    return env["run"]


def _constant_flags(plan: Plan, first_constant: int) -> dict:
    """The plan's flags that are values of its constants graph (checks of the parameters
    alone, e.g. a learned gate's range): flag position → index among the constants.
    ``first_constant``: the position of the graph's first constants placeholder."""
    placeholders = [v for v in plan.graph.graph.nodes if v.op == "placeholder"]
    values = plan.graph.graph.output_node().args[0]
    out = {}
    for k in range(len(plan.flags)):
        node = values[plan.n_tensors + k]
        if node.op == "placeholder" and placeholders.index(node) >= first_constant:
            out[k] = placeholders.index(node) - first_constant
    return out


def _flags_pass(plan: Plan, values: list, flags: dict) -> bool:
    """Whether the constant flags ``flags`` (``_constant_flags``) pass on these values."""
    for k, i in flags.items():
        v = values[i]
        if not (isfinite(float(v)) if plan.flags[k] == "finite" else bool(v)):
            return False
    return True


def _inlined(graph: torch.fx.GraphModule, args: str, env: dict) -> list:
    """The lines of ``graph``'s generated forward, to run in place of a call to it: its
    parameters bound to ``args``, ``self`` to the graph, its ``return`` an assignment to
    ``_sa_result``; its globals added to ``env``. A call to it where that cannot be done (a
    name of ours among its globals or locals, a return inside)."""
    import ast

    env["_sa_graph"] = graph
    call = [f"_sa_result = _sa_graph.forward({args})"]
    code = graph.graph.python_code(root_module="self")
    fn = ast.parse(code.src).body[0]
    *body, last = fn.body
    names = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)}
    if (not isinstance(last, ast.Return) or fn.args.vararg is not None
            or any(isinstance(n, ast.Return) for b in body for n in ast.walk(b))
            or any(k.startswith("_sa_") for k in (*code.globals, *names))):
        return call
    env.update(code.globals)
    params = [a.arg for a in fn.args.args[1:]]
    lines = ["self = _sa_graph", f"{', '.join(params)}, = {args}," if params else "pass"]
    lines += [line for b in body for line in ast.unparse(b).splitlines()]
    lines.append(f"_sa_result = {ast.unparse(last.value)}")
    return lines


def _constants(plan: Plan, state: list) -> list:
    """The values of what the plan's graph takes from the parameters alone, computed again
    when one of them (or a tensor they captured) changed (``stamp``)."""
    tensors = (*state, *plan.captured)
    stamps = [stamp(t) for t in tensors]
    if stamps != plan.constants_versions:
        values = plan.constants_graph(*state)
        plan.constants_values, plan.constants_refs = values, hold(tensors)
        plan.constants_versions = stamps  # last: a thread that sees it sees the values too
    return plan.constants_values


def _output(plan: Plan, result: list):
    """The reading's output rebuilt from the graph's tensors (the flags cut off)."""
    if plan.flags:
        result = result[:-len(plan.flags)]
    if not plan.literals:
        return pytree.tree_unflatten(list(result), plan.spec)
    leaves, it = [], iter(result)
    for i in range(plan.n_tensors + len(plan.literals)):
        leaves.append(plan.literals[i] if i in plan.literals else next(it))
    return pytree.tree_unflatten(leaves, plan.spec)


MISSED = _MISSED = object()  # a call that is not the last plan's


def _split(inputs: tuple):
    """The tensors among ``inputs`` (flattened), and a function putting new ones in their place."""
    if all(type(x) is torch.Tensor for x in inputs):
        return inputs, tuple
    leaves, spec = pytree.tree_flatten(inputs)
    where = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]

    def rebuild(tensors):
        new = list(leaves)
        for i, t in zip(where, tensors, strict=True):
            new[i] = t
        return pytree.tree_unflatten(new, spec)
    return [leaves[i] for i in where], rebuild


def record(layer, names: list, state: list, inputs: tuple, kwargs: dict) -> Plan:
    """Trace one reading of ``layer`` at this signature into a ``Plan``."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.nn.utils.stateless import _reparametrize_module

    tensors, rebuild = _split(inputs)
    k = len(state)
    plan = Plan()
    # checks off, on the CPU: the checks are recorded as the plan's guards (a failed one
    # re-reads the call, unchecked) — a flag read costs nothing on the CPU, and a NaN then
    # needs no carrier in the graph at every attention call
    as_guards = not _validation.is_validating() and all(
        t.device.type == "cpu" for t in (*state, *tensors))

    def reading(*flat):
        flags: list = []
        with _reparametrize_module(layer.declaration, dict(zip(names, flat[:k], strict=True))), \
                _validation.recording(flags, as_guards=as_guards):
            out = layer.interpret(*rebuild(flat[k:]), **kwargs)
        leaves, plan.spec = pytree.tree_flatten(out)
        plan.literals = {i: v for i, v in enumerate(leaves) if not isinstance(v, torch.Tensor)}
        result = [v for v in leaves if isinstance(v, torch.Tensor)]
        plan.n_tensors = len(result)
        plan.single = isinstance(out, torch.Tensor)
        # each check's verdict is an output, read by the replay (cheaper than combining
        # them in the graph): a sum, finite iff the data were, or a boolean, True iff they pass
        result.extend(flags)
        plan.flags = tuple("finite" if f.is_floating_point() else "true" for f in flags)
        return result

    # tracing runs the reading on the real tensors: its random draws must not advance the
    # generators the replay (which serves this call) draws from
    devices = sorted({t.device.index or 0 for t in (*state, *tensors) if t.is_cuda})
    try:
        with torch.random.fork_rng(devices=devices):
            graph = make_fx(reading, pre_dispatch=True)(*state, *tensors)
    except Exception as err:  # the reading reads tensor values (or cannot be traced)
        plan.reason = f"{_where(err)}{type(err).__name__}: {str(err).splitlines()[0][:200]}"
        return plan
    graph.graph.eliminate_dead_code(is_impure_node=_impure)
    captured = [getattr(graph, n.target) for n in graph.graph.nodes if n.op == "get_attr"]
    differentiated = _differentiated(state, tensors, captured)
    _simplify(graph.graph, merge=not differentiated)
    _drop_implied_checks(graph.graph, plan, k)
    graph.recompile()
    with torch.random.fork_rng(devices=devices):
        _bind_to_torch(graph, (*state, *tensors))
    graph.recompile()
    if not _differentiated(state, captured):
        plan.constants_graph = _split_constants(graph, k)  # nothing to differentiate: fold
        if plan.constants_graph is not None:  # tensors the reading captured (a closure's)
            plan.captured = [getattr(plan.constants_graph, n.target)
                             for n in plan.constants_graph.graph.nodes if n.op == "get_attr"]
    # the tracer's notes on each node (its stack trace, a description of its value), which
    # only the passes above read: kept, a plan of a 200-step relaxation held ~380 MB of them
    for g in (graph, plan.constants_graph):
        for node in g.graph.nodes if g is not None else ():
            node.meta.clear()
    plan.graph = graph
    return plan


#: view operators whose chains may end where they began (``squeeze(unsqueeze(x))``,
#: ``transpose(transpose(x))``, ``expand(x, x.shape)``, ``x.to(x.dtype)``)
_RESHAPES = {torch.ops.aten.squeeze, torch.ops.aten.unsqueeze, torch.ops.aten.transpose,
             torch.ops.aten.expand, torch.ops.aten.to, torch.ops.aten.view,
             torch.ops.aten.reshape, torch.ops.aten.flatten, torch.ops.aten.unflatten,
             torch.ops.aten.permute, torch.ops.aten.slice, torch.ops.aten.t}


def _differentiated(*groups) -> bool:
    """Whether a gradient may flow through a recording of these tensors."""
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for ts in groups for t in ts)


def _simplify(g: torch.fx.Graph, merge: bool = True) -> None:
    """What a reading repeats because its pieces do not know of each other, removed from its
    recorded graph: a chain of views that ends where it began (the same shape, strides,
    offset and dtype as its start) is its start, and a pure operator called again on the same
    arguments — in the same grad mode — is its first call (common subexpressions: a factor
    each step recomputes, a sum taken twice). Both leave every value bit for bit as it was:
    the same kernels run on the same tensors. Merging only where nothing is differentiated
    (``merge``): a backward would add two uses' gradients in another order. Nothing is done
    to a graph that writes into a tensor (an alias could then see the write), nor, where
    gradients flow, to one that detaches a tensor in place."""
    nodes = list(g.nodes)
    # ``detach_`` writes only autograd metadata: harmless where nothing is differentiated
    if any(n.op == "call_function" and (
            _mutates(n) or (not merge and n.target is torch.ops.aten.detach_.default))
           for n in nodes):
        return
    switches = [n for n in nodes if n.target is torch._C._set_grad_enabled]
    if merge and not torch.is_grad_enabled() and all(n.args == (False,) and not n.users
                                                     for n in switches):
        for n in switches:  # recorded without gradients, replayed so (the signature)
            g.erase_node(n)
        nodes = list(g.nodes)
    epoch, seen = 0, {}
    for n in nodes:
        if n.op != "call_function":
            continue
        if not isinstance(n.target, torch._ops.OpOverload):  # a grad-mode switch, …
            epoch += 1
            continue
        if _impure(n):
            continue
        start = _view_start(n)
        if start is None and merge and n.target is torch.ops.aten.detach.default \
                and (_computed(n.args[0]) or _read_by_checks_only(n)):
            start = n.args[0]  # where nothing is differentiated, a result has no history
        if start is not None:
            n.replace_all_uses_with(start)
            continue
        if not merge:
            continue
        try:
            key = (epoch, n.target, _hashable(n.args), _hashable(n.kwargs))
            hash(key)
        except TypeError:
            continue
        first = seen.setdefault(key, n)
        if first is not n:
            n.replace_all_uses_with(first)
    g.eliminate_dead_code(is_impure_node=_impure)


def _root(node):
    """The tensor a chain of views starts from."""
    while node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) \
            and node.target.is_view and node.args and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node


def _drop_implied_checks(g: torch.fx.Graph, plan: Plan, n_state: int) -> None:
    """Checks another check implies, gone from the plan's outputs: a finite sum over a view
    of a tensor whose whole sum is checked, and ``(a == a).all()`` (false only at a NaN) of
    such a view — e.g. the last tokens of an input checked as a whole; and a finite sum of
    ``x`` where ``linear(x, W)`` is checked finite, W (and a bias) among the ``n_state``
    parameters and buffers, which are known finite (checked once per change, before either
    path): a NaN or ±inf at x[i, f] makes every entry of the output's row i non-finite
    (NaN·0 and ±inf·0 are NaN; tested, zero weights included) — e.g. a Hopfield state's
    initial value W_Q r checked, so r need not be summed too. A failed check re-reads the
    call, which names x."""
    out = g.output_node()
    values = list(out.args[0])
    n = len(plan.flags)
    flags = values[len(values) - n:] if n else []
    params = set([v for v in g.nodes if v.op == "placeholder"][:n_state])

    def summed(f):
        return (f.op == "call_function" and f.target is torch.ops.aten.sum.default
                and isinstance(f.args[0], torch.fx.Node))

    def linear_input(y):  # x where y = linear(x, W[, b]) with known-finite W, b and ≥ 1 column
        if y.op == "call_function" and y.target is torch.ops.aten.detach.default:
            y = y.args[0]  # (checked without its history)
        if y.op != "call_function" or y.target is not torch.ops.aten.linear.default:
            return None
        x, w, *bias = y.args
        val = y.meta.get("val")
        if w in params and all(b is None or b in params for b in bias) \
                and isinstance(val, torch.Tensor) and val.dim() and val.shape[-1] > 0:
            return x
        return None
    checked = [f.args[0] for f, kind in zip(flags, plan.flags, strict=True)
               if kind == "finite" and summed(f)]
    # expanding attention's kernel, asked to (``infer``'s last argument), refuses keys that
    # hold NaN or inf: a check of its keys b, reshaped from linear(x, W_k) over every token
    infer = _checked_infer()
    checked += [_every_entry(v.args[1]) for v in g.nodes if infer is not None
                and v.op == "call_function" and v.target is infer and v.args[-1] is True]
    whole = set(checked)
    covered = {linear_input(y) for y in checked} - {None}
    keep = []
    for f, kind in zip(flags, plan.flags, strict=True):
        implied = False
        if kind == "finite" and summed(f):
            implied = (_root(f.args[0]) in whole and f.args[0] is not _root(f.args[0])) \
                or f.args[0] in covered
        elif (kind == "true" and f.target is torch.ops.aten.all.default
              and isinstance(f.args[0], torch.fx.Node)
              and f.args[0].target is torch.ops.aten.eq.Tensor
              and f.args[0].args[0] is f.args[0].args[1]):
            implied = _root(f.args[0].args[0]) in whole
        keep.append(not implied)
    if all(keep):
        return
    out.args = (values[:len(values) - n] + [f for f, k in zip(flags, keep, strict=True) if k],)
    plan.flags = tuple(kind for kind, k in zip(plan.flags, keep, strict=True) if k)
    g.eliminate_dead_code(is_impure_node=_impure)


#: operators whose output holds every entry of their first argument (rearranged)
_EVERY_ENTRY = ("view", "reshape", "_unsafe_view", "transpose", "permute", "detach", "alias",
                "clone", "contiguous", "unsqueeze", "squeeze", "flatten", "unflatten", "expand")


def _every_entry(node):
    """The tensor ``node`` rearranges every entry of (through ``_EVERY_ENTRY``), or itself."""
    while (node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
           and node.target._schema.name.split("::")[-1] in _EVERY_ENTRY
           and node.args and isinstance(node.args[0], torch.fx.Node)):
        node = node.args[0]
    return node


def _checked_infer():
    """Expanding attention's ``infer`` op where its kernel is loaded (else nothing matches)."""
    ops = getattr(torch.ops, "structattn_mean_field", None)
    try:
        return ops.infer.default if ops is not None else None
    except (AttributeError, RuntimeError):
        return None


def _computed(node) -> bool:
    """A node whose value an operator computed afresh, or a view of one (not an input, nor
    a view of one)."""
    node = _root(node)
    target = node.target
    return (node.op == "call_function" and isinstance(target, torch._ops.OpOverload)
            and not target.is_view and not target._schema.is_mutable)


def _read_by_checks_only(node) -> bool:
    """A node only summed for a check's verdict (a graph output read as a number)."""
    return all(u.op == "call_function" and u.target is torch.ops.aten.sum.default
               and all(v.op == "output" for v in u.users) for u in node.users)


def _hashable(x):
    if isinstance(x, (list, tuple)):
        return (type(x), tuple(_hashable(v) for v in x))
    if isinstance(x, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in x.items()))
    if isinstance(x, torch.fx.Node):
        return ("node", x)
    return (type(x), x)


def _argument(node, name: str, default):
    """Argument ``name`` of an aten call, positional or keyword."""
    if name in node.kwargs:
        return node.kwargs[name]
    for i, a in enumerate(node.target._schema.arguments):
        if a.name == name:
            return node.args[i] if i < len(node.args) else default
    return default


def _view_start(n):
    """The node a chain of reshaping views ending at ``n`` started from, when ``n`` is the
    same view of it (``_RESHAPES``; no copy asked for), else None."""
    def meta(node):
        v = node.meta.get("val")
        if not isinstance(v, torch.Tensor):
            return None
        return (v.shape, v.stride(), v.storage_offset(), v.dtype, v.device)

    end = meta(n)
    node = n
    while (end is not None and node.op == "call_function"
           and isinstance(node.target, torch._ops.OpOverload)
           and node.target.overloadpacket in _RESHAPES and node.target.is_view
           and not _argument(node, "copy", False)
           and node.args and isinstance(node.args[0], torch.fx.Node)):
        node = node.args[0]
        if meta(node) == end:
            return node
    return None


def _split_constants(graph: torch.fx.GraphModule, k: int) -> torch.fx.GraphModule | None:
    """Move what depends on the parameters alone (prior tables from learned logits, windows
    from learned Beta parameters, the parameters' own checks) out of ``graph`` into a graph of
    its own, ``(*state) -> values``, whose values ``graph`` then takes as further inputs; the
    replay computes them once per parameter change. Only for plans through which nothing is
    differentiated (inference): a cached value carries no autograd history. None when there
    is nothing to move."""
    g = graph.graph
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    const = set(placeholders[:k])
    for n in g.nodes:
        if n.op == "get_attr":
            const.add(n)
        elif n.op == "call_function" and _foldable(n) \
                and all(a in const for a in n.all_input_nodes):
            const.add(n)
    for n in g.nodes:  # a value something mutates is computed every call, not cached
        if n.op == "call_function" and _mutates(n):
            const.difference_update(n.all_input_nodes)
    for n in g.nodes:  # … and so is what is computed from it
        if n in const and any(a not in const for a in n.all_input_nodes):
            const.discard(n)
    frontier = [n for n in g.nodes if n in const and n.op != "placeholder"
                and any(u not in const for u in n.users)]
    if not frontier:
        return None
    # the constants' own graph: copy every constant node, return the frontier
    cg, env = torch.fx.Graph(), {}
    for n in placeholders[:k]:
        env[n] = cg.placeholder(n.name)
    for n in g.nodes:
        if n in const and n.op != "placeholder":
            env[n] = cg.node_copy(n, lambda a: env[a])
    cg.output([env[n] for n in frontier])
    constants = torch.fx.GraphModule(graph, cg)
    # the replayed graph takes the frontier as inputs after its own (each new placeholder goes
    # right after the last old one: inserted last to first, they end up first to last)
    with g.inserting_after(placeholders[-1]):
        for i, n in reversed(list(enumerate(frontier))):
            n.replace_all_uses_with(g.placeholder(f"constant_{i}"))
    g.eliminate_dead_code(is_impure_node=_impure)
    graph.recompile()
    return constants


def _foldable(node) -> bool:
    """A node that computes a value from its inputs alone: no random draw, no write into a
    tensor, no grad-mode switch (``detach_``, which only drops autograd history, is one)."""
    if node.target is torch.ops.aten.detach_.default:
        return True
    return not _impure(node) and not _mutates(node)


def _mutates(node) -> bool:
    """Whether a node writes into a tensor (``detach_`` only drops autograd history: no)."""
    target = node.target
    if target is torch.ops.aten.detach_.default:
        return False
    schema = getattr(target, "_schema", None)
    if schema is not None:
        return schema.is_mutable
    name = getattr(target, "__name__", "")
    return name.endswith("_") and not name.startswith("_")


def _where(err: BaseException) -> str:
    """``"file:line (function): "`` of the innermost frame outside torch where ``err`` arose."""
    import traceback

    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if "/torch/" not in f.filename and "/pyro/" not in f.filename]
    if not frames:
        return ""
    f = frames[-1]
    return f"{'/'.join(f.filename.split('/')[-3:])}:{f.lineno} ({f.name}): "


def _binding(op):
    """The public torch binding an aten overload was called through (``torch.transpose``,
    ``torch._C._nn.linear``, ``Tensor.add_``), or None. The binding resolves the same
    arguments to the same overload, as it did when the reading called it, and costs a few
    microseconds less per call than the overload object (no Python frame of its own)."""
    if not isinstance(op, torch._ops.OpOverload) or op.namespace != "aten":
        return None
    name = op.overloadpacket.__name__
    for home in (torch, torch._C._nn, torch._C._linalg, torch._C._special, torch._C._fft):
        fn = getattr(home, name, None)
        if fn is not None and type(fn).__name__ == "builtin_function_or_method":
            return fn
    method = getattr(torch.Tensor, name, None)
    return method if type(method).__name__ == "method_descriptor" else None


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and a.stride() == b.stride() and a.requires_grad == b.requires_grad
                and torch.equal(a, b))
    if isinstance(a, (tuple, list)):
        return (isinstance(b, (tuple, list)) and len(a) == len(b)
                and all(_same(x, y) for x, y in zip(a, b, strict=True)))
    return type(a) is type(b) and a == b


def _draws_nothing(node, args, kwargs) -> bool:
    """A seeded overload called so that it draws nothing: attention without dropout."""
    if node.target is torch.ops.aten.scaled_dot_product_attention.default:
        p = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
        return p == 0.0
    return False


def _bind_to_torch(graph: torch.fx.GraphModule, args: tuple) -> None:
    """Call each aten overload of ``graph`` through its torch binding where that binding,
    given the node's own arguments at this signature, returns the same thing (checked here,
    node by node, on the recording's inputs: the graph is straight-line, so every node runs).
    Overloads that mutate or draw at random keep their overload object."""
    bound = {}

    narrowed = {}

    class Check(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if n.op == "call_function" and n.target is torch.ops.aten.slice.Tensor:
                # a unit-step slice has no public binding; ``torch.narrow`` is the same view
                # (the signature fixes the size, so the length is known)
                a, kw = self.fetch_args_kwargs_from_env(n)
                x, dim, start, end, step = (*a, *[None] * (5 - len(a)))[:5] if not kw \
                    else (None,) * 5
                if isinstance(x, torch.Tensor) and step in (None, 1) and isinstance(dim, int) \
                        and isinstance(start, int) and isinstance(end, int):
                    size = x.shape[dim]
                    lo = max(0, min(size, start + size if start < 0 else start))
                    hi = max(lo, min(size, end + size if end < 0 else end))
                    if _same(out, torch.narrow(x, dim, lo, hi - lo)):
                        narrowed[n] = (n.args[0], dim, lo, hi - lo)
                return out
            fn = _binding(n.target) if n.op == "call_function" else None
            if fn is None or n.target._schema.is_mutable:
                return out
            a, kw = self.fetch_args_kwargs_from_env(n)
            if torch.Tag.nondeterministic_seeded in n.target.tags and not _draws_nothing(n, a, kw):
                return out
            try:
                alt = fn(*a, **kw)
            except Exception:  # the binding parses these arguments differently
                return out
            if _same(out, alt):
                bound[n] = fn
            return out

    Check(graph).run(*args)
    for node, fn in bound.items():
        node.target = fn
    for node, narrow in narrowed.items():
        node.target, node.args, node.kwargs = torch.narrow, narrow, {}


def _impure(node) -> bool:
    """Random draws stay (they advance the generator as the reading did) besides fx's own rule;
    an unread ``detach_`` of a tensor nothing else reads (a constant made under no_grad whose
    reader moved to the constants' graph) goes."""
    target = node.target
    if target is torch.ops.aten.detach_.default and not node.users:
        return any(u is not node for u in node.args[0].users)
    tags = getattr(target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags or node.is_impure()


def replay(plan: Plan, state: list, inputs: tuple, split: bool = True, queue=None):
    """Run the plan's graph on the current parameters and these inputs (``split=False``:
    known to be tensors); ``_FAILED`` when a value check failed (the caller re-reads the call,
    which raises its message). ``queue``: ``(verdicts, layer, inputs, kwargs)``, where the
    verdicts go on a GPU (``structattn.verdicts``) instead of being read here."""
    tensors = _split(inputs)[0] if split else inputs
    if plan.constants_graph is not None:
        result = plan.graph.forward(*state, *tensors, *_constants(plan, state))
    else:
        result = plan.graph.forward(*state, *tensors)
    if plan.flags:
        flags = result[len(result) - len(plan.flags):]
        if queue is not None and _validation._QUEUED and flags[0].device.type in DEVICES:
            verdicts, layer, args, kwargs = queue
            verdicts.put(flags, plan.flags, partial(call_failed, _read, layer, args, kwargs))
        elif not all(isfinite(float(f)) if kind == "finite" else bool(f)
                     for kind, f in zip(plan.flags, flags, strict=True)):
            return _FAILED
    plan.calls += 1
    return result[0] if plan.single else _output(plan, result)
