"""A modern Hopfield network
=========================

A modern continuous Hopfield network retrieving stored patterns (paper §4.2; Ramsauer et
al. 2021): a Hopfield layer with identity projections stores N = 200 random ±1 patterns of
d = 8 × 8 = 64 pixels as its keys; each query is a stored pattern with its bottom half
occluded (set to 0) and 6 of its 32 visible pixels flipped. Each update
ξ ← Yᵀ softmax(β Y ξ) is one CCCP step on the collapsed free energy, so Ramsauer's energy
E(ξ) = −(1/β)·lse(β Y ξ) + ½‖ξ‖² never increases (asserted).

Shows (``gallery/output/hopfield/``):

- ``hopfield_retrieval.png``: for six queries (one of them a failure, when there is one), the
  corrupted query, the state after each update and the stored original; the title gives the
  retrieval accuracy (fraction of all queries whose final state is nearest to the right
  stored pattern) and the fraction with every pixel right;
- ``hopfield_energy.png``: E(ξ_t) per update for every query;
- ``hopfield_beta.png``: retrieval against β: for β ≤ 8/d the first update still points the
  right way, but the next ones fall into the metastable average of all patterns; for
  β ≥ 32/d retrieval reaches the ceiling set by the queries themselves (a query closer to
  another stored pattern than to its own cannot be retrieved).

β = 32/d = 32/‖y‖² (0.5) by default: one update nearly retrieves, two converge.
``--quick``: 16 patterns, 6 queries, 3 updates (the test suite).
Run: ``python gallery/plot_hopfield.py [--patterns N] [--steps T] [--beta B] [--flips F]
[--out DIR] [--quick]``
"""
# mkdocs_gallery_thumbnail_path = "../gallery/results/hopfield_retrieval.png"

from __future__ import annotations

import argparse
import os
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

import structattn as sa  # noqa: E402

SIDE = 8  # patterns are SIDE × SIDE images
D = SIDE * SIDE
F64 = torch.float64


def make_patterns(n: int, generator: torch.Generator) -> torch.Tensor:
    """n random ±1 patterns ``(n, D)`` (scikit-learn's digits are not a dependency)."""
    return (2 * torch.randint(0, 2, (n, D), generator=generator) - 1).to(F64)


