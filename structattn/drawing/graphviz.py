"""Draw the adjacency with graphviz: parents above, children below, one panel per head.

Edge width and opacity are the prior p(φ_i = j) (declared structure) or the
posterior p(φ_i = j | x) (inferred). Node and family names are escaped and
never used as DOT identifiers, so any name is safe.
"""

from __future__ import annotations

import math
import os

import graphviz
import networkx as nx

from ..declaration import as_declaration, require_example_inputs
from .networkx import to_networkx


class RenderError(RuntimeError):
    """Raised when graphviz cannot write an image (typically: no ``dot`` binary)."""


_COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2",
            "#17becf"]


def _edge_style(weight: float, colour: str) -> dict:
    alpha = max(0.08, min(1.0, weight))
    return {"penwidth": f"{0.4 + 4.0 * weight:.2f}", "color": f"{colour}{int(alpha * 255):02x}",
            "arrowsize": "0.5"}


def graph_to_dot(G: nx.MultiDiGraph, *, heads=None, threshold: float = 0.0,
                 labels: bool = False, max_nodes: int | None = 64,
                 columns: int | None = None) -> graphviz.Digraph:
    """Lay out a graph from ``to_networkx`` as a ``graphviz.Digraph``.

    Positions are pinned (engine ``neato``): one panel per family and head, parents in a
    row above children, both in index order, so the picture reads like the matrix. Panels
    form a grid (``columns``; default ⌈√panels⌉), so many heads make a square sheet, not a
    strip. Each family has its own colour; edge width and opacity are the weight; inferred
    MAP edges (each child's most probable parent) are drawn solid and bold, with ``labels``
    their probability at the child's end (one label per child: none pile up where edges
    cross). Panels of more than 40 nodes in a row put the nodes as points on a circle
    (clockwise from the top; one circle when children and parents are one node set) and the
    edges as chords, so a local pattern (a window, a band) reads at a glance.
    """
    inferred = G.graph.get("inferred", False)
    weight_key = "posterior" if inferred else "prior"
    dot = graphviz.Digraph(G.graph.get("model", "structattn"), engine="neato",
                           graph_attr={"fontname": "Helvetica", "labelloc": "t",
                                       "splines": "false", "outputorder": "edgesfirst"},
                           node_attr={"shape": "ellipse", "fontname": "Helvetica",
                                      "fontsize": "10", "width": "0.45", "margin": "0.03"},
                           edge_attr={"dir": "forward"})
    kind = "inferred p(φ | x)" if inferred else "declared prior p(φ)"
    title = [f"{G.graph.get('model', '')} — {kind}"]
    counter = iter(range(10**9))
    families = G.graph["families"]
    max_heads = max((f["heads"] for f in families.values()), default=1)
    wanted = range(max_heads) if heads is None else (
        [heads] if isinstance(heads, int) else list(heads))
    for h in wanted:
        if not isinstance(h, int) or not 0 <= h < max_heads:
            raise ValueError(f"head must be an int in [0, {max_heads}); got {h!r}")
    panels = []  # (family index, family, info, head, rows)
    for f_i, (fname, info) in enumerate(families.items()):
        title.append(f"φ '{fname}': {info['parents']} → {info['children']}, prior {info['prior']}, "
                     f"heads={info['heads']}")
        nodes_of = {ns: sorted((n for n, d in G.nodes(data=True) if d["node_set"] == ns),
                               key=lambda n: G.nodes[n]["index"])
                    for ns in (info["parents"], info["children"])}
        drawn = len(nodes_of[info["parents"]]) + len(nodes_of[info["children"]])
        if max_nodes is not None and drawn > max_nodes:
            raise ValueError(
                f"family {fname!r} has {drawn} nodes to draw, more than max_nodes={max_nodes}; "
                f"draw fewer nodes, prune edges (top_k=…, threshold=…) or raise max_nodes"
            )
        panels += [(f_i, fname, info, h, nodes_of) for h in wanted if h < info["heads"]]
    columns = columns or max(1, math.ceil(math.sqrt(len(panels))))
    # one cell size for every panel, so the grid lines up
    sizes = [max(len(v) for v in rows.values()) for *_, rows in panels] or [1]
    longest = max((len(n) for *_, rows in panels for v in rows.values() for n in v), default=1)
    big = max(sizes) > 40  # large panels: points on a circle, edges as chords
    step = max(0.9, 0.09 * longest + 0.3)
    radius = 2.5 + 0.004 * max(sizes)
    cell_w, cell_h = ((2 * radius + 1.6, 2 * radius + 1.6) if big
                      else (max(sizes) * step + 0.8, 3.6))
    for k, (f_i, fname, info, h, nodes_of) in enumerate(panels):
        x0, y0 = (k % columns) * cell_w, -(k // columns) * cell_h
        colour = _COLOURS[f_i % len(_COLOURS)]
        width = max(len(v) for v in nodes_of.values())
        centre = (x0 + radius, y0 + radius) if big else None
        title_pos = (f"{x0 + radius:.2f},{y0 + 2 * radius + 0.6:.2f}!" if big
                     else f"{x0 + (width - 1) * step / 2:.2f},{y0 + 2.75:.2f}!")
        dot.node(f"n{next(counter)}", graphviz.escape(f"{fname} · head {h}"), shape="plaintext",
                 pos=title_pos, fontsize="11", fontcolor=colour)
        ids = {}
        same = info["parents"] == info["children"]
        for role, y in (("parents", 1.9), ("children", 0.0)):
            count = len(nodes_of[info[role]])
            for i, n in enumerate(nodes_of[info[role]]):
                if big and same and role == "children":
                    ids[role, n] = ids["parents", n]  # one circle: a node is parent and child
                    continue
                ids[role, n] = f"n{next(counter)}"
                observed = G.nodes[n].get("observed", True)  # shaded: observed; open: latent
                style = {"style": "filled" if observed else "filled,dashed",
                         "fillcolor": "#d9d9d9" if observed else "#ffffff",
                         "penwidth": "1.0" if observed else "1.6"}
                if G.nodes[n].get("memory"):  # stored patterns / prototypes: boxes
                    style.update(shape="box", style="filled,rounded", fillcolor="#fff2cc")
                if big:  # clockwise from the top; parents outside, children inside
                    r = radius if (same or role == "parents") else 0.8 * radius
                    angle = math.pi / 2 - 2 * math.pi * i / count
                    pos = (f"{centre[0] + r * math.cos(angle):.2f},"
                           f"{centre[1] + r * math.sin(angle):.2f}!")
                    style.update(shape="point", width="0.025", color="#888888",
                                 fillcolor="#888888")
                else:
                    pos = f"{x0 + i * step:.2f},{y0 + y:.2f}!"
                dot.node(ids[role, n], "" if big else graphviz.escape(n), pos=pos, **style)
        if big:
            first = nodes_of[info["parents"]][0]
            dot.node(f"n{next(counter)}", graphviz.escape(f"{first} ↻"), shape="plaintext",
                     fontsize="8", pos=f"{centre[0]:.2f},{centre[1] + radius + 0.2:.2f}!")
        for u, v, d in G.edges(data=True):
            if d["family"] != fname or d["head"] != h:
                continue
            w = d[weight_key]
            if w < threshold:
                continue
            attrs = _edge_style(w, colour)
            if big:
                attrs["penwidth"] = f"{0.2 + 1.5 * w:.2f}"
                attrs["arrowsize"] = "0.2"
            if d.get("map") and big:
                attrs.update(color=colour)
            elif d.get("map"):
                attrs.update(style="bold", color=colour)
                if labels:
                    attrs.update(headlabel=f"{w:.2f}", labelfontsize="7",
                                 labelfontcolor=colour, labeldistance="1.6")
            elif labels and not inferred:
                attrs.update(headlabel=f"{w:.2f}", labelfontsize="7", labeldistance="1.6")
            dot.edge(ids["parents", u], ids["children", v], **attrs)
    if inferred:
        title.append("bold: each child's most probable parent (MAP); width and opacity: "
                     "p(φ_i = j | x)")
    if not all(d.get("observed", True) for _, d in G.nodes(data=True)):
        title.append("shaded: observed nodes · open, dashed: latent nodes (inferred states)")
    if any(d.get("memory") for _, d in G.nodes(data=True)):
        title.append("yellow boxes: memories (stored patterns, prototypes)")
    if G.graph.get("steps"):
        title.append("latent states drawn after " + ", ".join(
            f"{k}: {v} steps" for k, v in G.graph["steps"].items()))
    dot.attr(label=graphviz.escape("\n".join(title)))
    return dot


def render(model, *inputs, heads=None, threshold: float = 0.0, top_k: int | None = None,
           labels: bool = False, batch_index: int = 0, max_nodes: int | None = None,
           columns: int | None = None, filename: str | os.PathLike | None = None
           ) -> graphviz.Digraph:
    """Draw ``model``'s adjacency: declared (no inputs) or inferred (with inputs).

    Returns a ``graphviz.Digraph`` (shown inline in Jupyter: it has ``_repr_svg_``). With
    ``filename`` (``.svg``, ``.png``, ``.pdf`` or ``.dot``) the picture is written there; if
    the graphviz ``dot`` binary is missing, the DOT source is written beside it (``.dot``)
    and ``RenderError`` explains how to install graphviz.

    Large graphs: ``top_k`` (each child's k most probable parents) and ``threshold`` (drop
    lighter edges) prune before anything is drawn; ``max_nodes`` (default 64 per family
    without pruning, unlimited with it) guards against unreadable pictures.
    """
    if not inputs:  # drawn at the declaration's example inputs: say so if it has none
        require_example_inputs(as_declaration(model), "render")
    if max_nodes is None and top_k is None and threshold == 0.0:
        max_nodes = 64
    G = to_networkx(model, *inputs, batch_index=batch_index, max_nodes=max_nodes, top_k=top_k,
                    threshold=threshold)
    dot = graph_to_dot(G, heads=heads, threshold=threshold, labels=labels, max_nodes=max_nodes,
                       columns=columns)
    if filename is not None:
        save(dot, filename)
    return dot


def save(dot: graphviz.Digraph, filename: str | os.PathLike) -> str:
    """Write ``dot`` to ``filename`` (format from the suffix); returns the path written."""
    filename = os.fspath(filename)
    root, ext = os.path.splitext(filename)
    fmt = ext.lstrip(".").lower()
    if fmt in ("dot", "gv"):
        with open(filename, "w") as fh:
            fh.write(dot.source)
        return filename
    if fmt not in ("svg", "png", "pdf"):
        raise ValueError(f"filename must end in .svg, .png, .pdf or .dot; got {filename!r}")
    try:
        return dot.render(outfile=filename, format=fmt, cleanup=True)
    except graphviz.ExecutableNotFound as e:
        with open(root + ".dot", "w") as fh:
            fh.write(dot.source)
        raise RenderError(
            f"cannot write {filename!r}: the graphviz 'dot' program was not found on PATH. "
            f"Install graphviz (Debian/Ubuntu: apt-get install graphviz; macOS: brew install "
            f"graphviz; conda: conda install graphviz). The DOT source was written to "
            f"{root + '.dot'!r}."
        ) from e
