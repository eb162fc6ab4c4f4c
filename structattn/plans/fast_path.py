"""The fast path: for the plan a module replayed last, one function generated as source
(``_fast_path``) that checks the call is that plan's — modes, parameters, guards — and runs its
graph inlined, in straight-line code. Part of the plan compiler (``structattn.compiling.replay``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial
from math import isfinite
from types import MappingProxyType

import torch

from .. import reading
from ..checking import _validation
from ..checking.verdicts import DEVICES, call_failed
from .internals import STORAGE, VERSION, any_autocast, autocast_modes, storage_address, tensor_guards
from .plan import _MISSED, _constant_flags, _constants, _flags_pass, _output, _read, hold, stamp

#: the environment as ``os.environ`` keeps it (its ``_data`` dict, which its assignments
#: update): ``os.environ.get`` is three Python frames, which after a call's tensor work cost
#: as much as a small kernel (measured: 7–10 µs in place at B=1, N=16)
_environ = getattr(os.environ, "_data", os.environ)
_slot, _DEFAULT_CONTEXT = reading._slot, reading.DEFAULT  # the ReadingContext in force
_KERNELS_KEY = os.environ.encodekey("STRUCTATTN_KERNELS") if _environ is not os.environ \
    else "STRUCTATTN_KERNELS"


def _modes(declaration) -> tuple:
    """The global part of a signature: what every reading depends on besides its arguments
    (the same as ``Plans.signature``'s, read without function calls of our own: this runs on
    every call)."""
    return (declaration.__dict__.get("structure_version", 0), torch.is_grad_enabled(),
            torch.is_inference_mode_enabled(), any_autocast() and autocast_modes(),
            _slot.__dict__.get("context", _DEFAULT_CONTEXT), _validation._DEFAULT,
            _environ.get(_KERNELS_KEY))


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

    __slots__ = ("declaration", "plan", "run", "guard", "step")

    def __init__(self, layer, plans, plan, inputs, kwargs, state):
        tensors = (*inputs, *state)
        self.declaration = layer.declaration
        self.plan = plan
        # a plan with symbolic sizes: any sizes of the inputs, then its own size guard
        self.guard = tensor_guards(tensors, free=len(inputs) if plan.guard is not None else 0)
        queueable = any(t.device.type in DEVICES for t in tensors)
        self.run = _fast_path(self, plans, len(inputs), kwargs, state, queueable=queueable)
        # a decoding step's plan (``layer``: a ``StepReading``): also the layer's whole call
        # ``layer(x_new, cache=c)`` in one function (``CacheStep``), or None
        head = getattr(layer, "cache_step", None)
        head = None if head is None else head(plan, kwargs)
        self.step = None if head is None else _fast_path(
            self, plans, len(inputs), kwargs, state, queueable=queueable, step=head)


@dataclass(frozen=True)
class CacheStep:
    """What a decoding step's function is made for: the compiled layer's whole call
    ``layer(x_new, cache=c)`` with a ``cache_type`` cache read by ``reading`` (a
    ``structattn.decoding.step.StepReading``) of this ``capacity`` — the plan's tensors taken
    from the cache (``[x_new, keys, values, (state,) lengths]``, the cache's ``_stores`` and
    ``_lengths``), its outputs ``(y, keys, values, ends[, state])`` written back to it, and
    ``y`` returned: one Python frame from the layer's call to the graph."""

    cache_type: type
    reading: object
    capacity: int
    state: bool


