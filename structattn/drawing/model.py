"""The declaration itself, drawn in plate notation: node sets, edge families, priors.

``model_graph(model, *inputs, unrolled=False)`` → ``graphviz.Digraph``:

- one plate (cluster) per node set, ``name: n × d``, holding its node ``x_i``: observed
  shaded, latent open and dashed, with its prior and update rule (``z ~ N(loc, scale²);
  cccp × T``);
- one edge per family, parents → children, labelled with what the model says of it:
  ``φ 'name' ~ prior (support)``, its potentials ψ, its value v and its heads; a prior with
  a hyper-prior (the geometric–Beta's ``q_i ~ Beta(a, b)``) gets its own open node;
- node-level energies (``structattn.energy``) as boxes joined to the node sets they touch;
- ``unrolled=True``: each latent node set as its chain of iterates z⁰ → z¹ → … → z^T, every
  step reading the families that touch it (the compiled loop, one step per column).

This complements ``render`` (the implied adjacency, one panel per family and head).
"""

from __future__ import annotations

import graphviz
import torch

from ..declaration import as_declaration, example_inputs
from ..iterative.iterate import touches
from ..latent import LatentNodeSet
from ..nodes import DeterministicNodeSet, depends_on
from ..readers import trace_structure
from ..readers.structure import TraceStructure
from .graphviz import _COLOURS  # one palette: a family has the same colour in both views


def _esc(text: str) -> str:
    return graphviz.escape(text).replace("\n", "\\n")


def _node_label(ns, memories: dict) -> str:
    d = ns.states.shape[-1]
    if isinstance(ns, DeterministicNodeSet):
        return (f"{ns.name}_i = f({', '.join(s.name for s in ns.sources)})\ndeterministic"
                f"\n(d = {d})")
    if ns.observed:
        if not getattr(ns, "memory", False):
            return f"{ns.name}_i\nobserved"
        return f"{ns.name}_i\nmemory ({memories.get(ns.name, 'fixed')})"
    o = ns.options
    update = o.update if isinstance(o.update, str) else getattr(o.update, "__name__", "callable")
    prior = "flat" if ns.scale is None else "N(loc, scale²)"
    return f"{ns.name}_i ~ {prior}\nlatent: {update} × {o.steps}" + (
        f", tol {o.tol:g}" if o.tol else "") + f"\n(d = {d})"


def _plate(dot, k: int, ns, s, colours: dict, sources: dict, memories: dict) -> None:
    """Node set ``ns``'s plate: its node (shaded observed, dashed latent, dotted
    deterministic, a box for memories), the plate's label beside it, and the hyper-prior of
    every family whose children it is."""
    with dot.subgraph(name=f"cluster_{k}") as c:
        c.attr(style="rounded", color="#555555")
        # the plate's label is a node beside x_i: edges are routed around nodes, never
        # across them (a cluster label is not an obstacle to the router)
        with c.subgraph() as row:
            row.attr(rank="same")
            row.node(f"ns{k}_plate", _esc(f"{ns.name}: i = 1..{ns.size}"),
                     shape="plaintext", fontsize="10", fontcolor="#555555")
            row.node(f"ns{k}")
            row.edge(f"ns{k}", f"ns{k}_plate", style="invis")
        style = ({"style": "filled", "fillcolor": "#d9d9d9"} if ns.observed
                 else {"style": "dashed", "penwidth": "1.6"})
        shape = "ellipse"
        if isinstance(ns, DeterministicNodeSet):  # a function of others: dotted
            style = {"style": "dotted", "penwidth": "1.6"}
        if getattr(ns, "memory", False):  # stored patterns / prototypes
            style, shape = {"style": "filled,rounded", "fillcolor": "#fff2cc"}, "box"
        label = _node_label(ns, memories)
        if sources.get(ns.name):
            label += "\nstarts from " + ", ".join(sources[ns.name])
        c.node(f"ns{k}", _esc(label), shape=shape, **style)
        for f_i, (name, fam) in enumerate(s.families.items()):
            hyper = fam.prior.hyper_prior()
            if hyper is None or fam.children is not ns:
                continue
            # e.g. q_i ~ Beta(a, b): one per child i, so inside the children's plate,
            # an open node feeding the family
            colour = colours[name]
            c.node(f"hyper{f_i}", _esc(hyper), shape="ellipse", style="dashed",
                   color=colour, fontcolor=colour)
            c.edge(f"hyper{f_i}", f"ns{k}", style="dashed", color=colour,
                   arrowhead="odot")


