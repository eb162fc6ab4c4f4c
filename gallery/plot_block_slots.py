"""Block-slot attention binding position and colour
================================================

Block-slot attention binding separate factors, untrained (Singh et al. 2023; paper §4.3):
the collapsed recipe is EM on two edge families at once — each point picks a slot
(``"assign"``) and each block of each slot picks a prototype from a memory (``"bind"``) — so
with the slots' position block and colour block reading separate prototype sets it groups the
points *and* names each object's cell and colour, with no training at all.

Toy scenes: K = 4 objects per scene, each at one of the 6 cells of a 3 × 2 grid (x ∈ {−1.5,
0, 1.5}, y ∈ {−0.75, 0.75}; distinct cells, the object's centre jittered by N(0, 0.15²)) and
with one of 6 colours (red, green, blue, yellow, magenta, cyan; drawn independently of the
cell, with replacement, so two objects can share a colour). N = 160 points per scene, each
from a random object: position = centre + N(0, 0.3²) per coordinate, colour (r, g, b) = the
object's colour + N(0, 0.08²) per channel.

What is set by hand (nothing is trained; float64):

- **inputs**: the layer's input LayerNorm forgets each vector's mean and scale, so a point's
  factors a = (x, y, r, g, b) are written as (x, y, −x, −y, p, −p, r, g, b, −r, −g, −b) with
  p = √(R² − ‖a‖²) (R = 4): every input has mean 0 and the same norm, so LayerNorm is an
  exact scaling by √6/R (dim = 12);
- **to_k** = the selection that undoes that scaling and keeps (x, y, 0, 0, 0, 0 | r, g, b,
  0, 0, 0): block 0 of a key is the position, block 1 the colour (bias 0);
- **prototypes** ``(2, 6, 6)``: block 0 = the 6 grid cells (x, y, 0, 0, 0, 0), block 1 = the
  6 colours (r, g, b, 0, 0, 0);
- **slot prior** μ = 0, σ = 10 (``slots_mu`` = 0, ``slots_logsigma`` = log 10): negligible;
- τ = 0.1 (≈ the points' variance per position coordinate, 0.09), τ_mem = 0.05; S = K slots,
  initial slots at S random keys of the scene, ``--restarts`` = 8 such starts per scene and
  the run with the lowest final free energy kept (EM finds local optima; F picks among them).

Shows (``gallery/output/block_slots/``):

- ``block_slots_scene<b>.png``: the points in their own colour, then one panel per iteration
  t = 0 … T coloured by their soft slot assignment (the posterior-weighted mix of the slot
  colours; × at each slot's posterior-weighted mean position), then the true objects; below,
  the binding posterior p(ω_sm = k) of every slot s (rows) over the prototypes k (columns) of
  the position block and of the colour block, at t = 0 and t = T (□: the right prototype of
  the object the slot matches);
- ``block_slots_free_energy.png``: the free energy per point per iteration for every scene
  (asserted never to increase: EM).

Scores over all scenes, for the kept runs and for the first start alone: adjusted Rand index
of the final argmax assignment against the true objects (``sklearn.metrics.
adjusted_rand_score``), and, matching slots to objects by the most shared points, the
fraction of objects whose slot's position block binds the right cell and whose colour block
binds the right colour (argmax of the final binding posterior).
``--quick``: 4 scenes of 80 points, 4 iterations, 2 starts (the test suite).
Run: ``python gallery/plot_block_slots.py [--scenes B] [--points N] [--iters T]
[--restarts R] [--out DIR] [--quick]``
"""
# mkdocs_gallery_thumbnail_path = "../gallery/results/block_slots_scene0.png"

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
from matplotlib.patches import Rectangle  # noqa: E402
from sklearn.metrics import adjusted_rand_score  # noqa: E402

import structattn as sa  # noqa: E402

F64 = torch.float64
CELLS = torch.tensor([[x, y] for y in (0.75, -0.75) for x in (-1.5, 0.0, 1.5)], dtype=F64)
CELL_NAMES = [f"({x:g}, {y:g})" for x, y in CELLS.tolist()]
COLOURS = torch.tensor([[1, 0, 0], [0, 1, 0], [0, 0, 1], [1, 1, 0], [1, 0, 1], [0, 1, 1]],
                       dtype=F64)
COLOUR_NAMES = ["red", "green", "blue", "yellow", "magenta", "cyan"]
OBJECTS = 4  # objects per scene = slots
DIM, BLOCK = 12, 6  # slot dimension, block size (2 blocks)
RADIUS = 4.0  # the common norm R of every input (see the module docstring)
TAU, TAU_MEMORY = 0.1, 0.05


