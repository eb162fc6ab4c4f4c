"""Recording a plan: one reading of a compiled module at one signature traced by ``make_fx``
(pre-dispatch: composite operators stay whole), its checks made graph outputs, simplified
(``simplify``), its parameter-only part split off, and its nodes bound to public torch
calls. Part of the plan compiler (``structattn.compiling.replay``)."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException
from torch.utils import _pytree as pytree

from ..checking import _validation
from .internals import OpOverload, reparametrized, size_guard, trace, trace_fake, trace_symbolic
from .plan import Plan, _split, swapped
from .simplify import _drop_implied_checks, _impure, _simplify, _split_constants


def record(layer, names: list, state: list, inputs: tuple, kwargs: dict, *,
           symbolic: bool = False) -> Plan:
    """Trace one reading of ``layer`` at this signature into a ``Plan``; ``symbolic``: with
    the inputs' sizes as symbols, a plan for every size its ``guard`` accepts."""
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
        with swapped(), reparametrized(layer.declaration, dict(zip(names, flat[:k], strict=True))), \
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

    devices = sorted({t.device.index or 0 for t in (*state, *tensors) if t.is_cuda})
    try:
        graph, fakes = _trace(plan, reading, state, tensors, symbolic, devices)
    except Exception as err:  # the reading reads tensor values (or cannot be traced)
        plan.reason = _why(err)
        return plan
    graph.graph.eliminate_dead_code(is_impure_node=_impure)
    captured = [getattr(graph, n.target) for n in graph.graph.nodes if n.op == "get_attr"]
    differentiated = _differentiated(state, tensors, captured)
    _simplify(graph.graph, merge=not differentiated)
    _drop_implied_checks(graph.graph, plan, k)  # (the check below interprets the nodes: no
    # code is generated for the graph until its bindings are known)
    # the check of the bindings runs the graph on this call's tensors, drawing from the
    # generators as the replay would: its outputs serve the call (``plan.served``); where the
    # plan then serves nothing (its sizes refused), the generators are put back as they were
    drawn = _generators(devices)
    try:
        served = _bind_to_torch(graph, (*state, *tensors))
    except Exception as err:  # a kernel refused these values (checks off): the call is read
        _set_generators(devices, drawn)
        plan.reason = _why(err)
        return plan
    graph.recompile()
    if not _differentiated(state, captured):
        plan.constants_graph = _split_constants(graph, k)  # nothing to differentiate: fold
        if plan.constants_graph is not None:  # tensors the reading captured (a closure's)
            plan.captured = [getattr(plan.constants_graph, n.target)
                             for n in plan.constants_graph.graph.nodes if n.op == "get_attr"]
    if symbolic:
        plan.guard, plan.guards, specialized = size_guard(graph, fakes)
        if specialized or not plan.guard(tensors):
            plan.reason = ("the reading fixes the sizes of its inputs (it reads each one as a "
                           "number), so a plan with symbolic sizes would serve only these")
            _set_generators(devices, drawn)
            return plan
    # the tracer's notes on each node (its stack trace, a description of its value), which
    # only the passes above read: kept, a plan of a 200-step relaxation held ~380 MB of them
    for g in (graph, plan.constants_graph):
        for node in g.graph.nodes if g is not None else ():
            node.meta.clear()
    plan.graph = graph
    plan.served = (tuple(tensors), served, devices, drawn)
    return plan


def _trace(plan: Plan, reading, state: list, tensors: list, symbolic: bool, devices: list):
    """The reading's graph, and its fake inputs where ``symbolic``: traced on fake tensors
    (no tensor work: the recording call then computes once, in the check of the bindings);
    on the call's own tensors where that fails (an operator without a fake kernel), its
    random draws not advancing the generators the check then draws from."""
    if symbolic:
        plan.traced = "symbolic"
        return trace_symbolic(reading, state, tensors)
    try:
        plan.traced = "fake"
        return trace_fake(reading, [*state, *tensors]), None
    except DataDependentOutputException:  # a value read into Python: so would the real trace
        raise
    except Exception:  # noqa: BLE001  (the real trace below says why, if it fails too)
        pass
    plan.traced = "real"
    with torch.random.fork_rng(devices=devices):
        return trace(reading)(*state, *tensors), None