def _fast_path(last, plans, n_inputs: int, kwargs: dict, state: list, queueable: bool = False,
               step: CacheStep | None = None):
    """Generate ``run(layer, inputs, kwargs)`` for ``last`` (``kwargs``: the options of its
    calls, plain values compared by type and value): its plan replayed, a re-reading when a
    check fails, or ``MISSED`` when the call is not this plan's. The plan's graph is inlined
    (``_inlined``); every name of the prologue and epilogue starts with ``_sa_``, which no
    node of an fx graph is called, so the graph's locals cannot shadow them. ``queueable``:
    the plan runs on a GPU, where its checks' verdicts are queued (``structattn.checking.verdicts``).
    ``step``: instead, the compiled layer's decoding call ``run(layer, (x_new,), {"cache": c})``
    (``CacheStep``), ``MISSED`` where a check fails too (the layer's own call then reads it,
    raising the check's message)."""
    declaration, plan = last.declaration, last.plan
    env = {"_sa_D": declaration, "_sa_MISSED": _MISSED, "_sa_guard": last.guard,
           "_sa_M": _modes(declaration), "_sa_modes": _modes, "_sa_plan": plan,
           "_sa_plans": plans, "_sa_isfinite": isfinite, "_sa_constants": _constants,
           "_sa_output": _output, "_sa_stamp": stamp, "_sa_hold": hold,
           "_sa_Exception": Exception, "_sa_len": len, "_sa_float": float,
           "_sa_KeyError": KeyError, "_sa_id": id, "_sa_Q": plans.verdicts,
           "_sa_VAL": _validation, "_sa_partial": partial, "_sa_call_failed": call_failed,
           "_sa_read": _read, "_sa_type": type, "_sa_bool": bool, "_sa_int": int,
           "_sa_str": str, "_sa_storage_address": storage_address}
    ins = [f"_sa_i{i}" for i in range(n_inputs)]
    st = [f"_sa_s{i}" for i in range(len(state))]
    # what the plan computes from the parameters alone (its constants graph) and the checks
    # among those values: refreshed when a parameter (or a tensor the constants captured)
    # moves, not looked at every call
    held = plan.constants_graph is not None and bool(st)
    constant_flags = _constant_flags(plan, len(state) + n_inputs) if held else {}
    if held:
        values = _constants(plan, state)
        env.update(_sa_CV=list(values), _sa_CF=[_flags_pass(values, constant_flags)],
                   _sa_flags_pass=_flags_pass, _sa_CFI=constant_flags,
                   _sa_VC=[stamp(t) for t in plan.captured], _sa_WC=hold(plan.captured))
        for i, t in enumerate(plan.captured):
            env[f"_sa_C{i}"] = t
    head = _call_lines(n_inputs, kwargs, ins, env) if step is None \
        else _step_lines(step, kwargs, ins, env)
    lines = head + _state_lines(plans, state, st, env) + _stamp_lines(plan, state, st, held, env)
    sizes = []
    if plan.guard is not None:  # the sizes a plan with symbolic sizes serves
        env["_sa_sizes"] = plan.guard
        sizes = [f"        if not _sa_sizes(({', '.join(ins)},)):", "            return _sa_MISSED"]
    lines += ["    try:",
              f"        if not _sa_guard({', '.join(ins + st)}):",
              "            return _sa_MISSED", *sizes,
              "    except _sa_Exception:  # an input that is not a tensor",
              "        return _sa_MISSED"]
    if step is not None:  # the new tokens fit: the bound on the rows' lengths, then a step
        lines += ["    _sa_bound = _sa_c._bound + _sa_i0.shape[1] if _sa_c._bound is not None "
                  "else None",
                  f"    if _sa_bound is None or _sa_bound > {step.capacity}:",
                  "        return _sa_MISSED"]
    lines += ["    try:"]
    args = ", ".join(st + ins)
    if held:
        args += ", *_sa_CV"
    elif plan.constants_graph is not None:
        args += ", *_sa_constants(_sa_plan, [" + ", ".join(st) + "])"
    lines += [f"        {line}" for line in _inlined(plan.graph, args, env)]
    lines += _flag_lines(plan, constant_flags, queueable, env,
                         None if step is None else f"_sa_R, ({', '.join(ins)},), _sa_KI")
    lines.append("    _sa_plan.calls += 1")
    lines += ["    return " + _return(plan)] if step is None else _step_return(step)
    code = "\n".join(lines)
    exec(compile(code, f"<structattn replay of {type(declaration).__name__}>", "exec"), env)
    return env["run"]


def _return(plan) -> str:
    """What the function returns of ``_sa_result``: the single tensor; a flat tuple or list
    of tensors (no literals) built in place, without ``_output``'s walk of the output's tree
    (a step's output: measured in place, the walk costs as much as a small kernel); else the
    tree rebuilt by ``_output``."""
    if plan.single:
        return "_sa_result[0]"
    spec = plan.spec
    if not plan.literals and spec.type in (tuple, list) and plan.n_tensors \
            and spec.num_children == plan.n_tensors \
            and all(spec.child(i).is_leaf() for i in range(plan.n_tensors)):
        items = ", ".join(f"_sa_result[{i}]" for i in range(plan.n_tensors))
        return f"({items},)" if spec.type is tuple else f"[{items}]"
    return "_sa_output(_sa_plan, _sa_result)"