# -- data -------------------------------------------------------------------------------------
def make_scenes(B, N, g, jitter=0.15, spread=0.3, colour_noise=0.08):
    """Positions ``(B, N, 2)``, colours ``(B, N, 3)``, object labels ``(B, N)`` and each
    object's true cell and colour index ``(B, K)`` twice."""
    cells = torch.stack([torch.randperm(len(CELLS), generator=g)[:OBJECTS] for _ in range(B)])
    colours = torch.randint(0, len(COLOURS), (B, OBJECTS), generator=g)
    centres = CELLS[cells] + jitter * torch.randn(B, OBJECTS, 2, generator=g, dtype=F64)
    labels = torch.randint(0, OBJECTS, (B, N), generator=g)
    pos = centres.gather(1, labels[..., None].expand(B, N, 2))
    pos = pos + spread * torch.randn(B, N, 2, generator=g, dtype=F64)
    col = COLOURS[colours].gather(1, labels[..., None].expand(B, N, 3))
    col = col + colour_noise * torch.randn(B, N, 3, generator=g, dtype=F64)
    return pos, col, labels, cells, colours


def encode(pos, col):
    """(x, y, −x, −y, p, −p, r, g, b, −r, −g, −b) with p = √(R² − ‖a‖²): mean 0, norm R√2, so
    LayerNorm(input) = input · √6 / R exactly. ``(B, N, 2), (B, N, 3) → (B, N, 12)``."""
    a = torch.cat([pos, col], -1)
    p = (RADIUS ** 2 - (a * a).sum(-1, keepdim=True)).sqrt()
    assert bool((p > 0).all()), "a point lies outside the radius R: raise RADIUS"
    return torch.cat([pos, -pos, p, -p, col, -col], -1)


def build_layer(iters):
    """The collapsed block-slot layer with the hand-set weights of the module docstring."""
    m = sa.models.block_slot_attention(OBJECTS, DIM, num_blocks=2, num_prototypes=len(CELLS),
                                       iters=iters, recipe="collapsed", temperature=TAU,
                                       memory_temperature=TAU_MEMORY, dtype=F64)
    scale = RADIUS / math.sqrt(DIM / 2)  # the standard deviation of every input (undone here)
    select = torch.zeros(DIM, DIM, dtype=F64)
    for key, inp in ((0, 0), (1, 1), (6, 6), (7, 7), (8, 8)):  # x, y | r, g, b
        select[key, inp] = scale
    with torch.no_grad():
        m.to_k.weight.copy_(select)
        m.to_k.bias.zero_()
        m.slots_mu.zero_()
        m.slots_logsigma.fill_(math.log(10.0))
        m.prototypes.zero_()
        m.prototypes[0, :, :2] = CELLS
        m.prototypes[1, :, :3] = COLOURS
    return m


def random_keys(keys, S, g):
    """S distinct keys per batch entry (EM's "Forgy" start). ``(B, N, d)`` → ``(B, S, d)``."""
    return torch.stack([k[torch.randperm(k.shape[0], generator=g)[:S]] for k in keys])


def run(m, x, restarts, g):
    """EM from ``restarts`` random-key starts per scene. Returns, for the run with the lowest
    final F per scene (``"best"``) and for the first start alone (``"one start"``),
    assignment ``(T + 1, B, N, S)`` and binding ``(T + 1, B, 2, S, K)`` posteriors and free
    energies ``(T + 1, B)``."""
    B = x.shape[0]
    xs = x.repeat_interleave(restarts, 0)
    layer = sa.compile(m)
    with torch.no_grad():
        keys = m.to_k(m.norm_input(xs))
        init = random_keys(keys, OBJECTS, g)
        _, trace = layer(xs, init, return_trace=True, trace_posteriors=True)
    F = trace.free_energy  # (T + 1, B·R)
    first = restarts * torch.arange(B)
    best = F[-1].reshape(B, restarts).argmin(-1) + first
    return {name: (trace.posteriors["assign"][:, idx, 0], trace.posteriors["bind"][:, idx],
                   F[:, idx]) for name, idx in (("best", best), ("one start", first))}, F


# -- scores -------------------------------------------------------------------------------------
def match_slots(labels, pred):
    """object → slot (a permutation) sharing the most points."""
    table = np.zeros((OBJECTS, OBJECTS))
    np.add.at(table, (np.asarray(labels), np.asarray(pred)), 1)
    return max(itertools.permutations(range(OBJECTS)), key=lambda p: table[range(OBJECTS), p].sum())