def withdraw(plan: Plan) -> None:
    """The recording's run undone, where the plan is not to serve its call after all: its
    outputs dropped and the generators put back as they were before it drew."""
    if plan.served is not None:
        _set_generators(*plan.served[2:])
        plan.served = None


def _generators(devices: list) -> tuple:
    """The CPU's and these CUDA devices' generator states (``torch.random.fork_rng``'s)."""
    return torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices]


def _set_generators(devices: list, states: tuple) -> None:
    cpu, cuda = states
    torch.set_rng_state(cpu)
    for d, s in zip(devices, cuda, strict=True):
        torch.cuda.set_rng_state(s, d)


def _differentiated(*groups) -> bool:
    """Whether a gradient may flow through a recording of these tensors."""
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for ts in groups for t in ts)



def _why(err: BaseException) -> str:
    """A plan's ``reason`` where its recording failed: where, the error's type and first line."""
    return f"{_where(err)}{type(err).__name__}: {str(err).splitlines()[0][:200]}"


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
    if not isinstance(op, OpOverload) or op.namespace != "aten":
        return None
    name = op.overloadpacket.__name__
    for home in (torch, torch._C._nn, torch._C._linalg, torch._C._special, torch._C._fft):
        fn = getattr(home, name, None)
        if fn is not None and type(fn).__name__ == "builtin_function_or_method":
            return fn
    method = getattr(torch.Tensor, name, None)
    return method if type(method).__name__ == "method_descriptor" else None


def _as_narrow(out, args: tuple, kwargs: dict) -> tuple | None:
    """A unit-step ``aten.slice`` has no public binding; ``torch.narrow`` is the same view
    (the signature fixes the size, so the length is known): its ``(dim, start, length)``
    where it gives ``out`` from these arguments, else None."""
    x, dim, start, end, step = (*args, *[None] * (5 - len(args)))[:5] if not kwargs \
        else (None,) * 5
    if not (isinstance(x, torch.Tensor) and step in (None, 1) and isinstance(dim, int)
            and isinstance(start, int) and isinstance(end, int)):
        return None
    size = x.shape[dim]
    lo = max(0, min(size, start + size if start < 0 else start))
    hi = max(lo, min(size, end + size if end < 0 else end))
    return (dim, lo, hi - lo) if _same(out, torch.narrow(x, dim, lo, hi - lo)) else None


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and a.stride() == b.stride() and a.requires_grad == b.requires_grad
                and torch.equal(a, b))
    if isinstance(a, (tuple, list)):
        return (isinstance(b, (tuple, list)) and len(a) == len(b)
                and all(_same(x, y) for x, y in zip(a, b, strict=True)))
    return type(a) is type(b) and a == b


#: whether an overload's binding returns what it does, by the call's structure
#: (``_call_key``): found once, by running both, then known for every graph recorded
_BINDS: dict = {}


def _call_key(op, args: tuple, kwargs: dict):
    """What decides how a torch binding parses a call and which overload it reaches: the
    overload, and each argument's kind — a tensor's dtype, rank, layout, device type,
    contiguity and ``requires_grad``, a number's type, a string's or bool's value, a list's
    items' kinds — not the tensors' values nor the numbers'; None where an argument is of
    another kind (then the binding is checked by running it)."""
    def kind(x):
        if isinstance(x, torch.Tensor):
            return ("T", x.dtype, x.dim(), x.layout, x.device.type, x.is_contiguous(),
                    x.requires_grad)
        if x is None or isinstance(x, (bool, str, torch.dtype, torch.device, torch.layout,
                                       torch.memory_format)):
            return x
        if isinstance(x, (int, float, complex)):
            return type(x)
        if isinstance(x, (list, tuple)):
            return (type(x), *(kind(v) for v in x))
        raise TypeError

    try:
        return (op, *(kind(x) for x in args), *((k, kind(v)) for k, v in sorted(kwargs.items())))
    except TypeError:
        return None