def corrupt(patterns: torch.Tensor, flips: int, generator: torch.Generator) -> torch.Tensor:
    """The patterns with their bottom half (rows SIDE/2 … SIDE−1) set to 0 and ``flips``
    random pixels of the visible top half flipped, ``(q, D)``."""
    q = patterns.clone().reshape(-1, SIDE, SIDE)
    q[:, SIDE // 2:] = 0
    q = q.reshape(-1, D)
    visible = D // 2  # the top half comes first in row-major order
    which = torch.rand(q.shape[0], visible, generator=generator).argsort(-1)[:, :flips]
    q[:, :visible].scatter_(-1, which, -q[:, :visible].gather(-1, which))
    return q


def classical_hopfield(beta: float, steps: int) -> sa.models.Hopfield:
    """One head, no projections: the paper's network on raw patterns."""
    return sa.models.hopfield(D, projections=False, beta=beta,
                              iteration=sa.IterationOptions(steps=steps), dtype=F64)


def retrieve(patterns, queries, beta, steps):
    """Queries ``(q, D)``, retrieved together (one batch element, q queries).

    Returns states ``(T + 1, q, D)``, Ramsauer's energy per query ``(T + 1, q)`` and the
    free energy of all queries ``(T + 1,)``. (The layer's output would be one update beyond
    ``states[-1]``.)"""
    m = classical_hopfield(beta, steps)
    with torch.no_grad():
        _, trace = sa.compile(m)(queries[None], patterns[None], return_trace=True)
        states = trace.states["state"][:, 0]  # (T + 1, q, D)
        energy = torch.stack([m.energy(s, patterns, per_query=True) for s in states])
    return states, energy, trace.free_energy[:, 0]


def accuracy(states, patterns, targets) -> torch.Tensor:
    """Per step: fraction of queries whose state is nearest (Euclidean) to its own pattern."""
    nearest = torch.cdist(states, patterns.expand(states.shape[0], *patterns.shape)).argmin(-1)
    return (nearest == targets).to(F64).mean(-1)


def recovered(states, patterns, targets) -> torch.Tensor:
    """Per step: fraction of queries with every pixel's sign right (an occluded pixel, 0,
    is not right), a stricter score than ``accuracy``."""
    return (torch.sign(states) == patterns[targets]).all(-1).to(F64).mean(-1)


def plot_grid(states, patterns, targets, examples, wrong, path, title):
    steps = states.shape[0] - 1
    rows = ["query"] + [f"after update {t}" for t in range(1, steps + 1)] + ["stored"]
    fig, axes = plt.subplots(len(rows), len(examples), squeeze=False,
                             figsize=(1.25 * len(examples) + 1.3, 1.25 * len(rows) + 0.6))
    for c, i in enumerate(examples):
        images = [states[t, i] for t in range(steps + 1)] + [patterns[targets[i]]]
        for r, img in enumerate(images):
            ax = axes[r, c]
            ax.imshow(img.reshape(SIDE, SIDE).numpy(), cmap="gray", vmin=-1, vmax=1)
            ax.set_xticks([])
            ax.set_yticks([])
            if c == 0:
                ax.set_ylabel(rows[r], fontsize=8, rotation=0, ha="right", va="center")
        axes[0, c].set_title(f"query {i}" + (" (wrong)" if i in wrong else ""), fontsize=8,
                             color="C3" if i in wrong else "k")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_energy(energy, examples, path, title):
    steps = energy.shape[0] - 1
    fig, ax = plt.subplots(figsize=(6, 4))
    t = range(steps + 1)
    ax.plot(t, energy.numpy(), color="0.6", lw=0.6, alpha=0.5)
    for n, i in enumerate(examples):
        ax.plot(t, energy[:, i].numpy(), marker="o", ms=3, lw=1.4, color=f"C{n}",
                label=f"query {i}")
    ax.axhline(-D / 2, color="k", ls=":", lw=1)
    ax.annotate("E = −‖y‖²/2: at a stored pattern", (steps, -D / 2), xytext=(0, 4),
                textcoords="offset points", ha="right", fontsize=8)
    ax.set_xticks(list(t))
    ax.set_xlabel("update t")
    ax.set_ylabel("Ramsauer energy E(ξ_t)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, title="grey: all queries", title_fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_beta(betas, curves, chosen, ceiling, path, title):
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    ax.axhline(ceiling, color="0.5", ls="--", lw=1,
               label="nearest pattern right for the query itself")
    for (label, values), marker in zip(curves.items(), "osd", strict=False):
        ax.plot(betas, values, marker=marker, label=label)
    ax.axvline(chosen, color="k", ls=":", lw=1)
    ax.annotate(f"β used = {chosen:g}", (chosen, 0.5), xytext=(4, 0), textcoords="offset points",
                fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(betas, [f"{b * D:g}/{D}" for b in betas], fontsize=8)
    ax.set_xlabel("inverse temperature β")
    ax.set_ylabel("fraction of queries")
    ax.set_ylim(-0.03, 1.03)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--patterns", type=int, default=200, help="stored patterns N")
    p.add_argument("--queries", type=int, default=None, help="queries (default: one per pattern)")
    p.add_argument("--steps", type=int, default=5, help="Hopfield updates T")
    p.add_argument("--beta", type=float, default=32 / D, help="inverse temperature (32/d)")
    p.add_argument("--flips", type=int, default=6,
                   help="visible pixels flipped per query (besides the occluded half)")
    p.add_argument("--examples", type=int, default=6, help="queries drawn in the grid")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "output", "hopfield"))
    p.add_argument("--quick", action="store_true", help="few patterns and steps (test suite)")
    args = p.parse_args(argv)
    if args.quick:
        args.patterns, args.queries, args.steps = 16, 6, 3
    os.makedirs(args.out, exist_ok=True)
    start = time.perf_counter()
    g = torch.Generator().manual_seed(args.seed)
    patterns = make_patterns(args.patterns, g)
    n_queries = min(args.queries or args.patterns, args.patterns)
    targets = torch.randperm(args.patterns, generator=g)[:n_queries]
    queries = corrupt(patterns[targets], args.flips, g)

    states, energy, free_energy = retrieve(patterns, queries, args.beta, args.steps)
    # CCCP: neither the free energy nor Ramsauer's energy (F = β·E + const) may increase
    for name, e in (("free energy", free_energy), ("Ramsauer energy", energy)):
        rise = float((e[1:] - e[:-1]).max()) if args.steps else 0.0
        assert rise <= 1e-9 * float(e.abs().max()), f"{name} increased by {rise:g}"
    acc, rec = accuracy(states, patterns, targets), recovered(states, patterns, targets)
    final = float(acc[-1])
    print(f"retrieval accuracy after {args.steps} updates: {final:.3f} ({n_queries} queries, "
          f"N={args.patterns}, β={args.beta:g}); per update t = 0 … {args.steps}: "
          + ", ".join(f"{float(a):.3f}" for a in acc))
    print("  every pixel's sign recovered, per update: " + ", ".join(f"{float(a):.3f}" for a in rec))

    nearest = torch.cdist(states[-1], patterns).argmin(-1)
    wrong = [i for i in range(n_queries) if nearest[i] != targets[i]]
    examples = list(range(min(args.examples, n_queries)))
    if wrong and wrong[0] not in examples:  # show a failure too
        examples[-1] = wrong[0]
    setting = f"N={args.patterns} random ±1 patterns, d={D}, β={args.beta:g}"
    written = []
    path = os.path.join(args.out, "hopfield_retrieval.png")
    plot_grid(states, patterns, targets, examples, wrong, path,
              f"Hopfield retrieval ({setting})\n"
              f"queries: bottom half occluded, {args.flips} visible pixels flipped\n"
              f"retrieval accuracy after {args.steps} updates: {final:.1%} of {n_queries} queries "
              f"(every pixel right: {float(rec[-1]):.1%})")
    written.append(path)
    path = os.path.join(args.out, "hopfield_energy.png")
    plot_energy(energy, examples, path,
                f"Ramsauer energy per update never increases\n({setting}, {n_queries} queries)")
    written.append(path)

    betas = [2 ** k / D for k in (range(0, 8) if not args.quick else (0, 3, 4, 6))]
    curves = {"nearest pattern right, after 1 update": [],
              f"nearest pattern right, after {args.steps} updates": [],
              f"every pixel right, after {args.steps} updates": []}
    for beta in betas:
        s, _, _ = retrieve(patterns, queries, beta, args.steps)
        a, r = accuracy(s, patterns, targets), recovered(s, patterns, targets)
        for curve, value in zip(curves.values(), (a[min(1, args.steps)], a[-1], r[-1]), strict=True):
            curve.append(float(value))
    print("β sweep (β·d: " + " / ".join(curves) + "): " + ", ".join(
        f"{b * D:g}: " + "/".join(f"{c[k]:.2f}" for c in curves.values())
        for k, b in enumerate(betas)))
    path = os.path.join(args.out, "hopfield_beta.png")
    plot_beta(betas, curves, args.beta, float(acc[0]), path,
              f"small β: the states fall into the average of all patterns\n"
              f"(N={args.patterns} random ±1 patterns, d={D}, {n_queries} occluded queries)")
    written.append(path)
    print(f"({time.perf_counter() - start:.1f} s)\nwrote:\n  " + "\n  ".join(written))
    return written


if __name__ == "__main__":
    main()
