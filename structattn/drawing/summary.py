"""A long sequence's attention plotted as what a researcher reads, not as a graph.

``plot_attention(model, *inputs)`` → a matplotlib ``Figure``, one row per edge family and
head (and per later hop of a walk, as ``render`` draws them), three panels:

1. **MAP parents**: each child i against its most probable parent j, coloured by
   p(φ_i = j | x) — a band along the diagonal is local attention, a horizontal line a sink;
2. **attention distance**: the posterior mass at each distance i − j, averaged over the
   children (log scale), beside the prior's — how far the heads look, and how far the prior
   expected them to;
3. **where each token looks**: per child, the distances holding the central 90% of its
   posterior (band), its median and its MAP; with a mean-field window (expanding attention)
   each token's final window W_i.

Families between two node sets (cross attention, memories) have no distance: panel 2 shows
the attention each parent receives, panel 3 the parents each child reads.
"""

from __future__ import annotations

import os

import torch

from ..declaration import as_declaration
from .graphviz import _COLOURS, _heads_note, _wanted_heads
from .networkx import _inputs_or_examples, family_tables, read_structure


def _mean_field_windows(decl, inputs, structure, batch_index):
    """``{family: (H, C) final windows}`` for families read by mean-field windows (an
    inference scheme): from the compiled module's ``trace.mean_field``."""
    if not any(f.inference is not None for f in structure.families.values()):
        return {}
    from ..compiler import compile as compile_model

    with torch.no_grad():
        _, trace = compile_model(decl)(*inputs, return_trace=True)
    out = {}
    for name, history in trace.mean_field.items():
        w = history.windows[-1]  # (*batch, H, C)
        out[name] = w.reshape(-1, *w.shape[-2:])[batch_index].double().cpu()
    return out


def _quantiles(post: torch.Tensor, qs) -> torch.Tensor:
    """Quantiles of the parent index j under each row of ``post`` ``(C, P)``: ``(len(qs), C)``
    (rows without mass: NaN)."""
    cdf = post.cumsum(-1)
    total = cdf[:, -1:]
    q = torch.tensor(qs, dtype=post.dtype)[:, None, None] * total  # (Q, C, 1)
    idx = torch.searchsorted(cdf.expand(len(qs), -1, -1).contiguous(), q.contiguous()).squeeze(-1)
    idx = idx.clamp(max=post.shape[-1] - 1).to(post.dtype)
    return idx.masked_fill(total.squeeze(-1)[None] <= 0, float("nan"))


def _distance_density(table: torch.Tensor):
    """Mass of ``table`` ``(C, P)`` per distance d = i − j, summed over children, in bins
    that widen geometrically away from 0 (exact near 0, smooth in the tail): ``(centres,
    mass per unit distance)`` over the distances that carry mass."""
    C, P = table.shape
    d = (torch.arange(C)[:, None] - torch.arange(P)[None, :]).flatten()
    lo = int(d.min())
    mass = torch.bincount(d - lo, weights=table.flatten().double())
    dist = torch.arange(lo, lo + len(mass))
    far = max(abs(int(dist[mass > 0].min())), abs(int(dist[mass > 0].max())), 1) \
        if bool((mass > 0).any()) else 1
    pos = torch.unique(torch.cat([torch.arange(0, min(far, 8) + 1).double(),
                                  torch.logspace(0, torch.log10(torch.tensor(far + 1.0)), 40)
                                  .round()]))
    edges = torch.unique(torch.cat([-pos.flip(0) - 0.5, pos + 0.5]))  # bins around integers
    which = torch.bucketize(dist.double(), edges) - 1
    ok = (which >= 0) & (which < len(edges) - 1)
    per_bin = torch.zeros(len(edges) - 1, dtype=torch.float64).index_add_(0, which[ok], mass[ok])
    width = edges[1:] - edges[:-1]
    centres = (edges[1:] + edges[:-1]) / 2
    keep = per_bin > 0
    return centres[keep], per_bin[keep] / width[keep]


class _Row:
    """One family and head of ``plot_attention``: the table ``p`` (C, P) it plots (the
    posterior, or the prior without inputs), the prior ``q``, and what the panels share."""

    def __init__(self, name, info, head, p, q, inferred: bool, colour):
        self.name, self.info, self.p, self.q, self.inferred = name, info, p, q, inferred
        self.colour, self.label = colour, f"{name} · head {head}"
        self.same = info["children"] == info["parents"]
        self.has = p.sum(-1) > 0  # children with a parent (token 0 of a causal window: none)
        self.best = p.argmax(-1)[self.has]