def _call_lines(n_inputs: int, kwargs: dict, ins: list, env: dict) -> list:
    """The function's head: an earlier call's failed check raised first; then this call's
    layer, input count and options compared with the plan's (plain values by type and
    value), the inputs unpacked, the global modes compared."""
    same_options = "".join(f" or _sa_type(_sa_kw.get({k!r})) is not _sa_{type(v).__name__}"
                           f" or _sa_kw[{k!r}] != {v!r}" for k, v in kwargs.items()
                           ) if all(v is not None for v in kwargs.values()) else None
    env["_sa_K"] = dict(kwargs)
    if same_options is None:  # a None among them: compared as the dict it is
        same_options = " or _sa_kw != _sa_K or any(_sa_type(v) is not _sa_type(_sa_K[k]) " \
                       "for k, v in _sa_kw.items())"
    options = f"_sa_len(_sa_kw) != {len(kwargs)}{same_options}"
    if type(kwargs) is MappingProxyType:  # read-only: the same object, the same options
        env["_sa_KI"] = kwargs  # (a caller's constant, e.g. a decoding step's ``_STEP``)
        options = f"_sa_kw is not _sa_KI and ({options})"
    return ["def run(_sa_layer, _sa_inputs, _sa_kw):",  # (``layer.declaration``: __getattr__'s)
            "    if _sa_Q.queue:  # an earlier call's failed check raises first",
            "        _sa_Q.settle()",
            f"    if _sa_layer._modules.get('declaration') is not _sa_D "
            f"or _sa_len(_sa_inputs) != {n_inputs} or {options}:",
            "        return _sa_MISSED",
            f"    {', '.join(ins)}, = _sa_inputs" if ins else "    pass",
            *_modes_lines(env)]


def _modes_lines(env: dict) -> list:
    """The global modes compared with the plan's: ``_modes`` inlined (one frame less), its
    callables bound in ``env``."""
    env.update(_sa_grad=torch.is_grad_enabled, _sa_inference=torch.is_inference_mode_enabled,
               _sa_any_autocast=any_autocast, _sa_autocast_modes=autocast_modes,
               _sa_slot=_slot, _sa_DEFAULT_CONTEXT=_DEFAULT_CONTEXT, _sa_environ=_environ,
               _sa_KERNELS_KEY=_KERNELS_KEY)
    return ["    if (_sa_D.__dict__.get('structure_version', 0), _sa_grad(), _sa_inference(), "
            "_sa_any_autocast() and _sa_autocast_modes(), "
            "_sa_slot.__dict__.get('context', _sa_DEFAULT_CONTEXT), _sa_VAL._DEFAULT, "
            "_sa_environ.get(_sa_KERNELS_KEY)) != _sa_M:  # ``_modes`` inlined: one frame less",
            "        return _sa_MISSED"]


def _step_lines(step: CacheStep, kwargs, ins: list, env: dict) -> list:
    """A decoding step's head: an earlier call's failed check raised first; then the call
    found to be ``layer(x_new, cache=c)`` with a cache of the step's type, read by its
    reading (which fixes the layer's declaration and the capacity) and of a one-dimensional
    batch (as the recorded call's, whose x_new the guard then compares); the plan's tensors
    taken from x_new and the cache; the global modes compared."""
    env.update(_sa_FC=step.cache_type, _sa_R=step.reading, _sa_KI=kwargs)
    stores = ", ".join(ins[1:4]) if step.state else f"{ins[1]}, {ins[2]}, _"
    return ["def run(_sa_layer, _sa_inputs, _sa_kw):",
            "    if _sa_Q.queue:  # an earlier call's failed check raises first",
            "        _sa_Q.settle()",
            "    if _sa_len(_sa_kw) != 1 or _sa_len(_sa_inputs) != 1:",
            "        return _sa_MISSED",
            "    _sa_c = _sa_kw.get('cache')",
            "    if _sa_type(_sa_c) is not _sa_FC or _sa_c._steps is not _sa_R "
            "or _sa_layer._modules.get('declaration') is not _sa_D "
            "or _sa_len(_sa_c.batch_shape) != 1:",
            "        return _sa_MISSED",
            f"    {ins[0]}, = _sa_inputs",
            f"    {stores} = _sa_c._stores",
            f"    {ins[-1]} = _sa_c._lengths",
            *_modes_lines(env)]


def _step_return(step: CacheStep) -> list:
    """A decoding step's tail: the plan's outputs ``(y, keys, values, ends[, state])`` written
    to the cache — its storage replaced only where a write was out of place (gradients
    flow) — and ``y`` returned."""
    same = "_sa_result[1] is not _sa_i1 or _sa_result[2] is not _sa_i2" + (
        " or _sa_result[4] is not _sa_i3" if step.state else "")
    state = "_sa_result[4]" if step.state else "None"
    return [f"    if {same}:",
            f"        _sa_c.stores = [_sa_result[1], _sa_result[2], {state}]",
            "    _sa_c._bound = _sa_bound",
            "    _sa_c._lengths = _sa_result[3]",
            f"    _sa_c.keys_read = {step.capacity}",
            "    return _sa_result[0]"]


