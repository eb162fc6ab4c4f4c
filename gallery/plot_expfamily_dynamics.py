"""Exponential-family dynamics
===========================

Exponential-family dynamics (SPEC "Exponential-family view"): attention plus residual is a
gradient-ascent step η ← η + ∇G(βη) on the log-normaliser G of an intrinsic measure h; it
expands the point cloud, and a renormalisation RN contracts it. The drafts conjecture that
the composed map η ← RN(η + ∇G(βη)) has a Gaussian equilibrium. This script measures it.

Dynamics (``structattn.measures.residual_dynamics``, float64): N = 200 points in d = 4
dimensions, β = 1, 128 iterations; the start is 3 Gaussian blobs (centres on a triangle of
radius 2 in a random plane, standard deviation 0.35 in every direction), renormalised once
before iteration 0. Self-attention: h is the empirical measure of the current points, so
∇G(βη_i) = Σ_j softmax_j(β⟨η_i, η_j⟩) η_j. The renormalisations (``renormalise``): none;
LayerNorm (each point to zero mean and unit variance over its d features: a sphere of radius
√d in the hyperplane ⊥ (1, …, 1)); BatchNorm (each feature to zero mean and unit variance over
the points); sphere (each point to norm √d). Why d = 4 and not 2: in d = 2 LayerNorm maps every
point (a, b) with |a − b| ≫ √ε to ±(1, −1), two points, whatever the dynamics (printed);
d = 4 leaves LayerNorm a 2-sphere. The pictures show a 2-D PCA projection.

The distance to Gaussian, D(X), for a cloud X of N points: the sliced Kolmogorov–Smirnov
distance to its own Gaussian fit, D(X) = mean over P = 64 random unit directions u of
sup_t |F̂_u(t) − Φ((t − uᵀm)/√(uᵀSu))|, with F̂_u the empirical CDF of the projections uᵀx_n
and m, S the sample mean and covariance (so uᵀm, uᵀSu fit the projections; a Lilliefors
statistic per direction; the same P directions per seed for every iteration). Its population
value is 0 for a Gaussian (over all directions only for one: Cramér–Wold); it is invariant to
shifts and scales, and defined for degenerate clouds (a line, k clusters) unless every point
coincides: a cloud whose spread is below 1e-8 of its size has
collapsed to one point (a Dirac, a Gaussian only with covariance 0) and gets no value; the
plots mark the collapse with ×. Noise floor: D of N independent samples of a Gaussian (same N,
d, P; ``--floor-draws`` draws): its mean and 5–95 % band. On the sphere and LayerNorm rows no
cloud can be Gaussian (the support is a sphere); the dotted "support floor" is D of a uniform
sample on that sphere (a renormalised Gaussian sample), the closest those rows can come.
Clusters: connected components of the graph linking points closer than 1e-3 × the cloud's rms
norm.

Shows (``gallery/output/expfamily/``):

- ``expfamily_clouds.png``: one row per renormalisation, one column per iteration t (seed 0),
  points coloured by their starting blob; each panel gives D and the number of clusters.
  Without renormalisation the cloud expands (its rms radius is given; the axes follow it);
- ``expfamily_gaussianity.png``: D over the iterations per renormalisation, one thin line per
  seed (``--seeds``), the mean in bold, with the noise floor; dashed: the same dynamics from a
  Gaussian start, an N(0, I) sample (does a Gaussian stay Gaussian?); right: the number of
  clusters;
- ``expfamily_cross.png``: cross-attention with a fixed Gaussian measure h = N(μ, Σ) (μ, Σ
  random per seed), where ∇G(βη) = μ + βΣη is linear, with ``--cross-renorm`` (BatchNorm by
  default): the composed map is affine on the cloud, so a Gaussian start stays Gaussian and a
  non-Gaussian one only gets projected; rows: the blob start and a sample of the poster's
  claimed equilibrium N(Σ⁻¹μ, Σ⁻¹); right: D over the iterations with the noise floor.

Printed: a markdown table (D at t = 0, 8 and T, the clusters at T, the seeds collapsed to a
point, for self-attention at β and each ``--betas`` (0.25 and 4), and cross-attention with each
renormalisation) and one verdict line per renormalisation.
``--quick``: 60 points, 4 iterations, 2 seeds (the test suite).
Run: ``python gallery/plot_expfamily_dynamics.py [--points N] [--dim D] [--steps T] [--beta B]
[--betas B …] [--seeds S] [--cross-renorm R] [--out DIR] [--quick]``
"""
# mkdocs_gallery_thumbnail_path = "../gallery/results/expfamily_gaussianity.png"