def score(labels, cells, colours, assign, bind):
    """Per scene: ARI, and per object whether its slot's blocks bind the right cell / colour."""
    pred = assign[-1].argmax(-1)  # (B, N)
    chosen = bind[-1].argmax(-1)  # (B, 2, S)
    aris, cell_ok, colour_ok, perms = [], [], [], []
    for b in range(labels.shape[0]):
        aris.append(adjusted_rand_score(labels[b].numpy(), pred[b].numpy()))
        perm = match_slots(labels[b], pred[b])
        perms.append(perm)
        for o, s in enumerate(perm):
            cell_ok.append(int(chosen[b, 0, s]) == int(cells[b, o]))
            colour_ok.append(int(chosen[b, 1, s]) == int(colours[b, o]))
    return np.array(aris), np.array(cell_ok), np.array(colour_ok), perms


# -- pictures -------------------------------------------------------------------------------
SLOT_COLOURS = np.array([[1.0, 0.5, 0.05], [0.42, 0.24, 0.6], [0.55, 0.34, 0.29], [0.3, 0.3, 0.3]])


def palette(S):
    """Slot colours (orange, purple, brown, grey): unlike every object colour."""
    return SLOT_COLOURS[:S]


def _square(ax, lim):
    ax.set_xlim(lim)
    ax.set_ylim(lim)
    ax.set_aspect("equal")
    ax.set_xticks([])
    ax.set_yticks([])


