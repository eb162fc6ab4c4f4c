"""Slot attention separating blobs
===============================

Slot attention separating blobs, untrained (paper §4.3): the collapsed recipe is EM for a
Gaussian mixture over the keys with the slots as means, so it groups points with no
training at all; the original recipe with random weights does not.

Toy scenes: each has N points from K 2-D Gaussian blobs (centres in [−2, 2]², at least 1.6
apart, standard deviation 0.3) and a per-blob "colour" value in [−1, 1] (noise 0.1). A point's
input is (x, y, colour, 3) times a fixed random 4 × dim matrix (dim = 8); the constant 3 is a
homogeneous coordinate, so the layer's input LayerNorm (which forgets each vector's mean and
scale) is one-to-one on the scene. Every layer has num_slots = K and random (untrained)
weights; everything is float64.

Rows of the pictures (all with ``iters`` = 8 updates):

1. collapsed, τ = 0.03 × the keys' variance per dimension, initial slots at K random keys
   of the scene, ``--restarts`` = 16 such starts per scene and the run with the lowest final
   free energy kept (EM finds local optima; the free energy picks among them);
1b. the same with one start per scene (the first of those 16): EM at work, local optima
   included;
2. collapsed, same τ, the layer's own initial slots μ + σ·ε: they start far from the keys,
   the nearest slot takes every point and the others stay empty (dead slots);
3. collapsed, the default τ = √dim, same starts: τ is far wider than the blobs in key space,
   so every posterior stays near uniform and the slots merge;
4. original (Locatello et al.) with random weights and its own initial slots: no grouping.

Shows (``gallery/output/slots/``):

- ``slots_scene<b>.png``: one column per iteration t = 0 … T (the posterior p(φ_j = s) at each
  state, initial included), points coloured by their soft assignment (the posterior-weighted
  mix of the slot colours), × at each slot's posterior-weighted mean position; last column:
  the true blobs in the colours of the slots they match best;
- ``slots_free_energy.png``: the free energy per point per iteration for every scene, per row
  (asserted non-increasing for the collapsed recipe; the original recipe's GRU update makes
  no such promise).

Agreement with the true blobs: adjusted Rand index (ARI, written out here: scikit-learn is not
a dependency) and best-permutation accuracy, averaged over scenes.
``--quick``: 3 scenes of 60 points from 3 blobs, 4 iterations (the test suite).
Run: ``python gallery/plot_slots.py [--scenes B] [--points N] [--blobs K] [--iters T]
[--restarts R] [--out DIR] [--quick]``
"""
# mkdocs_gallery_thumbnail_path = "../gallery/results/slots_scene0.png"

from __future__ import annotations

import argparse
import itertools
import math
import os
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import structattn as sa  # noqa: E402

F64 = torch.float64
HOMOGENEOUS = 3.0  # the constant input channel (see the module docstring)
TAU_FRACTION = 0.03  # τ = TAU_FRACTION × the keys' variance per dimension


# -- data -------------------------------------------------------------------------------------
def blob_centres(K, g, min_dist=1.6):
    while True:  # rejection sampling: K points in [−2, 2]² at least min_dist apart
        c = 4 * torch.rand(K, 2, generator=g, dtype=F64) - 2
        if K == 1 or float(torch.pdist(c).min()) >= min_dist:
            return c


def make_scenes(B, N, K, g, spread=0.3):
    """Positions ``(B, N, 2)``, colours ``(B, N)`` and true blob labels ``(B, N)``."""
    centres = torch.stack([blob_centres(K, g) for _ in range(B)])
    colours = 2 * torch.rand(B, K, generator=g, dtype=F64) - 1
    labels = torch.randint(0, K, (B, N), generator=g)
    pos = centres.gather(1, labels[..., None].expand(B, N, 2))
    pos = pos + spread * torch.randn(B, N, 2, generator=g, dtype=F64)
    col = colours.gather(1, labels) + 0.1 * torch.randn(B, N, generator=g, dtype=F64)
    return pos, col, labels


def inputs_for(pos, col, dim, g):
    """(x, y, colour, HOMOGENEOUS) times a fixed random (4, dim) matrix: ``(B, N, dim)``."""
    u = torch.cat([pos, col[..., None], torch.full_like(col[..., None], HOMOGENEOUS)], -1)
    return u @ torch.randn(4, dim, generator=g, dtype=F64)


def random_keys(keys, K, g):
    """K distinct keys per batch entry, drawn uniformly (EM's classical "Forgy" start).
    ``(B, N, d)`` → ``(B, K, d)``."""
    return torch.stack([k[torch.randperm(k.shape[0], generator=g)[:K]] for k in keys])


# -- agreement with the true blobs --------------------------------------------------------------
def adjusted_rand_index(truth, pred) -> float:
    """Hubert & Arabie's ARI of two labellings of the same points (1: identical partitions,
    ≈ 0: chance)."""
    truth, pred = np.asarray(truth), np.asarray(pred)
    table = np.zeros((truth.max() + 1, pred.max() + 1))
    np.add.at(table, (truth, pred), 1)

    def pairs(x):
        return (x * (x - 1) / 2).sum()

    index, rows, cols = pairs(table), pairs(table.sum(1)), pairs(table.sum(0))
    expected = rows * cols / pairs(np.array([len(truth)]))
    best = (rows + cols) / 2
    return 1.0 if best == expected else float((index - expected) / (best - expected))


