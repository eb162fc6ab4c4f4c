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

from ..declaration import as_declaration, example_inputs
from ..readers import trace_structure
from .graphviz import _COLOURS  # one palette: a family has the same colour in both views


def _esc(text: str) -> str:
    return graphviz.escape(text).replace("\n", "\\n")


def _node_label(ns) -> str:
    d = ns.states.shape[-1]
    if ns.observed:
        return f"{ns.name}_i\n" + ("memory (learned)" if getattr(ns, "memory", False)
                                    else "observed")
    o = ns.options
    update = o.update if isinstance(o.update, str) else getattr(o.update, "__name__", "callable")
    prior = "flat" if ns.scale is None else "N(loc, scale²)"
    return f"{ns.name}_i ~ {prior}\nlatent: {update} × {o.steps}" + (
        f", tol {o.tol:g}" if o.tol else "") + f"\n(d = {d})"


def model_graph(model, *inputs, unrolled: bool = False) -> graphviz.Digraph:
    """The declaration of ``model`` in plate notation (module docstring). Without inputs the
    declaration's ``example_inputs()`` fix the sizes."""
    decl = as_declaration(model)
    if not inputs:
        inputs = example_inputs(decl, "model_graph")
    s = trace_structure(decl.model, *inputs)
    dot = graphviz.Digraph(decl.display_name, graph_attr={
        "fontname": "Helvetica", "labelloc": "t", "rankdir": "TB", "compound": "true",
        "nodesep": "0.6", "ranksep": "0.9"},
        node_attr={"fontname": "Helvetica", "fontsize": "10"},
        edge_attr={"fontname": "Helvetica", "fontsize": "9"})
    ids = {}
    for k, ns in enumerate(s.node_sets.values()):
        ids[ns.name] = f"ns{k}"
        with dot.subgraph(name=f"cluster_{k}") as c:
            c.attr(label=_esc(f"{ns.name}: i = 1..{ns.size}"), style="rounded",
                   color="#555555", fontsize="10", labeljust="r")
            style = ({"style": "filled", "fillcolor": "#d9d9d9"} if ns.observed
                     else {"style": "dashed", "penwidth": "1.6"})
            shape = "ellipse"
            if getattr(ns, "memory", False):  # stored patterns / prototypes
                style, shape = {"style": "filled,rounded", "fillcolor": "#fff2cc"}, "box"
            c.node(f"ns{k}", _esc(_node_label(ns)), shape=shape, **style)
    for f_i, (name, fam) in enumerate(s.families.items()):
        colour = _COLOURS[f_i % len(_COLOURS)]
        pots = ", ".join(p.describe() for p in fam.potentials) or "none"
        value = fam.value.describe() if fam.value is not None else "none"
        label = (f"φ '{name}' ~ {fam.prior.describe()}\nψ: {pots}\nv: {value}"
                 + (f"\nheads: {fam.heads}" if fam.heads > 1 else ""))
        src, dst = ids[fam.parents.name], ids[fam.children.name]
        dot.edge(src, dst, label=_esc(label), color=colour, fontcolor=colour, penwidth="1.6")
        hyper = fam.prior.hyper_prior()
        if hyper is not None:  # e.g. q_i ~ Beta(a, b): an open node feeding the family
            hid = f"hyper{f_i}"
            dot.node(hid, _esc(hyper), shape="ellipse", style="dashed", color=colour,
                     fontcolor=colour)
            dot.edge(hid, dst, style="dashed", color=colour, arrowhead="odot")
    for e_i, (name, term) in enumerate((s.energies or {}).items()):
        eid = f"energy{e_i}"
        dot.node(eid, _esc(f"energy '{name}'"), shape="box", style="rounded")
        for ns in term.node_sets:
            dot.edge(eid, ids[ns.name], dir="none", style="dotted")
    title = [f"{decl.display_name} — the declaration (plate notation)",
             "shaded: observed · open, dashed: latent · arrows: parents → children of an edge "
             "family"]
    if unrolled and s.latents:
        _unroll(dot, s, ids)
        title.append("below: the compiled iteration unrolled, one column per step")
    dot.attr(label=_esc("\n".join(title)))
    return dot


def _unroll(dot, s, ids) -> None:
    """z⁰ → z¹ → … → z^T per latent (at most the first three steps and the last), each step
    reading the families that touch it: observed parents (grey, dotted) and the other
    latents' previous iterates (coloured, dashed)."""
    shown = {}
    for name, z in s.latents.items():
        T = z.options.steps
        shown[name] = list(range(T + 1)) if T <= 3 else [0, 1, 2, T]
    for name, z in s.latents.items():
        steps, T = shown[name], z.options.steps
        touching = [f for f, fam in s.families.items() if z is fam.children or z is fam.parents]
        update = z.options.update if isinstance(z.options.update, str) else "a callable update"
        with dot.subgraph(name=f"cluster_unrolled_{name}") as c:
            c.attr(label=_esc(f"{name} unrolled: {T} steps of {update}"),
                   style="rounded,dashed", color="#888888", fontsize="10")
            for t in steps:
                c.node(f"{ids[name]}_t{t}", _esc(f"{name}^({t})"), shape="ellipse",
                       style="dashed")
            for a, b in zip(steps, steps[1:], strict=False):
                label = " + ".join(f"E_φ'{f}'" for f in touching) or "prior"
                c.edge(f"{ids[name]}_t{a}", f"{ids[name]}_t{b}",
                       label=_esc(label if b == a + 1 else f"… {b - a} steps …"),
                       style="solid" if b == a + 1 else "dotted")
        for f_i, (f, fam) in enumerate(s.families.items()):
            if f not in touching:
                continue
            other = fam.parents if fam.children is z else fam.children
            if other is z:
                continue
            for t in steps[1:]:
                if other.observed:
                    dot.edge(ids[other.name], f"{ids[name]}_t{t}", style="dotted",
                             color="#888888", arrowsize="0.5")
                elif t - 1 in shown.get(other.name, ()):  # block coordinate: the other's last
                    dot.edge(f"{ids[other.name]}_t{t - 1}", f"{ids[name]}_t{t}",
                             style="dashed", color=_COLOURS[f_i % len(_COLOURS)],
                             arrowsize="0.5")
