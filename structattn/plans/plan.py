"""A plan and its replay: what one input signature's calls run (``Plan``), how a tensor's
values are named between calls (``stamp``, ``hold``), and ``replay``, which runs a plan's graph
and reads — or, on a GPU, queues — its checks' verdicts. One reading or recording runs at a
time in the process (``_RECORDING``, ``_read``). Part of the plan compiler
(``structattn.compiling.replay``)."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

import torch
from torch.utils import _pytree as pytree

from ..checking import _validation
from ..checking.verdicts import call_failed, queued_on
from .internals import storage_id, storage_ref, version

#: one recording or reading at a time in the process: ``make_fx`` keeps its tracing state
#: (the pre-dispatch mode stack, the fx patcher) in globals, and two threads recording at once
#: corrupt each other's (tested: 8 threads' first calls released together); while one records,
#: fx's patch of ``nn.Module.__call__`` routes another thread's reading through its tracer,
#: and the two hung (seen once in eight threads' first calls of a shared layer); the fast
#: path's code generation too (``ast`` and ``compile`` from two threads at once raised
#: CPython 3.11's "AST constructor recursion depth mismatch"). Re-entrant: a reading may call
#: another compiled module.
_RECORDING = threading.RLock()


#: ``[generation, thread]``: the generation is odd while a recording's trace has swapped its
#: tensors (fake ones: no tensor work) into a declaration's modules — which another thread,
#: replaying a module of the same declaration, must not read (``unswapped``); ``thread``: the
#: one tracing, whose nested calls read the swapped tensors as the trace's own
SWAP = [0, None]


@contextmanager
def swapped():
    """The span in which a trace has swapped tensors into a declaration (``SWAP``)."""
    SWAP[1] = threading.get_ident()
    SWAP[0] += 1
    try:
        yield
    finally:
        SWAP[0] += 1
        SWAP[1] = None


def unswapped(read):
    """``read()`` (a module's parameters and buffers), read again after any trace in another
    thread that swapped fake tensors in while it was read (waiting for that trace to end)."""
    while True:
        generation = SWAP[0]
        out = read()
        if generation % 2 == 0 and SWAP[0] == generation or SWAP[1] == threading.get_ident():
            return out
        with _RECORDING:  # the trace holds it
            pass


def _read(layer, inputs: tuple, kwargs: dict):
    """The declaration read for one call (no plan), one reading or recording at a time."""
    with _RECORDING:
        return layer.interpret(*inputs, **kwargs)


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
    #: how the reading was traced: ``"fake"`` (on fake tensors: no tensor work), ``"real"``
    #: (on the call's tensors, where the fake trace failed), ``"symbolic"`` (symbolic sizes)
    traced: str | None = None
    calls: int = 0  # replays served
    single: bool = False  # the output is one tensor
    #: what depends on the parameters alone, computed once per change of them (inference
    #: plans): its graph, the parameters' versions it was computed at, and its values
    constants_graph: torch.fx.GraphModule | None = None
    constants_versions: list | None = None  # their ``stamp``s
    constants_refs: list = field(default_factory=list)  # ``hold``s their storages
    constants_values: list = field(default_factory=list)
    captured: list = field(default_factory=list)  # tensors the constants read besides the state
    #: a plan with symbolic sizes (``Plans.dynamic``): ``guard(tensors)``, True for the input
    #: sizes it serves, and ``guards``, the conditions as text (None: every size); None for a
    #: plan of one signature
    guard: object = None
    guards: str | None = None
    #: its generated fast path (``_Last``), made on its first replay and kept: calls that
    #: alternate between plans (checks on and off, two shapes) would otherwise generate anew
    last: object = None
    #: ``(tensors, outputs, devices, generators)``: the recording call's tensor inputs and the
    #: graph's outputs on them (computed by the check of its bindings), which serve that call
    #: in place of a replay (``serve``), and the generators' states before that run drew
    #: (``record.withdraw``); None once served
    served: tuple | None = None


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
        return (version(t), storage_id(t), t.storage_offset())
    except (RuntimeError, NotImplementedError, TypeError):
        return (version(t), id(t), None)


def hold(tensors) -> list:
    """Weak references to the tensors' storages: while held, no new storage can take the
    address a ``stamp`` names (see ``stamp``)."""
    refs = []
    for t in tensors:
        try:
            refs.append(storage_ref(t))
        except (RuntimeError, NotImplementedError, TypeError):
            pass
    return refs


_FAILED = object()


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


def _flags_pass(values: list, flags: dict) -> bool:
    """Whether the constant flags ``flags`` (``_constant_flags``) pass on these values."""
    return all(_validation.verdict(values[i]) for i in flags.values())


def replay(plan: Plan, state: list, inputs: tuple, split: bool = True, queue=None):
    """Run the plan's graph on the current parameters and these inputs (``split=False``:
    known to be tensors); ``_FAILED`` when a value check failed (the caller re-reads the call,
    which raises its message). ``queue``: ``(verdicts, layer, inputs, kwargs)``, where the
    verdicts go on a GPU (``structattn.checking.verdicts``) instead of being read here."""
    tensors = _split(inputs)[0] if split else inputs
    if plan.constants_graph is not None:
        result = plan.graph.forward(*state, *tensors, *_constants(plan, state))
    else:
        result = plan.graph.forward(*state, *tensors)
    return _finish(plan, result, queue)


def serve(plan: Plan, state: list, inputs: tuple, queue=None):
    """``replay``, but for the recording call itself: its output from the graph's outputs
    the recording computed on its tensors (``Plan.served``, then dropped), so that the call
    costs the trace and that run, not a replay as well. Which call recorded is known by its
    tensors' identity (another thread may find the plan first)."""
    served = plan.served
    if served is not None:
        tensors = _split(inputs)[0]
        if len(tensors) == len(served[0]) and all(
                a is b for a, b in zip(tensors, served[0], strict=True)):
            plan.served = None
            return _finish(plan, served[1], None)
    return replay(plan, state, inputs, queue=queue)


def _finish(plan: Plan, result: list, queue):
    """The call's output from the graph's outputs ``result``, its checks read (``replay``)."""
    if plan.flags:
        flags = result[len(result) - len(plan.flags):]
        if queue is not None and queued_on(flags[0].device):
            verdicts, layer, args, kwargs = queue
            verdicts.put(flags, partial(call_failed, _read, layer, args, kwargs))
        elif not all(_validation.verdict(f) for f in flags):
            return _FAILED
    plan.calls += 1
    return result[0] if plan.single else _output(plan, result)