def best_permutation(truth, pred, K, S):
    """The map blob → slot (injective; S ≥ K) with the most points in agreement, and the
    fraction of points it gets right."""
    table = np.zeros((K, S))
    np.add.at(table, (np.asarray(truth), np.asarray(pred)), 1)
    perm = max(itertools.permutations(range(S), K), key=lambda p: table[range(K), p].sum())
    return perm, table[range(K), perm].sum() / len(truth)


# -- the layers -----------------------------------------------------------------------------
def run(model, x, init=None, restarts=1):
    """Run ``model`` on ``x`` ``(B, N, dim)``. ``init`` ``(B·restarts, S, dim)`` (or None: the
    layer's own initial slots, one run). Keeps, per scene, the run with the lowest final
    free energy. Returns posteriors ``(T + 1, B, N, S)`` and free energies ``(T + 1, B)``."""
    B = x.shape[0]
    xs = x.repeat_interleave(restarts, 0) if init is not None else x
    with torch.no_grad():
        _, _, trace = sa.compile(model)(xs, init, return_posterior=True, return_trace=True,
                                        trace_posteriors=True)
    post = trace.posteriors["assign"][:, :, 0]  # (T + 1, B·R, N, S)
    F = trace.free_energy  # (T + 1, B·R)
    r = restarts if init is not None else 1
    best = F[-1].reshape(B, r).argmin(-1) + r * torch.arange(B)
    return post[:, best], F[:, best]


def variants(args, x, g):
    """The rows of the pictures: name → (posteriors, free energies, monotone?)."""
    K, dim, T = args.blobs, args.dim, args.iters
    torch.manual_seed(args.seed)  # the random (untrained) weights
    default = sa.models.slot_attention(K, dim, iters=T, recipe="collapsed", dtype=F64)  # τ = √dim
    with torch.no_grad():
        keys = default.to_k(default.norm_input(x))
    tau = TAU_FRACTION * float(keys.var(1).mean())
    tuned = sa.models.slot_attention(K, dim, iters=T, recipe="collapsed", temperature=tau,
                                     dtype=F64)
    tuned.load_state_dict(default.state_dict())  # the same weights
    original = sa.models.slot_attention(K, dim, iters=T, recipe="original", dtype=F64)
    seeds = random_keys(keys.repeat_interleave(args.restarts, 0), K, g)
    torch.manual_seed(args.seed + 1)  # the layers' own initial slots
    out = {
        f"collapsed, τ = {tau:.2g}, slots start at random keys (best of {args.restarts} by F)":
            (*run(tuned, x, seeds, args.restarts), True),
        f"collapsed, τ = {tau:.2g}, one start at random keys": (
            *run(tuned, x, seeds[::args.restarts]), True),
        f"collapsed, τ = {tau:.2g}, the layer's initial slots": (*run(tuned, x), True),
        f"collapsed, default τ = √dim = {math.sqrt(dim):.2g}, random keys (best of "
        f"{args.restarts})":
            (*run(default, x, seeds, args.restarts), True),
        "original recipe, random weights": (*run(original, x), False),
    }
    return out, tau


# -- pictures -------------------------------------------------------------------------------
def palette(S):
    return np.array(plt.get_cmap("tab10").colors[:S])


def draw_points(ax, pos, post, colours):
    """Points in their soft-assignment colour; × at each slot's posterior-weighted mean."""
    mix = np.clip(post @ colours, 0, 1)
    ax.scatter(pos[:, 0], pos[:, 1], c=mix, s=9, linewidths=0)
    mass = post.sum(0)
    for s in range(post.shape[1]):
        if mass[s] >= 1:  # a slot with (almost) no points has no position to show
            centre = post[:, s] @ pos / mass[s]
            ax.scatter(*centre, marker="X", s=90, color=colours[s], edgecolors="k", linewidths=1)


