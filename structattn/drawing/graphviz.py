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
    """Lay out a graph from ``to_networkx`` as a ``graphviz.Digraph``."""
    inferred = G.graph.get("inferred", False)
    weight_key = "posterior" if inferred else "prior"
    dot = graphviz.Digraph(G.graph.get("model", "structattn"),
                           graph_attr={"rankdir": "TB", "fontname": "Helvetica",
                                       "labelloc": "t", "nodesep": "0.15", "ranksep": "0.9"},
                           node_attr={"shape": "ellipse", "fontname": "Helvetica",
                                      "fontsize": "10", "width": "0.45", "margin": "0.03"},
                           edge_attr={"dir": "forward"})
    title = [f"{G.graph.get('model', '')} — {'inferred p(φ | x)' if inferred else 'declared prior p(φ)'}"]
    counter = iter(range(10**9))
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
        head_list = range(info["heads"]) if heads is None else (
            [heads] if isinstance(heads, int) else list(heads))
        for h in head_list:
            if not 0 <= h < info["heads"]:
                raise ValueError(f"head must be in [0, {info['heads']}); got {h}")
            colour = _COLOURS[(f_i + h) % len(_COLOURS)]
            with dot.subgraph(name=f"cluster_{next(counter)}") as panel:
                panel.attr(label=graphviz.escape(f"{fname} · head {h}"), style="rounded",
                           color="#bbbbbb", fontname="Helvetica", fontsize="11")
                ids = {}
                for role, ns in (("parents", info["parents"]), ("children", info["children"])):
                    with panel.subgraph() as row:
                        row.attr(rank="same")
                        for n in nodes_of[ns]:
                            ids[role, n] = f"n{next(counter)}"
                            row.node(ids[role, n], graphviz.escape(n),
                                     style="filled",
                                     fillcolor="#eeeeee" if role == "parents" else "#ffffff")
                    # keep rows in index order
                    row_ids = [ids[role, n] for n in nodes_of[ns]]
                    for a, b in zip(row_ids, row_ids[1:], strict=False):
                        panel.edge(a, b, style="invis")
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
                    panel.edge(ids["parents", u], ids["children", v], **attrs)
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
    G = to_networkx(model, *inputs, batch_index=batch_index)
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
