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
    """Raised when a drawing cannot be written.

    Its one-line message names the path and the reason: the graphviz ``dot`` program is not on
    ``PATH`` (the DOT source is then written beside the path, and the message says how to
    install graphviz), the path cannot be written (a missing directory, a file where a
    directory is needed, no permission), or graphviz's ``dot`` fails on it. A
    ``RuntimeError``.
    """


def cannot_write(filename: str, err: Exception) -> RenderError:
    """The library's one-line refusal of a path that cannot be written, naming it (and the
    part of it that is a file where a directory is needed, if one is)."""
    parent = os.path.dirname(os.path.abspath(filename))
    while parent and not os.path.exists(parent) and parent != os.path.dirname(parent):
        parent = os.path.dirname(parent)
    if os.path.exists(parent) and not os.path.isdir(parent):
        why = f"{parent!r} is a file, not a directory"
    else:
        why = getattr(err, "strerror", None) or (str(err).splitlines() or [type(err).__name__])[0]
    return RenderError(f"cannot write {filename!r}: {why}")


_COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2",
            "#17becf"]


def _edge_style(weight: float, colour: str) -> dict:
    alpha = max(0.08, min(1.0, weight))
    return {"penwidth": f"{0.4 + 4.0 * weight:.2f}", "color": f"{colour}{int(alpha * 255):02x}",
            "arrowsize": "0.5"}


def _power(k: int) -> str:
    return str(k).translate(str.maketrans("0123456789", "⁰¹²³⁴⁵⁶⁷⁸⁹"))


def _heads_note(heads: int, drawn: list[int]) -> str:
    """``heads=4``, or ``heads=4, drawn: 0, 1 (2, 3 left out)`` when only some are drawn."""
    shown = [h for h in drawn if h < heads]
    if len(shown) == heads:
        return f"heads={heads}"
    left = [h for h in range(heads) if h not in shown]
    return (f"heads={heads}, drawn: {', '.join(map(str, shown))} "
            f"({', '.join(map(str, left))} left out)")