def plot_scene(b, results, scores, pos, labels, path, title):
    names = list(results)
    T = next(iter(results.values()))[0].shape[0] - 1
    fig, axes = plt.subplots(len(names), T + 2, squeeze=False,
                             figsize=(1.55 * (T + 2) + 1.8, 1.7 * len(names) + 0.9))
    p, lab = pos[b].numpy(), labels[b].numpy()
    lim = (p.min() - 0.3, p.max() + 0.3)
    for r, name in enumerate(names):
        post = results[name][0][:, b].numpy()  # (T + 1, N, S)
        colours = palette(post.shape[-1])
        for t in range(T + 1):
            draw_points(axes[r, t], p, post[t], colours)
        perm, _ = best_permutation(lab, post[-1].argmax(-1), post.shape[-1], post.shape[-1])
        axes[r, T + 1].scatter(p[:, 0], p[:, 1], c=colours[np.array(perm)[lab]], s=9,
                               linewidths=0)
        for ax in axes[r]:
            ax.set_xlim(lim)
            ax.set_ylim(lim)
            ax.set_aspect("equal")
            ax.set_xticks([])
            ax.set_yticks([])
        ari, acc = scores[name][b]
        axes[r, 0].set_ylabel("\n".join(_wrap(name, 26)) + f"\nARI {ari:.2f}, acc {acc:.0%}",
                              fontsize=7, rotation=0, ha="right", va="center")
    for t in range(T + 1):
        axes[0, t].set_title("t = 0 (initial)" if t == 0 else f"t = {t}", fontsize=8)
    axes[0, T + 1].set_title("true blobs", fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _wrap(text, width):
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    return [*lines, line]


def plot_free_energy(results, n_points, path, title):
    names = list(results)
    fig, axes = plt.subplots(1, len(names), figsize=(3.1 * len(names), 3.5), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        _, F, monotone = results[name]
        T = F.shape[0] - 1
        ax.plot(range(T + 1), (F / n_points).numpy(), lw=0.8, alpha=0.6)
        if bool((F > 0).all()) and float(F.max() / F.min()) > 10:  # wide positive range
            ax.set_yscale("log")
        ax.set_title("\n".join(_wrap(name, 30)), fontsize=8)
        ax.set_xlabel("iteration t", fontsize=8)
        ax.set_xticks(range(T + 1))
        ax.tick_params(labelsize=7)
        note = "never increases (asserted)" if monotone else "GRU update: no descent promise"
        ax.text(0.97, 0.97, note, transform=ax.transAxes, ha="right", va="top", fontsize=7)
    axes[0, 0].set_ylabel("free energy F / N\n(one line per scene)", fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenes", type=int, default=64, help="scenes B")
    p.add_argument("--points", type=int, default=200, help="points per scene N")
    p.add_argument("--blobs", type=int, default=4, help="blobs per scene K (= num_slots)")
    p.add_argument("--dim", type=int, default=8, help="slot/input dimension")
    p.add_argument("--iters", type=int, default=8, help="slot updates T")
    p.add_argument("--restarts", type=int, default=16, help="initial slots tried per scene")
    p.add_argument("--draw", type=int, default=2, help="scenes drawn")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "output", "slots"))
    p.add_argument("--quick", action="store_true", help="small and fast (test suite)")
    args = p.parse_args(argv)
    if args.quick:
        args.scenes, args.points, args.blobs, args.iters, args.restarts, args.draw = 3, 60, 3, 4, 2, 1
    os.makedirs(args.out, exist_ok=True)
    start = time.perf_counter()
    g = torch.Generator().manual_seed(args.seed)
    pos, col, labels = make_scenes(args.scenes, args.points, args.blobs, g)
    x = inputs_for(pos, col, args.dim, g)
    results, tau = variants(args, x, g)

    scores = {}
    print(f"{args.scenes} scenes × {args.points} points, K = {args.blobs} blobs, dim = {args.dim}, "
          f"{args.iters} iterations; τ = {tau:.3g}")
    print(f"{'mean over scenes':<72} {'ARI':>5} {'acc':>6} {'worst acc':>9}")
    for name, (post, F, monotone) in results.items():
        if monotone:
            rise = float((F[1:] - F[:-1]).max()) if args.iters else 0.0
            assert rise <= 1e-9 * float(F.abs().max()), f"{name}: free energy rose by {rise:g}"
        pred = post[-1].argmax(-1)
        scores[name] = [(adjusted_rand_index(labels[b], pred[b]),
                         best_permutation(labels[b], pred[b], args.blobs, args.blobs)[1])
                        for b in range(args.scenes)]
        ari, acc = (float(np.mean(v)) for v in zip(*scores[name], strict=True))
        worst = min(a for _, a in scores[name])
        print(f"{name:<72} {ari:5.3f} {acc:6.1%} {worst:9.1%}")

    written = []
    best = next(iter(results))
    ari, acc = (float(np.mean(v)) for v in zip(*scores[best], strict=True))
    for b in range(min(args.draw, args.scenes)):
        path = os.path.join(args.out, f"slots_scene{b}.png")
        plot_scene(b, results, scores, pos, labels, path,
                   f"untrained slot attention, scene {b}: {args.points} points, {args.blobs} blobs, "
                   f"{args.blobs} slots (per row: this scene's ARI and accuracy)\n"
                   f"row 1 over all {args.scenes} scenes: ARI {ari:.3f}, accuracy {acc:.1%}")
        written.append(path)
    path = os.path.join(args.out, "slots_free_energy.png")
    plot_free_energy(results, args.points, path,
                     f"free energy per iteration ({args.scenes} scenes; collapsed = EM: F never "
                     f"increases)")
    written.append(path)
    print(f"({time.perf_counter() - start:.1f} s)\nwrote:\n  " + "\n  ".join(written))
    return written


if __name__ == "__main__":
    main()