from __future__ import annotations

import argparse
import math
import os
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from structattn.measures import Gaussian, renormalise, residual_dynamics  # noqa: E402

F64 = torch.float64
RENORMS = (None, "layernorm", "batchnorm", "sphere")
NAMES = {None: "none", "layernorm": "LayerNorm", "batchnorm": "BatchNorm", "sphere": "sphere"}
COLOURS = {None: "C0", "layernorm": "C1", "batchnorm": "C2", "sphere": "C3"}
COLLAPSED = 1e-8  # spread / size below which a cloud counts as one point
CLUSTER_TOL = 1e-3  # points closer than this × the cloud's rms norm are in one cluster


# -- data -------------------------------------------------------------------------------------
def blob_starts(S, N, d, g, radius=2.0, spread=0.35):
    """S clouds ``(S, N, d)`` of 3 blobs (centres on a triangle of ``radius`` in a random
    plane) and their blob labels ``(S, N)``."""
    angles = torch.tensor([0.0, 2 * math.pi / 3, 4 * math.pi / 3], dtype=F64)
    tri = radius * torch.stack([angles.cos(), angles.sin()], -1)  # (3, 2)
    plane = torch.linalg.qr(torch.randn(S, d, 2, generator=g, dtype=F64))[0]  # (S, d, 2)
    centres = tri @ plane.transpose(-1, -2)  # (S, 3, d)
    labels = torch.randint(0, 3, (S, N), generator=g)
    x = centres.gather(1, labels[..., None].expand(S, N, d))
    return x + spread * torch.randn(S, N, d, generator=g, dtype=F64), labels


def random_gaussian_measures(S, d, g):
    """μ ``(S, d)`` and Σ ``(S, d, d)`` (AAᵀ/d + ½I): a random Gaussian measure per seed."""
    A = torch.randn(S, d, d, generator=g, dtype=F64)
    sigma = A @ A.transpose(-1, -2) / d + 0.5 * torch.eye(d, dtype=F64)
    return torch.randn(S, d, generator=g, dtype=F64), sigma


def random_directions(S, d, P, g):
    u = torch.randn(S, d, P, generator=g, dtype=F64)
    return u / u.norm(dim=-2, keepdim=True)


# -- statistics -------------------------------------------------------------------------------
def sliced_ks(x, dirs):
    """D(x) of the module docstring: x ``(..., N, d)``, unit directions ``(..., d, P)`` →
    ``(...)``; NaN where the cloud has collapsed to one point."""
    y = x @ dirs  # (..., N, P)
    N = y.shape[-2]
    z = ((y - y.mean(-2, keepdim=True)) / y.std(-2, keepdim=True)).sort(-2).values
    cdf = torch.special.ndtr(z)
    i = torch.arange(1, N + 1, dtype=F64)[:, None]
    d = torch.maximum(i / N - cdf, cdf - (i - 1) / N).amax(-2).mean(-1)
    return torch.where(collapsed(x), torch.nan, d)


def collapsed(x):
    size = x.pow(2).sum(-1).mean(-1).sqrt()
    spread = (x - x.mean(-2, keepdim=True)).pow(2).sum(-1).mean(-1).sqrt()
    return spread <= COLLAPSED * size


def n_clusters(x):
    """Connected components of "closer than CLUSTER_TOL × the rms norm": x ``(..., N, d)`` →
    ``(...)`` (minimum-label propagation)."""
    tol = CLUSTER_TOL * x.pow(2).sum(-1).mean(-1).sqrt()
    A = torch.cdist(x, x, compute_mode="donot_use_mm_for_euclid_dist") <= tol[..., None, None]
    N = x.shape[-2]
    lab = torch.arange(N).expand(A.shape[:-1]).clone()
    while True:  # invariant lab[i] ≤ i, in i's component; ends at each component's least index
        new = torch.where(A, lab.unsqueeze(-2), N).amin(-1)
        new = new.gather(-1, new)  # pointer jumping
        if torch.equal(new, lab):
            return (lab == torch.arange(N)).sum(-1)
        lab = new


def noise_floor(N, d, P, draws, g, renorm=None):
    """D of ``draws`` samples of N points from N(0, I_d), renormalised by ``renorm`` (None or
    BatchNorm: a Gaussian sample; LayerNorm, sphere: a uniform sample on their sphere)."""
    x = renormalise(torch.randn(draws, N, d, generator=g, dtype=F64), renorm)
    return sliced_ks(x, random_directions(draws, d, P, g)).numpy()


