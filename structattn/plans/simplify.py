"""Simplifying a recorded graph, each rewrite keeping every value bit for bit: view chains
that end where they began (``_simplify``), checks implied by others (``_drop_implied_checks``),
and what depends on the parameters alone split into a constants graph (``_split_constants``).
Part of the plan compiler (``structattn.compiling.replay``)."""

from __future__ import annotations

import torch

from .internals import OpOverload
from .plan import Plan

#: view operators whose chains may end where they began (``squeeze(unsqueeze(x))``,
#: ``transpose(transpose(x))``, ``expand(x, x.shape)``, ``x.to(x.dtype)``)
_RESHAPES = {torch.ops.aten.squeeze, torch.ops.aten.unsqueeze, torch.ops.aten.transpose,
             torch.ops.aten.expand, torch.ops.aten.to, torch.ops.aten.view,
             torch.ops.aten.reshape, torch.ops.aten.flatten, torch.ops.aten.unflatten,
             torch.ops.aten.permute, torch.ops.aten.slice, torch.ops.aten.t}


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
        if not isinstance(n.target, OpOverload):  # a grad-mode switch, …
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
    while node.op == "call_function" and isinstance(node.target, OpOverload) \
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
    while (node.op == "call_function" and isinstance(node.target, OpOverload)
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
    return (node.op == "call_function" and isinstance(target, OpOverload)
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
           and isinstance(node.target, OpOverload)
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


def _impure(node) -> bool:
    """Random draws stay (they advance the generator as the reading did) besides fx's own rule;
    an unread ``detach_`` of a tensor nothing else reads (a constant made under no_grad whose
    reader moved to the constants' graph) goes."""
    target = node.target
    if target is torch.ops.aten.detach_.default and not node.users:
        return any(u is not node for u in node.args[0].users)
    tags = getattr(target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags or node.is_impure()