def _map_panel(fig, ax, row: _Row) -> None:
    """Each child's MAP parent, coloured by its probability."""
    p, info = row.p, row.info
    C, P = p.shape
    i = torch.arange(C)[row.has]
    sc = ax.scatter(i.numpy(), row.best.numpy(), c=p[i, row.best].numpy(),
                    s=max(1.0, min(30.0, 6000.0 / C)), cmap="viridis", vmin=0, vmax=1,
                    linewidths=0)
    if row.same:
        ax.plot([0, C - 1], [0, C - 1], color="#999999", lw=0.6, ls="--")
    ax.set(xlabel=f"child i ({info['children']})", ylabel=f"MAP parent j ({info['parents']})",
           xlim=(-0.5, C - 0.5), ylim=(-0.5, P - 0.5))
    ax.set_title(f"{row.label}: each child's MAP parent", fontsize=10, color=row.colour)
    fig.colorbar(sc, ax=ax, fraction=0.046, label="p(φ_i = MAP | x)")


def _reach_panel(ax, row: _Row) -> None:
    """How far attention reaches (mass per distance, one node set) or what each parent
    receives (two node sets); the prior dashed beside the posterior."""
    p, q, info, colour = row.p, row.q, row.info, row.colour
    C, P = p.shape
    if row.same:  # mass per distance d = i − j, averaged over children with a parent
        n = max(int(row.has.sum()), 1)
        top = 0.0
        for table, style, what in ((p, "-", "posterior" if row.inferred else "prior"),
                                   (q, "--", "prior")):
            if table is q and not row.inferred:
                continue
            centres, density = _distance_density(table)
            top = max(top, float(density.max()) / n) if len(density) else top
            ax.step(centres.numpy(), (density / n).numpy(), where="mid", ls=style,
                    color=colour if style == "-" else "#555555", lw=1.2, label=what)
        ax.set_xscale("symlog", linthresh=1.0)
        ax.set_yscale("log")
        if top > 0:  # seven decades: the tail that matters, not underflow
            ax.set_ylim(bottom=top * 1e-7, top=top * 2)
        ax.set(xlabel="distance i − j (symmetric log scale)",
               ylabel="mass per unit distance\n(mean over children)")
        ax.set_title(f"{row.label}: how far attention reaches", fontsize=10, color=colour)
    else:
        ax.bar(range(P), (p.sum(0) / C).numpy(), color=colour, width=1.0,
               label="posterior" if row.inferred else "prior")
        if row.inferred:
            ax.step(range(P), (q.sum(0) / C).numpy(), where="mid", ls="--", color="#555555",
                    lw=1.0, label="prior")
        ax.set(xlabel=f"parent j ({info['parents']})", ylabel="mean attention received")
        ax.set_title(f"{row.label}: attention each parent receives", fontsize=10, color=colour)
    ax.legend(fontsize=8)


def _spread_panel(ax, row: _Row, window) -> None:
    """Where each child looks: the central 90% of p(φ_i | x), the MAP parent and (mean
    field) the window W_i."""
    p, info, has, best = row.p, row.info, row.has, row.best
    C = p.shape[0]
    lo5, hi95 = _quantiles(p, (0.05, 0.95))
    child = torch.arange(C)
    if row.same:  # in distances: parent j ↦ i − j (a later j is a shorter distance)
        lo5, hi95 = child - hi95, child - lo5
        map_y, ylabel = child[has] - best, "distance i − j"
    else:
        map_y, ylabel = best, f"parent j ({info['parents']})"
    ax.fill_between(child.numpy(), lo5.numpy(), hi95.numpy(), color=row.colour, alpha=0.45, lw=0,
                    step="mid", label="central 90% of p(φ_i | x)" if row.inferred else
                    "central 90% of the prior")
    dots = max(0.5, min(12.0, 3000.0 / C))
    ax.scatter(child[has].numpy(), map_y.numpy(), s=dots, color="black", linewidths=0,
               label="MAP")
    if window is not None:
        ax.scatter(child.numpy(), window.numpy(), s=dots, color="#d62728", marker="_",
                   linewidths=0.8, label="window W_i (mean field)")
    if row.same:
        ax.set_yscale("symlog", linthresh=1.0)
    ax.set(xlabel=f"child i ({info['children']})", ylabel=ylabel, xlim=(-0.5, C - 0.5))
    ax.set_title(f"{row.label}: where each child looks", fontsize=10, color=row.colour)
    ax.legend(fontsize=8, loc="best", framealpha=0.8)