def statistics(path, dirs, times=None):
    """D and the clusters ``(T + 1, S)`` along a trajectory ``(T + 1, S, N, d)``, at ``times``
    (default: every iteration; NaN and −1 elsewhere)."""
    times = list(range(path.shape[0])) if times is None else sorted(set(times))
    D = np.full(path.shape[:2], np.nan)
    k = np.full(path.shape[:2], -1)
    for chunk in torch.tensor(times).split(16):
        D[chunk] = sliced_ks(path[chunk], dirs).numpy()
        k[chunk] = n_clusters(path[chunk]).numpy()
    return D, k


def run(start, steps, renorm, beta, measure=None):
    with torch.no_grad():
        return residual_dynamics(renormalise(start, renorm), steps, renorm=renorm, measure=measure,
                                 beta=beta)


# -- pictures ---------------------------------------------------------------------------------
def columns(steps):
    ts = [t for t in (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if t <= steps]
    return ts if ts[-1] == steps else [*ts, steps]


def projection(clouds):
    """The top-2 principal directions ``(d, 2)`` of a stack of clouds ``(..., N, d)``."""
    x = clouds.reshape(-1, clouds.shape[-1])
    return torch.linalg.svd(x - x.mean(0), full_matrices=False)[2][:2].T


def draw_cloud(ax, xy, colour, lim, cmap=None):
    ax.scatter(xy[:, 0], xy[:, 1], c=colour, s=7, linewidths=0, cmap=None if colour.ndim > 1 else cmap)
    ax.set_xlim(-lim, lim)
    ax.set_ylim(-lim, lim)
    ax.set_aspect("equal")
    ax.set_xticks([])
    ax.set_yticks([])


def note(ax, D, k, extra=None):
    """D and the cluster count under the panel."""
    text = "one point" if math.isnan(D) else f"D {D:.2f}, {k} cl."
    ax.set_xlabel(text if extra is None else f"{text}, {extra}", fontsize=6.5, labelpad=2)


def plot_clouds(paths, stats, labels, args, path):
    ts = columns(args.steps)
    fig, axes = plt.subplots(len(RENORMS), len(ts), squeeze=False,
                             figsize=(1.45 * len(ts) + 1.3, 1.55 * len(RENORMS) + 0.8))
    colours = np.array(plt.get_cmap("tab10").colors[4:7])[labels[0].numpy()]
    for r, rn in enumerate(RENORMS):
        traj = paths[rn][ts, 0]  # (len(ts), N, d), seed 0
        W = projection(traj)
        D, k = stats[rn]
        for c, t in enumerate(ts):
            ax = axes[r, c]
            if rn is None:  # expanding: centre each panel, axes follow the cloud
                xy = ((traj[c] - traj[c].mean(0)) @ W).numpy()
                draw_cloud(ax, xy, colours, 1.15 * float(np.abs(xy).max()))
                radius = float(traj[c].pow(2).sum(-1).mean().sqrt())
                note(ax, float(D[t, 0]), int(k[t, 0]), f"rms {radius:.2g}")
            else:
                lim = 1.2 * float((paths[rn][ts, 0] @ W).abs().max())
                draw_cloud(ax, (traj[c] @ W).numpy(), colours, lim)
                note(ax, float(D[t, 0]), int(k[t, 0]))
        axes[r, 0].set_ylabel(NAMES[rn], fontsize=9)
    for c, t in enumerate(ts):
        axes[0, c].set_title(f"t = {t}", fontsize=8)
    fig.suptitle(f"self-attention residual dynamics η ← RN(η + ∇G(βη)), β = {args.beta:g}: "
                 f"{args.points} points in d = {args.dim} (2-D PCA per row), seed 0\n"
                 f"D = sliced KS distance to the Gaussian fit (noise floor ≈ "
                 f"{args.floor_mean:.3f}), cl. = clusters", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def floor_band(ax, floor, support=None, label=True):
    lo, hi = np.quantile(floor, [0.05, 0.95])
    ax.axhspan(lo, hi, color="0.85", zorder=0)
    ax.axhline(floor.mean(), color="0.4", lw=1,
               label="noise floor (Gaussian sample): mean, 5–95 %" if label else None)
    if support is not None:
        for rn, s in support.items():
            ax.axhline(s.mean(), color=COLOURS[rn], lw=0.9, ls=":",
                       label=f"support floor, {NAMES[rn]} (uniform on its sphere)" if label else None)


def seed_lines(ax, t, D, colour, label, ls="-"):
    """Thin line per seed, bold mean (where no seed has collapsed), × at each collapse."""
    for s in range(D.shape[1]):
        ax.plot(t, D[:, s], color=colour, lw=0.5, alpha=0.45, ls=ls)
        gone = np.isnan(D[:, s])
        if gone.any():
            first = int(np.argmax(gone))
            ax.plot(t[first - 1], D[first - 1, s], "x", color=colour, ms=6, mew=1.5)
    ax.plot(t, D.mean(1), color=colour, lw=2, ls=ls, label=label)


def x_axis(ax, steps):
    ax.set_xscale("symlog", linthresh=1)
    ax.set_xticks(columns(steps))
    ax.set_xticklabels([str(t) for t in columns(steps)])
    ax.set_xlim(0, steps)
    ax.set_xlabel("iteration t", fontsize=8)
    ax.tick_params(labelsize=7)


def plot_gaussianity(stats, gauss_stats, floor, support, args, path):
    t = np.arange(args.steps + 1)
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 5.6), gridspec_kw=dict(width_ratios=[1.5, 1]))
    floor_band(a, floor, support)
    for rn in RENORMS:
        seed_lines(a, t, stats[rn][0], COLOURS[rn], f"{NAMES[rn]}, blob start")
        a.plot(t, np.nanmean(gauss_stats[rn][0], 1), color=COLOURS[rn], lw=1.3, ls="--",
               label=f"{NAMES[rn]}, Gaussian start (mean)")
        k = stats[rn][1]
        for s in range(k.shape[1]):
            b.plot(t, k[:, s], color=COLOURS[rn], lw=0.5, alpha=0.45)
        b.plot(t, np.median(k, 1), color=COLOURS[rn], lw=2, label=NAMES[rn])
    x_axis(a, args.steps)
    x_axis(b, args.steps)
    a.set_ylabel("D: sliced KS distance to the Gaussian fit", fontsize=8)
    a.set_ylim(0, None)
    a.legend(fontsize=6.5, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.13))
    a.set_title(f"distance to Gaussian ({args.seeds} seeds; × = collapsed to one point after)",
                fontsize=9)
    b.set_yscale("log")
    b.set_ylabel(f"clusters (≤ {CLUSTER_TOL:g} × rms norm apart)", fontsize=8)
    b.set_title("number of clusters (bold: median over seeds), blob start", fontsize=9)
    b.legend(fontsize=7)
    fig.suptitle(f"does η ← RN(η + ∇G(βη)) (self-attention, β = {args.beta:g}, N = {args.points}, "
                 f"d = {args.dim}) approach a Gaussian?", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_cross(paths, stats, labels, floor, args, path):
    rn = args.cross_renorm
    ts = columns(args.steps)
    ts = sorted({*ts[::2], ts[-1]})
    fig = plt.figure(figsize=(1.9 * len(ts) + 5.5, 4.8))
    grid = fig.add_gridspec(2, len(ts) + 1, width_ratios=[1] * len(ts) + [2.6])
    blob_colours = np.array(plt.get_cmap("tab10").colors[4:7])[labels[0].numpy()]
    for r, (start, traj) in enumerate(paths.items()):
        traj = traj[ts, 0]
        W = projection(traj)
        lim = 1.2 * float((traj @ W).abs().max())
        colour = blob_colours if r == 0 else (traj[0] @ W[:, 0]).numpy()
        D, k = stats[start]
        for c, t in enumerate(ts):
            ax = fig.add_subplot(grid[r, c])
            draw_cloud(ax, (traj[c] @ W).numpy(), colour, lim, cmap="viridis")
            note(ax, float(D[t, 0]), int(k[t, 0]))
            if r == 0:
                ax.set_title(f"t = {t}", fontsize=8)
            if c == 0:
                ax.set_ylabel(start, fontsize=8)
    a = fig.add_subplot(grid[:, -1])
    t = np.arange(args.steps + 1)
    floor_band(a, floor)
    for (start, (D, _)), colour in zip(stats.items(), ("C4", "C9"), strict=True):
        seed_lines(a, t, D, colour, start)
    x_axis(a, args.steps)
    a.set_ylim(0, None)
    a.set_ylabel("D: sliced KS distance to the Gaussian fit", fontsize=8)
    a.legend(fontsize=7)
    fig.suptitle(f"cross-attention with a fixed Gaussian measure h = N(μ, Σ): η ← {NAMES[rn]}"
                 f"(η + μ + βΣη), β = {args.beta:g}, N = {args.points}, d = {args.dim} "
                 f"(seed 0 drawn; right: {args.seeds} seeds)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- the table --------------------------------------------------------------------------------
def fmt(D):
    """Mean over seeds (and range); seeds collapsed to one point are left out and counted."""
    ok = D[~np.isnan(D)]
    return "—" if not len(ok) else f"{ok.mean():.3f} ({ok.min():.3f}–{ok.max():.3f})"


def middle(steps):
    return 8 if steps > 8 else steps // 2


def table_row(dynamics, rn, beta, start, D, k, steps):
    mid = middle(steps)
    gone = int(np.isnan(D[-1]).sum())
    return (f"| {dynamics} | {NAMES[rn]} | {beta:g} | {start} | {fmt(D[0])} | {fmt(D[mid])} | "
            f"{fmt(D[-1])} | {int(np.median(k[-1]))} ({int(k[-1].min())}–{int(k[-1].max())}) | "
            f"{gone}/{D.shape[1]} |")


def verdict(rn, D, k, floor_hi, steps):
    start, end = np.nanmean(D[0]), D[-1]
    gone = int(np.isnan(end).sum())
    tail = f"; {gone}/{len(end)} seeds collapsed to one point" if gone else ""
    clusters = f"clusters {int(np.median(k[0]))} → {int(np.median(k[-1]))} (median)"
    if not (~np.isnan(end)).any():
        return (f"{NAMES[rn]}: collapses to one point in every seed (a Dirac: a Gaussian only "
                f"with covariance 0); D {start:.3f} at t = 0; {clusters}")
    end = np.nanmean(end)
    what = ("approaches the noise floor" if end <= floor_hi
            else "not Gaussian" + (": it clusters" if np.median(k[-1]) < 20 else ""))
    return (f"{NAMES[rn]}: {what} — D goes from {start:.3f} (t = 0) to {end:.3f} (t = {steps}); "
            f"noise floor 95 % {floor_hi:.3f}; {clusters}{tail}")


def cross_verdict(rn, stats, rank_one, floor_hi, steps):
    parts = []
    for name, (D, _) in stats.items():
        inside = int((D[-1] <= floor_hi).sum())
        parts.append(f"from {name} D {np.nanmean(D[0]):.3f} → {np.nanmean(D[-1]):.3f} ({inside}/"
                     f"{D.shape[1]} seeds within the noise floor at t = {steps})")
    share = ", ".join(f"{k} {v:.3f}" for k, v in rank_one.items())
    return (f"cross-attention, h = N(μ, Σ), {NAMES[rn]}: " + "; ".join(parts)
            + f"; share of the variance in the top principal direction at t = {steps} (mean over "
            f"seeds): {share}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--points", type=int, default=200, help="points per cloud N")
    p.add_argument("--dim", type=int, default=4, help="dimension d of the dynamics")
    p.add_argument("--steps", type=int, default=128, help="iterations T")
    p.add_argument("--beta", type=float, default=1.0, help="β of the pictures")
    p.add_argument("--betas", type=float, nargs="*", default=[0.25, 4.0],
                   help="further β for the table (self-attention, blob start)")
    p.add_argument("--seeds", type=int, default=8, help="clouds per setting")
    p.add_argument("--directions", type=int, default=64, help="random directions P of D")
    p.add_argument("--floor-draws", type=int, default=200, help="Gaussian samples for the floor")
    p.add_argument("--cross-renorm", default="batchnorm", choices=[r for r in RENORMS if r])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "output", "expfamily"))
    p.add_argument("--quick", action="store_true", help="small and fast (test suite)")
    args = p.parse_args(argv)
    if args.quick:
        args.points, args.steps, args.seeds, args.betas = 60, 4, 2, []
        args.directions, args.floor_draws = 16, 20
    os.makedirs(args.out, exist_ok=True)
    start_time = time.perf_counter()
    g = torch.Generator().manual_seed(args.seed)
    S, N, d, P, T = args.seeds, args.points, args.dim, args.directions, args.steps

    # d = 2: LayerNorm leaves two points
    ln2 = renormalise(torch.randn(1000, 2, generator=g, dtype=F64), "layernorm")
    off = (ln2 - ln2[:, :1].sign() * torch.tensor([1.0, -1.0], dtype=F64)).abs().amax(-1) > 1e-3
    print(f"d = 2: LayerNorm maps {1000 - int(off.sum())} of 1000 random points to ±(1, −1) within "
          f"1e-3 (the others have |a − b| ≲ √ε, LayerNorm's ε = 1e-5)")

    floor = noise_floor(N, d, P, args.floor_draws, g)
    support = {rn: noise_floor(N, d, P, args.floor_draws, g, rn) for rn in ("layernorm", "sphere")}
    args.floor_mean = float(floor.mean())
    floor_hi = float(np.quantile(floor, 0.95))
    blobs, labels = blob_starts(S, N, d, g)
    gauss = torch.randn(S, N, d, generator=g, dtype=F64)
    dirs = random_directions(S, d, P, g)
    mu, sigma = random_gaussian_measures(S, d, g)

    paths, stats, gauss_stats, rows = {}, {}, {}, []
    for rn in RENORMS:
        paths[rn] = run(blobs, T, rn, args.beta)
        stats[rn] = statistics(paths[rn], dirs)
        gauss_stats[rn] = statistics(run(gauss, T, rn, args.beta), dirs)
        rows.append(table_row("self", rn, args.beta, "3 blobs", *stats[rn], T))
        rows.append(table_row("self", rn, args.beta, "Gaussian", *gauss_stats[rn], T))
    table_times = [0, middle(T), T]  # all the table needs
    for beta in args.betas:
        for rn in RENORMS:
            rows.append(table_row("self", rn, beta, "3 blobs",
                                  *statistics(run(blobs, T, rn, beta), dirs, table_times), T))
    h = Gaussian(mu, sigma)
    p_eq = torch.distributions.MultivariateNormal(torch.linalg.solve(sigma, mu),
                                                  torch.linalg.inv(sigma))
    torch.manual_seed(args.seed)
    cross_starts = {"3 blobs": blobs, "N(Σ⁻¹μ, Σ⁻¹)": p_eq.sample((N,)).transpose(0, 1)}
    cross_paths, cross_stats, rank_one = {}, {}, {}
    for rn in RENORMS:
        for name, x0 in cross_starts.items():
            path = run(x0, T, rn, args.beta, measure=h)
            drawn = rn == args.cross_renorm
            st = statistics(path, dirs, None if drawn else table_times)
            rows.append(table_row("cross N(μ, Σ)", rn, args.beta, name, *st, T))
            if drawn:
                cross_paths[name], cross_stats[name] = path, st
                xc = path[-1] - path[-1].mean(-2, keepdim=True)
                ev = torch.linalg.eigvalsh(xc.transpose(-1, -2) @ xc)  # (S, d)
                rank_one[name] = float((ev[:, -1] / ev.sum(-1)).mean())

    written = []
    for name, fn, plot_args in (
            ("expfamily_clouds.png", plot_clouds, (paths, stats, labels, args)),
            ("expfamily_gaussianity.png", plot_gaussianity, (stats, gauss_stats, floor, support, args)),
            ("expfamily_cross.png", plot_cross, (cross_paths, cross_stats, labels, floor, args))):
        written.append(os.path.join(args.out, name))
        fn(*plot_args, written[-1])

    print(f"\nN = {N}, d = {d}, T = {T}, {S} seeds, D over P = {P} directions; noise floor "
          f"(Gaussian sample, {args.floor_draws} draws): mean {floor.mean():.3f}, 95 % {floor_hi:.3f}; "
          f"support floor (uniform on the sphere): LayerNorm {support['layernorm'].mean():.3f}, "
          f"sphere {support['sphere'].mean():.3f}\n")
    print("| dynamics | RN | β | start | D at t = 0 | D at t = "
          f"{middle(T)} | D at t = {T} | clusters at t = {T} | one point |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print("\nD: mean over seeds (min–max) of the seeds not collapsed to one point; clusters: "
          "median (min–max).\n")
    print(f"verdicts (self-attention, 3-blob start, β = {args.beta:g}):")
    for rn in RENORMS:
        print("  " + verdict(rn, *stats[rn], floor_hi, T))
    print("  " + cross_verdict(args.cross_renorm, cross_stats, rank_one, floor_hi, T))
    print(f"({time.perf_counter() - start_time:.1f} s)\nwrote:\n  " + "\n  ".join(written))
    return written


if __name__ == "__main__":
    main()