def _binds(fn, out, op, args: tuple, kwargs: dict) -> bool:
    """Whether the binding ``fn`` returns ``out``, what ``op`` returned on these arguments:
    known by the call's structure (``_BINDS``), else found by running it."""
    key = _call_key(op, args, kwargs)
    verdict = _BINDS.get(key) if key is not None else None
    if verdict is None:
        try:
            verdict = _same(out, fn(*args, **kwargs))
        except Exception:  # the binding parses these arguments differently
            verdict = False
        if key is not None:
            _BINDS[key] = verdict
    return verdict


def _draws_nothing(node, args, kwargs) -> bool:
    """A seeded overload called so that it draws nothing: attention without dropout."""
    if node.target is torch.ops.aten.scaled_dot_product_attention.default:
        p = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
        return p == 0.0
    return False


def _bind_to_torch(graph: torch.fx.GraphModule, args: tuple) -> list:
    """Call each aten overload of ``graph`` through its torch binding where that binding,
    given the node's own arguments at this signature, returns the same thing (checked here,
    node by node, on the recording's inputs: the graph is straight-line, so every node runs).
    Overloads that draw at random keep their overload object, and so do those that mutate,
    but for those writing into their first argument alone whose binding writes the same into
    a copy of it (``scatter_``); ``aten.alias`` becomes ``Tensor.view_as``. A binding is run
    beside its overload once per call structure in the process (``_BINDS``), so a recording
    runs the graph about once. Returns the graph's outputs on ``args`` (the overloads')."""
    bound = {}

    narrowed = {}

    class Check(torch.fx.Interpreter):
        def run_node(self, n):
            if n.op == "call_function" and isinstance(n.target, OpOverload) \
                    and n.target._schema.is_mutable:
                return self.mutating(n)
            out = super().run_node(n)
            if n.op == "call_function" and n.target is torch.ops.aten.alias.default:
                # an alias has no public binding; ``Tensor.view_as`` itself is the same view
                (x,) = self.fetch_args_kwargs_from_env(n)[0]
                if _same(out, torch.Tensor.view_as(x, x)):
                    aliased.append(n)
                return out
            if n.op == "call_function" and n.target is torch.ops.aten.slice.Tensor:
                narrow = _as_narrow(out, *self.fetch_args_kwargs_from_env(n))
                if narrow is not None:
                    narrowed[n] = (n.args[0], *narrow)
                return out
            fn = _binding(n.target) if n.op == "call_function" else None
            if fn is None:
                return out
            a, kw = self.fetch_args_kwargs_from_env(n)
            if torch.Tag.nondeterministic_seeded in n.target.tags and not _draws_nothing(n, a, kw):
                return out
            if _binds(fn, out, n.target, a, kw):
                bound[n] = fn
            return out

        def mutating(self, n):
            """An overload that writes into its first argument alone (``scatter_``) is
            bound where its binding writes the same into a copy of that argument."""
            fn = _binding(n.target)
            a, kw = self.fetch_args_kwargs_from_env(n)
            written = [arg.alias_info is not None and arg.alias_info.is_write
                       for arg in n.target._schema.arguments]
            copy = None
            if fn is not None and written and written[0] and not any(written[1:]) \
                    and a and isinstance(a[0], torch.Tensor) \
                    and torch.Tag.nondeterministic_seeded not in n.target.tags:
                copy = a[0].detach().clone()
            out = super().run_node(n)
            if copy is not None and out is a[0]:
                try:
                    alt = fn(copy, *a[1:], **kw)
                except Exception:  # the binding parses these arguments differently
                    return out
                if alt is copy and copy.dtype == out.dtype and copy.shape == out.shape \
                        and copy.stride() == out.stride() and torch.equal(copy, out):
                    bound[n] = fn
            return out

    aliased = []
    outputs = Check(graph).run(*args)
    for node in aliased:
        node.target, node.args, node.kwargs = torch.Tensor.view_as, (node.args[0],) * 2, {}
    for node, fn in bound.items():
        node.target = fn
    for node, narrow in narrowed.items():
        node.target, node.args, node.kwargs = torch.narrow, narrow, {}
    return outputs