def plot_attention(model, *inputs, heads=None, batch_index: int = 0,
                   filename: str | os.PathLike | None = None, dpi: int = 110):
    """Plot the attention of ``model`` on ``inputs`` as a researcher reads it, not as a graph.

    One row per edge family and head (and per later hop of a walk, as ``render`` draws
    them), three panels: each child's MAP parent coloured by p(φ_i = j | x); the posterior
    mass per distance i − j beside the prior's (for a family between two node sets: the
    attention each parent receives); and the distances holding the central 90% of each
    child's posterior, its median and its MAP (with a mean-field window, each token's final
    window W_i). Costs one dense posterior per family, (H, C, P): fine for sequences of a few
    thousand.

    Args:
        model (Declaration | Callable): a ``structattn.Declaration`` (e.g. a catalogue model)
            or a Pyro program using ``structattn.nodes``/``edges``/``potential``/``value``.
        *inputs (Any): the model's inputs, as it is called with them (e.g. ``x``,
            ``(*batch, N, d)``): the posterior is plotted at them. Without any, the
            declaration's ``example_inputs()`` are used and the prior is plotted.
        heads (int | list[int] | None): the heads to plot (default None: all). The title
            says which heads are left out.
        batch_index: the element of the flattened batch that is plotted (default 0).
        filename: where to save the figure (any format matplotlib writes, from the suffix).
            None (default): it is not saved.
        dpi: the saved figure's resolution in dots per inch (default 110).

    Returns:
        (matplotlib.figure.Figure): The figure, one row of three panels per family and head.

    Raises:
        ValueError: ``model`` is neither a ``Declaration`` nor callable, a head is not an int
            below the number of heads, or ``batch_index`` is out of range.
        NotImplementedError: no inputs are given and the declaration has no
            ``example_inputs()``.
        RenderError: ``filename`` cannot be written.
    """
    import matplotlib.pyplot as plt

    decl = as_declaration(model)
    inputs, inferred = _inputs_or_examples(decl, inputs)
    structure, _ = read_structure(decl, inputs, inferred)
    tables = list(family_tables(structure, batch_index, inferred))
    max_heads = max((info["heads"] for _, info, *_ in tables), default=1)
    wanted = _wanted_heads(heads, max_heads, "plot_attention: ")
    windows = _mean_field_windows(decl, inputs, structure, batch_index) if inferred else {}
    rows = [(f_i, name, info, prior, post, h) for f_i, (name, info, prior, post)
            in enumerate(tables) for h in wanted if h < info["heads"]]
    fig, axes = plt.subplots(len(rows), 3, figsize=(15, 3.4 * len(rows) + 0.9), squeeze=False)
    for r, (f_i, name, info, prior, post, h) in enumerate(rows):
        row = _Row(name, info, h, (post if post is not None else prior)[h], prior[h],
                   post is not None, _COLOURS[f_i % len(_COLOURS)])
        _map_panel(fig, axes[r, 0], row)
        _reach_panel(axes[r, 1], row)
        _spread_panel(axes[r, 2], row, windows[name][h] if name in windows else None)
    kind = "inferred p(φ | x)" if inferred else "declared prior p(φ)"
    title = [f"{decl.display_name} — {kind}, batch element {batch_index}"]
    for name, info, *_ in tables:
        title.append(f"'{name}': {info['parents']} → {info['children']} "
                     f"({structure.node_sets[info['children']].size} children), "
                     f"{_heads_note(info['heads'], wanted)}")
    fig.suptitle("\n".join(title), fontsize=11)
    fig.tight_layout()
    if filename is not None:
        try:
            fig.savefig(os.fspath(filename), dpi=dpi)
        except OSError as e:
            from .graphviz import cannot_write

            raise cannot_write(os.fspath(filename), e) from e
    return fig