def plot_scene(b, pos, col, labels, cells, colours, assign, bind, perm, ari, path, title):
    T = assign.shape[0] - 1
    S = assign.shape[-1]
    slot_col = palette(S)
    p, c = pos[b].numpy(), np.clip(col[b].numpy(), 0, 1)
    lim = (-2.6, 2.6)
    cols = T + 3
    fig = plt.figure(figsize=(1.7 * cols + 0.4, 5.9))
    grid = fig.add_gridspec(2, cols, height_ratios=[1, 1.15])
    ax = fig.add_subplot(grid[0, 0])
    ax.scatter(p[:, 0], p[:, 1], c=c, s=7, linewidths=0)
    ax.set_title("input: points in\ntheir own colour", fontsize=8)
    _square(ax, lim)
    for t in range(T + 1):
        ax = fig.add_subplot(grid[0, t + 1])
        post = assign[t, b].numpy()  # (N, S)
        ax.scatter(p[:, 0], p[:, 1], c=np.clip(post @ slot_col, 0, 1), s=7, linewidths=0)
        mass = post.sum(0)
        for s in range(S):
            if mass[s] >= 1:
                centre = post[:, s] @ p / mass[s]
                ax.scatter(*centre, marker="X", s=80, color=slot_col[s], edgecolors="k",
                           linewidths=1)
        ax.set_title("t = 0 (initial)" if t == 0 else f"t = {t}", fontsize=8)
        _square(ax, lim)
    ax = fig.add_subplot(grid[0, T + 2])
    ax.scatter(p[:, 0], p[:, 1], c=slot_col[np.array(perm)[labels[b].numpy()]], s=7, linewidths=0)
    ax.set_title(f"true objects\n(ARI {ari:.2f})", fontsize=8)
    _square(ax, lim)

    # binding heat maps: position block and colour block, at t = 0 and t = T
    inner = grid[1, :].subgridspec(1, 4, wspace=0.5)
    slot_of = {s: o for o, s in enumerate(perm)}
    for k, (t, block) in enumerate(itertools.product((0, T), (0, 1))):
        ax = fig.add_subplot(inner[0, k])
        post = bind[t, b, block].numpy()  # (S, K)
        ax.imshow(post, cmap="Greys", vmin=0, vmax=1, aspect="auto")
        names = CELL_NAMES if block == 0 else COLOUR_NAMES
        ax.set_xticks(range(len(names)), names, rotation=60, fontsize=6, ha="right")
        if block == 1:  # each colour's name on its own colour
            for tick, rgb in zip(ax.get_xticklabels(), COLOURS.numpy(), strict=True):
                tick.set_bbox({"facecolor": rgb, "edgecolor": "none", "pad": 1.5})
                tick.set_color("w" if rgb.sum() < 1.5 else "k")
        ax.set_yticks(range(S), [f"slot {s}" for s in range(S)], fontsize=7)
        for s, tick in enumerate(ax.get_yticklabels()):
            tick.set_color(slot_col[s])
        for s in range(S):
            o = slot_of[s]
            right = int((cells if block == 0 else colours)[b, o])
            ax.add_patch(Rectangle((right - 0.5, s - 0.5), 1, 1, fill=False, ec="C3", lw=1.6))
        what = "position block: cells" if block == 0 else "colour block: colours"
        ax.set_title(f"p(bind), t = {t}\n{what}", fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_free_energy(F, n_points, path, title):
    fig, ax = plt.subplots(figsize=(5.4, 3.6))
    T = F.shape[0] - 1
    ax.plot(range(T + 1), (F / n_points).numpy(), lw=0.8, alpha=0.6)
    ax.set_xticks(range(T + 1))
    ax.set_xlabel("iteration t")
    ax.set_ylabel("free energy F / N (one line per scene)")
    ax.text(0.97, 0.97, "never increases (asserted)", transform=ax.transAxes, ha="right",
            va="top", fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenes", type=int, default=64, help="scenes B")
    p.add_argument("--points", type=int, default=160, help="points per scene N")
    p.add_argument("--iters", type=int, default=6, help="EM iterations T")
    p.add_argument("--restarts", type=int, default=8, help="initial slots tried per scene")
    p.add_argument("--draw", type=int, default=2, help="scenes drawn")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "output",
                                                 "block_slots"))
    p.add_argument("--quick", action="store_true", help="small and fast (test suite)")
    args = p.parse_args(argv)
    if args.quick:
        args.scenes, args.points, args.iters, args.restarts, args.draw = 4, 80, 4, 2, 1
    os.makedirs(args.out, exist_ok=True)
    start = time.perf_counter()
    g = torch.Generator().manual_seed(args.seed)
    pos, col, labels, cells, colours = make_scenes(args.scenes, args.points, g)
    m = build_layer(args.iters)
    results, F_all = run(m, encode(pos, col), args.restarts, g)
    rise = float((F_all[1:] - F_all[:-1]).max()) if args.iters else 0.0  # every start
    assert rise <= 1e-9 * float(F_all.abs().max()), f"free energy rose by {rise:g}"
    shared = sum(len(set(c.tolist())) < OBJECTS for c in colours)
    print(f"{args.scenes} scenes × {args.points} points, {OBJECTS} objects = slots, "
          f"{args.iters} EM iterations, best of {args.restarts} starts; τ = {TAU}, "
          f"τ_mem = {TAU_MEMORY}; {shared} scenes have two objects of one colour")
    for name, (assign, bind, F) in results.items():
        aris, cell_ok, colour_ok, perms = score(labels, cells, colours, assign, bind)
        print(f"  {name:>9}: ARI mean {aris.mean():.3f} (min {aris.min():.3f}); position block "
              f"binds the right cell for {cell_ok.mean():.1%} of {cell_ok.size} objects, colour "
              f"block the right colour for {colour_ok.mean():.1%}")
        if name == "best":
            kept = (assign, bind, F, aris, cell_ok, colour_ok, perms)
        else:
            single = f"one start per scene: ARI {aris.mean():.3f}, {cell_ok.mean():.0%} / " \
                     f"{colour_ok.mean():.0%}"
    assign, bind, F, aris, cell_ok, colour_ok, perms = kept

    written = []
    for b in range(min(args.draw, args.scenes)):
        path = os.path.join(args.out, f"block_slots_scene{b}.png")
        objs = ", ".join(f"{COLOUR_NAMES[int(colours[b, o])]} at {CELL_NAMES[int(cells[b, o])]}"
                         for o in range(OBJECTS))
        plot_scene(b, pos, col, labels, cells, colours, assign, bind, perms[b], aris[b], path,
                   f"untrained block-slot attention (collapsed: EM), scene {b}: {objs}\n"
                   f"over all {args.scenes} scenes, best of {args.restarts} starts by F: ARI "
                   f"{aris.mean():.3f}; right cell bound {cell_ok.mean():.0%}, right colour bound "
                   f"{colour_ok.mean():.0%} of objects ({single})\n"
                   f"below: binding posterior p(ω_sm = k) per slot s and block m (white 0, black "
                   f"1); □ the true cell / colour of the object the slot matches")
        written.append(path)
    path = os.path.join(args.out, "block_slots_free_energy.png")
    plot_free_energy(F, args.points, path,
                     f"block-slot EM: free energy per iteration\n({args.scenes} scenes, the "
                     f"start kept for each)")
    written.append(path)
    print(f"({time.perf_counter() - start:.1f} s)\nwrote:\n  " + "\n  ".join(written))
    return written


if __name__ == "__main__":
    main()