def model_graph(model, *inputs, unrolled: bool = False) -> graphviz.Digraph:
    """Draw the declaration of ``model`` in plate notation: node sets, edge families, priors.

    One plate per node set (observed shaded, latent open and dashed, with its prior and
    update rule), one edge per family from parents to children, labelled with its prior, its
    potentials ψ, its value v and its heads; a hyper-prior gets its own open node and a
    node-level energy (``structattn.energy``) a box joined to the node sets it touches. This
    complements ``render``, which draws the implied adjacency.

    Args:
        model (Declaration | Callable): a ``structattn.Declaration`` (e.g. a catalogue model)
            or a Pyro program using ``structattn.nodes``/``edges``/``potential``/``value``.
        *inputs (Any): the model's inputs, as it is called with them (e.g. ``x``,
            ``(*batch, N, d)``); they fix the node sets' sizes. Without any, the
            declaration's ``example_inputs()`` fix them.
        unrolled: also draw each latent node set as its chain of iterates z⁰ → z¹ → … → z^T
            (at most the first three steps and the last), each step reading the families
            that touch it. No effect on a model without latent node sets.

    Returns:
        The drawing, a ``graphviz.Digraph``.

    Raises:
        ValueError: ``model`` is neither a ``Declaration`` nor callable.
        NotImplementedError: no inputs are given and the declaration has no
            ``example_inputs()``.
    """
    decl = as_declaration(model)
    if not inputs:
        inputs = example_inputs(decl, "model_graph")
    s = trace_structure(decl.model, *inputs)
    dot = graphviz.Digraph(decl.display_name, graph_attr={
        "fontname": "Helvetica", "labelloc": "t", "rankdir": "TB", "compound": "true",
        "nodesep": "0.6", "ranksep": "0.9"},
        node_attr={"fontname": "Helvetica", "fontsize": "10"},
        edge_attr={"fontname": "Helvetica", "fontsize": "9"})
    ids = {ns.name: f"ns{k}" for k, ns in enumerate(s.node_sets.values())}
    colours = {name: _COLOURS[f_i % len(_COLOURS)] for f_i, name in enumerate(s.families)}
    sources = _initial_sources(decl, inputs) if s.latents else {}
    memories = _memory_sources(decl, inputs) if any(
        getattr(ns, "memory", False) for ns in s.node_sets.values()) else {}
    for k, ns in enumerate(s.node_sets.values()):
        _plate(dot, k, ns, s, colours, sources, memories)
    for name, fam in s.families.items():
        colour = colours[name]
        pots = ", ".join(p.describe() for p in fam.potentials) or "none"
        value = fam.value.describe() if fam.value is not None else "none"
        label = (f"φ '{name}' ~ {fam.prior.describe()}\nψ: {pots}\nv: {value}"
                 + (f"\nheads: {fam.heads}" if fam.heads > 1 else ""))
        src, dst = ids[fam.parents.name], ids[fam.children.name]
        dot.edge(src, dst, label=_esc(label), color=colour, fontcolor=colour, penwidth="1.6")
    for ns in s.node_sets.values():  # what a deterministic node set is computed from
        for src in getattr(ns, "sources", ()):
            dot.edge(ids[src.name], ids[ns.name], label="f", style="dashed", color="#555555",
                     fontcolor="#555555", arrowsize="0.6")
    for e_i, (name, term) in enumerate((s.energies or {}).items()):
        eid = f"energy{e_i}"
        dot.node(eid, _esc(f"energy '{name}'"), shape="box", style="rounded")
        for ns in term.node_sets:
            dot.edge(eid, ids[ns.name], dir="none", style="dotted")
    title = [f"{decl.display_name} — the declaration (plate notation)",
             "shaded: observed · open, dashed: latent · arrows: parents → children of an edge "
             "family"]
    if any(isinstance(ns, DeterministicNodeSet) for ns in s.node_sets.values()):
        title.append("dotted: deterministic (computed from the node sets its dashed f arrows "
                     "come from)")
    if unrolled and s.latents:
        _unroll(dot, s, ids, sources)
        title.append("below: the compiled iteration unrolled, one column per step")
    dot.attr(label=_esc("\n".join(title)))
    return dot