def _state_lines(plans, state: list, st: list, env: dict) -> list:
    """The parameters and buffers fetched (``st``) and found to be the plan's tensors: by
    name from their modules' dicts, the dicts' sizes unchanged — or, with tied weights, by
    the module's own walk, which drops duplicates."""
    _, dicts, shared = plans._modules
    if shared or not state:
        env["_sa_ids"] = [id(t) for t in state]
        lines = ["    _sa_state = _sa_plans.state(_sa_D)",
                 "    if [_sa_id(t) for t in _sa_state] != _sa_ids:",
                 "        return _sa_MISSED"]
        return lines + ([f"    {', '.join(st)}, = _sa_state"] if st else [])
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
    return ["    try:"] + [f"        {f}" for f in fetch] + [
        "    except _sa_KeyError:",
        "        return _sa_MISSED",
        f"    if {' or '.join(same)}:",
        "        return _sa_MISSED"]


def _stamp_lines(plan, state: list, st: list, held: bool, env: dict) -> list:
    """Where a parameter changed (an optimizer step, ``p.data = …``: its ``stamp`` moved):
    found finite again, the constants (``held``) computed again, the stamps kept — the
    stamps last, so that another thread that sees them new sees the constants new too; and
    the same for the tensors the constants captured."""
    if not st:
        return []
    stamps = [stamp(t) for t in state]
    env.update(_sa_V=[v for v, _, _ in stamps], _sa_P=[p for _, p, _ in stamps],
               _sa_O=[o for _, _, o in stamps], _sa_W=hold(state))
    # ``stamp`` inlined: the version, the storage's address and the offset compared
    moved = " or ".join(
        f"{VERSION.format(s)} != _sa_V[{i}] or {STORAGE.format(s)} != _sa_P[{i}] "
        f"or {s}.storage_offset() != _sa_O[{i}]" if stamps[i][2] is not None
        else f"_sa_stamp({s})[:2] != (_sa_V[{i}], _sa_P[{i}])" for i, s in enumerate(st))
    now = ", ".join(st)
    refresh = [f"        _sa_CV[:] = _sa_constants(_sa_plan, [{now}])",
               "        _sa_CF[0] = _sa_flags_pass(_sa_CV, _sa_CFI)"] if held else []
    lines = [f"    if {moved}:",
             f"        if not _sa_plans.parameters_finite([{now}], _sa_D):",
             "            return _sa_MISSED", *refresh,
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
    return lines


def _flag_lines(plan, constant_flags: dict, queueable: bool, env: dict,
                step: str | None = None) -> list:
    """After the graph: its checks' verdicts read (on a GPU, ``queueable``, queued while
    ``set_validation(queued=True)``), and a call that fails one — or raises inside the
    graph — read again from the declaration, which raises the check's own message.
    ``step``: a decoding step's (``CacheStep``) reading and arguments, which a queued verdict
    re-reads; its failed call returns ``MISSED`` (the layer's own call reads it)."""
    n = plan.n_tensors
    checks = [f"not _sa_isfinite(_sa_float(_sa_result[{n + k}]))" if kind == "finite"
              else f"not _sa_result[{n + k}]" for k, kind in enumerate(plan.flags)
              if k not in constant_flags]
    queued = [f"_sa_result[{n + k}]" for k in range(len(plan.flags)) if k not in constant_flags]
    if constant_flags:
        checks.insert(0, "not _sa_CF[0]")
    lines = []
    if queueable and queued:  # on a GPU: the verdicts go to the host without waiting
        target = step or "_sa_layer, _sa_inputs, _sa_kw"
        lines += ["        if _sa_VAL._QUEUED:",
                  f"            _sa_Q.put(({', '.join(queued)},), _sa_partial("
                  f"_sa_call_failed, _sa_read, {target}))",
                  f"            _sa_failed = {'not _sa_CF[0]' if constant_flags else 'False'}",
                  "        else:",
                  f"            _sa_failed = {' or '.join(checks)}"]
    elif checks:
        lines += [f"        _sa_failed = {' or '.join(checks)}"]
    reread = "        return _sa_layer.interpret(*_sa_inputs, **_sa_kw)" if step is None \
        else "        return _sa_MISSED"
    lines += ["    except _sa_Exception:  # inside the graph: the reading raises the check's message",
              "        _sa_failed = True" if checks else reread]
    if checks:
        lines += ["    if _sa_failed:", reread]
    return lines


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
