"""Draw the adjacency with graphviz: parents above, children below, one panel per head.

Edge width and opacity are the prior p(φ_i = j) (declared structure) or the
posterior p(φ_i = j | x) (inferred). Node and family names are escaped and
never used as DOT identifiers, so any name is safe.
"""

from __future__ import annotations

import os

import graphviz
import networkx as nx

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
                 labels: bool = False, max_nodes: int = 64) -> graphviz.Digraph:
    """Lay out a graph from ``to_networkx`` as a ``graphviz.Digraph``.

    Positions are pinned (engine ``neato``): one panel per family and head, parents in
    a row above children, both in index order, so the picture reads like the matrix.
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
    panel_x = 0.0  # left edge of the next panel, inches
    for f_i, (fname, info) in enumerate(G.graph["families"].items()):
        title.append(f"φ '{fname}': {info['parents']} → {info['children']}, prior {info['prior']}, "
                     f"heads={info['heads']}")
        nodes_of = {ns: sorted((n for n, d in G.nodes(data=True) if d["node_set"] == ns),
                               key=lambda n: G.nodes[n]["index"])
                    for ns in (info["parents"], info["children"])}
        if sum(len(v) for v in nodes_of.values()) > max_nodes:
            raise ValueError(
                f"family {fname!r} has {sum(len(v) for v in nodes_of.values())} nodes to draw, "
                f"more than max_nodes={max_nodes}; draw fewer nodes or raise max_nodes"
            )
        wanted = range(info["heads"]) if heads is None else (
            [heads] if isinstance(heads, int) else list(heads))
        for h in wanted:
            if not 0 <= h < max(f["heads"] for f in G.graph["families"].values()):
                raise ValueError(f"head must be in [0, {info['heads']}); got {h}")
        head_list = [h for h in wanted if h < info["heads"]]  # families with fewer heads
        width = max(len(v) for v in nodes_of.values())
        step = max(0.9, 0.09 * max(len(n) for v in nodes_of.values() for n in v) + 0.3)
        for h in head_list:
            colour = _COLOURS[(f_i + h) % len(_COLOURS)]
            dot.node(f"n{next(counter)}", graphviz.escape(f"{fname} · head {h}"), shape="plaintext",
                     pos=f"{panel_x + (width - 1) * step / 2:.2f},2.75!", fontsize="11")
            ids = {}
            for role, y in (("parents", 1.9), ("children", 0.0)):
                for k, n in enumerate(nodes_of[info[role]]):
                    ids[role, n] = f"n{next(counter)}"
                    observed = G.nodes[n].get("observed", True)  # shaded: observed; open: latent
                    dot.node(ids[role, n], graphviz.escape(n), pos=f"{panel_x + k * step:.2f},{y}!",
                             style="filled" if observed else "filled,dashed",
                             fillcolor="#d9d9d9" if observed else "#ffffff",
                             penwidth="1.0" if observed else "1.6")
            for u, v, d in G.edges(data=True):
                if d["family"] != fname or d["head"] != h:
                    continue
                w = d[weight_key]
                if w < threshold:
                    continue
                attrs = _edge_style(w, colour)
                if labels:
                    attrs["label"] = f"{w:.2f}"
                    attrs["fontsize"] = "8"
                dot.edge(ids["parents", u], ids["children", v], **attrs)
            panel_x += width * step + 0.8
    if not all(d.get("observed", True) for _, d in G.nodes(data=True)):
        title.append("shaded: observed nodes · open, dashed: latent nodes (inferred states)")
    dot.attr(label=graphviz.escape("\n".join(title)))
    return dot


def render(model, *inputs, heads=None, threshold: float = 0.0, labels: bool = False,
           batch_index: int = 0, max_nodes: int = 64, filename: str | os.PathLike | None = None
           ) -> graphviz.Digraph:
    """Draw ``model``'s adjacency: declared (no inputs) or inferred (with inputs).

    Returns a ``graphviz.Digraph`` (shown inline in Jupyter). With ``filename``
    (``.svg``, ``.png`` or ``.pdf``) the picture is written there; if the graphviz
    ``dot`` binary is missing, the DOT source is written beside it (``.dot``) and
    ``RenderError`` explains how to install graphviz.
    """
    G = to_networkx(model, *inputs, batch_index=batch_index, max_nodes=max_nodes)
    dot = graph_to_dot(G, heads=heads, threshold=threshold, labels=labels, max_nodes=max_nodes)
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