def _memory_sources(decl, inputs) -> dict:
    """Where each memory node set's states come from, read from autograd (the declaration run
    once with gradients on, the inputs requiring them): "inputs" (stored patterns computed from
    the data), "learned" (from parameters alone) or "fixed" (a registered buffer, a
    constant)."""
    traced = tuple(x.detach().requires_grad_().clone()
                   if torch.is_tensor(x) and x.is_floating_point() else x for x in inputs)
    data = [x for x in traced if torch.is_tensor(x) and x.requires_grad]
    with torch.enable_grad(), TraceStructure(None) as reader:
        decl.model(*traced)
    found = {}
    for ns in (ns for ns in reader.node_sets.values() if getattr(ns, "memory", False)):
        if not ns.states.requires_grad:
            found[ns.name] = "fixed"
            continue
        grads = torch.autograd.grad(ns.states.sum(), data, retain_graph=True,
                                    allow_unused=True) if data else ()
        found[ns.name] = "inputs" if any(g is not None for g in grads) else "learned"
    return found


def _initial_sources(decl, inputs) -> dict:
    """``{latent: [observed node sets its initial state is computed from]}`` (Hopfield's
    state⁰ = W_Q·queries), read from autograd's graph: the declaration is run once with
    floating inputs that require gradients, and a node set is a source of z⁰ when z⁰ is
    computed from its states (connected in the graph, whatever the values)."""
    traced = tuple(x.detach().requires_grad_().clone()  # not a leaf: in-place ops stay legal
                   if torch.is_tensor(x) and x.is_floating_point() else x for x in inputs)
    with torch.enable_grad(), TraceStructure(None) as reader:
        decl.model(*traced)
    node_sets = reader.node_sets.values()
    sources = {}
    for z in (ns for ns in node_sets if isinstance(ns, LatentNodeSet)):
        found = []
        for ns in (ns for ns in node_sets if ns.observed):
            if z.init is ns.states:
                found.append(ns.name)
            elif z.init.requires_grad and ns.states.requires_grad:
                g, = torch.autograd.grad(z.init, ns.states, torch.ones_like(z.init),
                                         retain_graph=True, allow_unused=True)
                if g is not None:
                    found.append(ns.name)
        sources[z.name] = found
    return sources


def _unroll(dot, s, ids, sources) -> None:
    """z⁰ → z¹ → … → z^T per latent (at most the first three steps and the last), z⁰ fed by
    the observed node sets it is computed from, each step reading the families that touch
    it: observed parents (grey, dotted) and the other latents' previous iterates (coloured,
    dashed)."""
    shown = {}
    for name, z in s.latents.items():
        T = z.options.steps
        shown[name] = list(range(T + 1)) if T <= 3 else [0, 1, 2, T]
    for name, z in s.latents.items():
        steps, T = shown[name], z.options.steps
        touching = [f for f, fam in s.families.items() if touches(fam, z)]
        update = z.options.update if isinstance(z.options.update, str) else "a callable update"
        with dot.subgraph(name=f"cluster_unrolled_{name}") as c:
            c.attr(style="rounded,dashed", color="#888888")
            for t in steps:
                c.node(f"{ids[name]}_t{t}", _esc(f"{name}^({t})"), shape="ellipse",
                       style="dashed")
            with c.subgraph() as row:  # the box's label: a node, which edges go around
                row.attr(rank="same")
                row.node(f"{ids[name]}_unrolled", _esc(f"{name} unrolled:\n{T} steps of {update}"),
                         shape="plaintext", fontsize="10", fontcolor="#555555")
                row.edge(f"{ids[name]}_t0", f"{ids[name]}_unrolled", style="invis")
            for a, b in zip(steps, steps[1:], strict=False):
                label = " + ".join(f"E_φ'{f}'" for f in touching) or "prior"
                c.edge(f"{ids[name]}_t{a}", f"{ids[name]}_t{b}",
                       label=_esc(label if b == a + 1 else f"… {b - a} steps …"),
                       style="solid" if b == a + 1 else "dotted")
        for src in sources.get(name, ()):  # where z⁰ comes from (e.g. W_Q·queries)
            dot.edge(ids[src], f"{ids[name]}_t0", label="initial state", color="#555555",
                     fontcolor="#555555", style="solid", arrowsize="0.6")
        for f_i, (f, fam) in enumerate(s.families.items()):
            if f not in touching:
                continue
            other = fam.parents if depends_on(fam.children, z) else fam.children
            if depends_on(other, z):
                continue
            for src in getattr(other, "sources", ()):  # a deterministic set: its sources
                if not src.observed:
                    other = src
            for t in steps[1:]:
                if other.observed:
                    dot.edge(ids[other.name], f"{ids[name]}_t{t}", style="dotted",
                             color="#888888", arrowsize="0.5")
                elif t - 1 in shown.get(other.name, ()):  # block coordinate: the other's last
                    dot.edge(f"{ids[other.name]}_t{t - 1}", f"{ids[name]}_t{t}",
                             style="dashed", color=_COLOURS[f_i % len(_COLOURS)],
                             arrowsize="0.5")