def graph_to_dot(G: nx.MultiDiGraph, *, heads=None, threshold: float = 0.0,
                 labels: bool = False, max_nodes: int | None = 64,
                 columns: int | None = None) -> graphviz.Digraph:
    """Lay out a graph from ``to_networkx`` as a ``graphviz.Digraph``: p(φ_i = j) as arrows.

    Positions are pinned (engine ``neato``): one panel per family and head, parents in a
    row above children, both in index order, so the picture reads like the matrix; panels
    form a grid, so many heads make a square sheet, not a strip. A walk along the edges
    (multihop attention) gets a panel per later hop, the node reached in k steps (P^k).
    Each family has its own colour; edge width and opacity are the weight; inferred MAP
    edges (each child's most probable parent) are drawn solid and bold.

    Args:
        G (nx.MultiDiGraph): the graph, as ``structattn.to_networkx`` returns it.
        heads (int | list[int] | None): the heads to draw, each an int in [0, the largest
            family's heads); None, the default: all. The title says which are left out.
        threshold (float): edges of weight below it are not drawn; default 0.0 (all).
        labels (bool): write under each child the probability of its MAP edge (declared:
            of its most probable parent under the prior), clear of every arrowhead;
            default False.
        max_nodes (int | None): the most nodes (parents + children) a family may have: rows
            are for graphs a reader can follow (``plot_attention`` plots a long sequence's
            attention); default 64; None: any size.
        columns (int | None): panels per row of the grid; None, the default: ⌈√panels⌉.

    Returns:
        graphviz.Digraph: the drawing (engine ``neato``, positions pinned).

    Raises:
        ValueError: a head out of range, or a family of more than ``max_nodes`` nodes.
    """
    inferred = G.graph.get("inferred", False)
    dot = graphviz.Digraph(G.graph.get("model", "structattn"), engine="neato",
                           graph_attr={"fontname": "Helvetica", "labelloc": "t",
                                       "splines": "false", "outputorder": "edgesfirst"},
                           node_attr={"shape": "ellipse", "fontname": "Helvetica",
                                      "fontsize": "10", "width": "0.45", "margin": "0.03"},
                           edge_attr={"dir": "forward"})
    kind = "inferred p(φ | x)" if inferred else "declared prior p(φ)"
    index, size = G.graph.get("batch", (0, 1))
    which = f", batch element {index} of {size} (batch_index={index})" if size > 1 else ""
    title = [f"{G.graph.get('model', '')} — {kind}{which}"]
    families = G.graph["families"]
    wanted = _wanted_heads(heads, max((f["heads"] for f in families.values()), default=1))
    panels = _panels(G, wanted, max_nodes, title)
    columns = columns or max(1, math.ceil(math.sqrt(len(panels))))
    # one cell size for every panel, so the grid lines up
    sizes = [max(len(v) for v in rows.values()) for *_, rows in panels] or [1]
    longest = max((len(n) for *_, rows in panels for v in rows.values() for n in v), default=1)
    step = max(0.9, 0.09 * longest + 0.3)
    cell_w, cell_h = max(sizes) * step + 0.8, 4.1 if labels else 3.6
    counter = iter(range(10**9))
    for k, panel in enumerate(panels):
        x0, y0 = (k % columns) * cell_w, -(k // columns) * cell_h
        _draw_panel(dot, G, panel, (x0, y0), step, counter, threshold, labels)
    dot.attr(label=graphviz.escape("\n".join(title + _legend(G, inferred, labels))))
    return dot


def _wanted_heads(heads, max_heads: int, who: str = "") -> list:
    """The heads to draw: all (None), one (an int) or several, each checked (``who``: the
    message's prefix)."""
    wanted = list(range(max_heads)) if heads is None else (
        [heads] if isinstance(heads, int) else list(heads))
    for h in wanted:
        if not isinstance(h, int) or isinstance(h, bool) or not 0 <= h < max_heads:
            raise ValueError(f"{who}head must be an int in [0, {max_heads}); got {h!r}")
    return wanted


def _panels(G, wanted, max_nodes, title: list) -> list:
    """``(family index, family, info, head, nodes by node set)`` per panel to draw, the title
    lines of each family appended to ``title``; a family of more than ``max_nodes`` nodes is
    refused."""
    panels = []
    for f_i, (fname, info) in enumerate(G.graph["families"].items()):
        note = _heads_note(info["heads"], wanted)
        if "hop" in info:
            title.append(f"'{fname}': the node reached in {info['hop']} steps of the walk along "
                         f"φ '{info['walk_of']}' (P{_power(info['hop'])}), {note}")
        else:
            title.append(f"φ '{fname}': {info['parents']} → {info['children']}, prior "
                         f"{info['prior']}, {note}")
        nodes_of = {ns: sorted((n for n, d in G.nodes(data=True) if d["node_set"] == ns),
                               key=lambda n: G.nodes[n]["index"])
                    for ns in (info["parents"], info["children"])}
        drawn = len(nodes_of[info["parents"]]) + len(nodes_of[info["children"]])
        if max_nodes is not None and drawn > max_nodes:
            raise ValueError(
                f"family {fname!r} has {drawn} nodes to draw, more than max_nodes={max_nodes}: "
                f"a graph of that many nodes shows no structure; plot it with "
                f"structattn.plot_attention(model, *inputs), draw fewer nodes, or raise "
                f"max_nodes"
            )
        panels += [(f_i, fname, info, h, nodes_of) for h in wanted if h < info["heads"]]
    return panels


def _draw_panel(dot, G, panel, origin, step: float, counter, threshold: float,
                labels: bool) -> None:
    """One family and head at ``origin``: its name, parents in a row above children, the
    edges (MAP edges bold) and, with ``labels``, each child's MAP probability under it."""
    f_i, fname, info, h, nodes_of = panel
    x0, y0 = origin
    inferred = G.graph.get("inferred", False)
    weight_key = "posterior" if inferred else "prior"
    colour = _COLOURS[f_i % len(_COLOURS)]
    width = max(len(v) for v in nodes_of.values())
    name = f"{fname} · head {h}"
    if "hop" in info:
        name = f"{info['walk_of']} · head {h} · hop {info['hop']}: P{_power(info['hop'])}"
    elif any(i.get("walk_of") == fname for i in G.graph["families"].values()):
        name += " · hop 1: P"
    dot.node(f"n{next(counter)}", graphviz.escape(name), shape="plaintext",
             pos=f"{x0 + (width - 1) * step / 2:.2f},{y0 + 2.75:.2f}!", fontsize="11",
             fontcolor=colour)
    ids = {}
    for role, y in (("parents", 1.9), ("children", 0.0)):
        for i, n in enumerate(nodes_of[info[role]]):
            ids[role, n] = f"n{next(counter)}"
            observed = G.nodes[n].get("observed", True)  # shaded: observed; open: latent
            style = {"style": "filled" if observed else "filled,dashed",
                     "fillcolor": "#d9d9d9" if observed else "#ffffff",
                     "penwidth": "1.0" if observed else "1.6"}
            if G.nodes[n].get("memory"):  # stored patterns / prototypes: boxes
                style.update(shape="box", style="filled,rounded", fillcolor="#fff2cc")
            dot.node(ids[role, n], graphviz.escape(n), pos=f"{x0 + i * step:.2f},{y0 + y:.2f}!",
                     **style)
    best = {}  # child → the weight of its MAP edge (declared: its most probable parent)
    for u, v, d in G.edges(data=True):
        if d["family"] != fname or d["head"] != h:
            continue
        w = d[weight_key]
        if inferred and d.get("map") or not inferred and w > best.get(v, -1.0):
            best[v] = w
        if w < threshold:
            continue
        attrs = _edge_style(w, colour)
        if d.get("map"):
            attrs.update(style="bold", color=colour)
        dot.edge(ids["parents", u], ids["children", v], **attrs)
    if labels:  # one number per child, under it: never under an arrowhead
        for i, n in enumerate(nodes_of[info["children"]]):
            if n in best:
                dot.node(f"n{next(counter)}", f"{best[n]:.2f}", shape="plaintext",
                         fontsize="10", fontcolor=colour,
                         pos=f"{x0 + i * step:.2f},{y0 - 0.42:.2f}!")


def _legend(G, inferred: bool, labels: bool) -> list:
    """The title's closing lines: what bold edges, numbers, shading and boxes mean."""
    lines = []
    if inferred:
        lines.append("bold: each child's most probable parent (MAP); width and opacity: "
                     "p(φ_i = j | x)")
    if labels:
        lines.append("number under a child: p(φ_i = MAP parent | x)" if inferred else
                     "number under a child: the prior of its most probable parent")
    if not all(d.get("observed", True) for _, d in G.nodes(data=True)):
        lines.append("shaded: observed nodes · open, dashed: latent nodes (inferred states)")
    if any(d.get("memory") for _, d in G.nodes(data=True)):
        lines.append("yellow boxes: memories (stored patterns, prototypes)")
    if G.graph.get("steps"):
        lines.append("latent states drawn after " + ", ".join(
            f"{k}: {v} steps" for k, v in G.graph["steps"].items()))
    return lines


def render(model, *inputs, heads=None, threshold: float = 0.0, top_k: int | None = None,
           labels: bool = False, batch_index: int = 0, max_nodes: int | None = 64,
           columns: int | None = None, filename: str | os.PathLike | None = None
           ) -> graphviz.Digraph:
    """Draw ``model``'s adjacency: declared (no inputs) or inferred (with inputs).

    One panel per edge family and head (and per later hop of a walk along the edges), parents
    in a row above children, edge width and opacity the prior p(φ_i = j) (declared) or the
    posterior p(φ_i = j | x) (inferred), each child's MAP edge bold. The ``graphviz.Digraph``
    is shown inline in Jupyter (it has ``_repr_svg_``). If the graphviz ``dot`` binary is
    missing when ``filename`` needs it, the DOT source is written beside it (``.dot``) and
    ``RenderError`` explains how to install graphviz.

    A family of more than ``max_nodes`` nodes is refused before any O(C·P) work: a graph that
    large shows no structure, and ``plot_attention`` plots what it says (attention distance
    per head, MAP parents, windows per token).

    Args:
        model (Declaration | Callable): a ``structattn.Declaration`` (e.g. a catalogue model)
            or a Pyro program using ``structattn.nodes``/``edges``/``potential``/``value``.
        *inputs (Any): the model's inputs, as it is called with them (e.g. ``x``,
            ``(*batch, N, d)``): the posterior is drawn at them. Without any, the
            declaration's ``example_inputs()`` fix the sizes and the declared prior is drawn.
        heads (int | list[int] | None): the heads to draw (default None: all). The title
            says which heads are left out.
        threshold: a probability in [0, 1]: edges lighter than it are dropped (default 0:
            every edge of the support is drawn).
        top_k: keep only each child's k most probable parents per head (None: all).
        labels: write under each child the probability of its MAP edge (declared: the prior
            of its most probable parent).
        batch_index: the element of the flattened batch that is drawn (default 0); the title
            says which of how many.
        max_nodes: the most nodes (parents + children) a family may have (default 64; None:
            any size).
        columns: panels per row of the grid (default ⌈√panels⌉).
        filename: where to write the picture (``.svg``, ``.png``, ``.pdf`` or ``.dot``; see
            ``save``). None (default): nothing is written.

    Returns:
        The drawing, a ``graphviz.Digraph`` (engine ``neato``, positions pinned).

    Raises:
        ValueError: ``model`` is neither a ``Declaration`` nor callable, ``top_k`` is not a
            positive int, ``threshold`` is not in [0, 1], a
            family has more than ``max_nodes`` nodes, ``batch_index`` is out of range, a
            head is not an int below the number of heads, or ``filename`` has another
            suffix.
        NotImplementedError: no inputs are given and the declaration has no
            ``example_inputs()``.
        RenderError: ``filename`` cannot be written.
    """
    if not inputs:  # drawn at the declaration's example inputs: say so if it has none
        require_example_inputs(as_declaration(model), "render")
    G = to_networkx(model, *inputs, batch_index=batch_index, max_nodes=max_nodes, top_k=top_k,
                    threshold=threshold)
    dot = graph_to_dot(G, heads=heads, threshold=threshold, labels=labels, max_nodes=max_nodes,
                       columns=columns)
    if filename is not None:
        save(dot, filename)
    return dot


def save(dot: graphviz.Digraph, filename: str | os.PathLike) -> str:
    """Write ``dot`` to ``filename``, in the format its suffix names.

    Args:
        dot: the drawing, e.g. from ``render`` or ``model_graph``.
        filename: the path to write: ``.svg``, ``.png`` or ``.pdf`` (laid out by the graphviz
            ``dot`` program), or ``.dot``/``.gv`` (the DOT source, no graphviz program
            needed). If ``dot`` is missing, the DOT source is written beside the path
            (``.dot``) before ``RenderError`` is raised.

    Returns:
        The path written, a ``str``.

    Raises:
        ValueError: ``filename`` has another suffix.
        RenderError: the graphviz ``dot`` program is not found, the path cannot be written,
            or ``dot`` fails on it; the message names the path.
    """
    filename = os.fspath(filename)
    root, ext = os.path.splitext(filename)
    fmt = ext.lstrip(".").lower()
    if fmt not in ("svg", "png", "pdf", "dot", "gv"):
        raise ValueError(f"filename must end in .svg, .png, .pdf or .dot; got {filename!r}")
    try:
        return _write(dot, filename, root, fmt)
    except OSError as e:  # a directory that is missing or a file, no permission, …
        raise cannot_write(filename, e) from e
    except graphviz.CalledProcessError as e:  # dot itself could not write it
        raise cannot_write(filename, RuntimeError(
            f"graphviz's dot failed: {(e.stderr or b'').decode(errors='replace').strip()}")) from e


def _write(dot: graphviz.Digraph, filename: str, root: str, fmt: str) -> str:
    if fmt in ("dot", "gv"):
        with open(filename, "w") as fh:
            fh.write(dot.source)
        return filename
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
