"""Ground truth with SVI and MCMC
==============================

One model with a latent node set, its compiled posterior beside SVI and MCMC ground truth.

The model is the conjugate toy of ``tests/inference/helpers.py``: a latent point z ∈ ℝ² with
prior z ~ N(0, s²I) picks one of three observed points x_j (uniform prior, φ ~ Uniform), with
potential ψ = −‖z − x_j‖²/2τ (``SquaredDistance(temperature=τ)``); s = 1.5, τ = 0.7 and
x = (−2, 0.5), (1.5, 1), (0.3, −1.8), all float64. Summing φ out, the exact posterior is a
Gaussian mixture in closed form:

    p(z | x) = Σ_j w_j N(z; c x_j, v I),  w_j ∝ N(x_j; 0, (s² + τ) I),
    c = s²/(s² + τ),  v = s²τ/(s² + τ),  and p(φ = j | x) = w_j.

Against it: NUTS (``structattn.inference.mcmc``, 2 chains, edges drawn per draw), a
mean-field Normal fitted by SVI (``svi(guide="normal")``), SVI's MAP (``guide="map"``) and the
compiled layer run to its fixed point (``with structattn.iteration(steps=1000, tol=1e-12)``:
EM from the declared start z₀ = 0). The mixture has one local mode per component; the
fixed point and both MAP searches are the mode reached from z₀, near x_3 — a local one: the
mode near x_2 is a little higher (densities 0.1049 and 0.1061).

Shows (``gallery/output/ground_truth/``):

- ``ground_truth_density.png``: the exact density (filled, with its 50/90/99 % highest-density
  contours), the NUTS draws per chain, the SVI mean-field Normal (1σ and 2σ ellipses), SVI's
  MAP and the compiled fixed point (they coincide), exact vs NUTS posterior means; beside it
  the two 1-D marginals (exact, NUTS histogram, SVI Normal);
- ``ground_truth_edges.png``: p(φ = j | x) — exact w_j, NUTS edge frequencies (± 2 MCSE from
  ArviZ's ESS), the SVI Normal's E_q[p(φ | x, z)] — beside p(φ = j | x, ẑ) at the mode, from
  SVI's MAP and from the compiled layer (``return_posterior=True``): the compiled posterior is
  conditional on the state, not integrated over it, so it is sharper than the marginal;
- ``ground_truth_verdict_exact.png``: ``compare(..., method="exact").plot(path)`` (compiled vs
  Pyro's enumeration at the compiled state), and ``ground_truth_verdict_hopfield.png``: the
  same for a small Hopfield model (identity projections, d = 4, β = 3, 6 stored patterns of
  norm 2, 3 noisy queries, run to its fixed point), whose posterior is a matrix worth a
  picture (not in ``--quick``: Pyro's MAP search there takes seconds);
- ``ground_truth_summary.csv``: ``arviz.summary`` of the NUTS draws (means, MCSE, ESS, r̂; it
  summarises the edge index ``pick`` as a number — the edge picture has its frequencies).

Printed: the key numbers (posterior mean exact vs NUTS with MCSE, fixed point vs MAP gaps,
r̂, ESS, draws inside each highest-density region) and the PASS/FAIL reports of
``compare(..., method=…)`` for "exact", "svi" and "mcmc".
``--quick``: 20 warm-up + 20 NUTS draws per chain, 80 SVI steps of the Normal guide, no
``compare(method="mcmc")`` (its 200 warm-up steps alone take seconds) and no Hopfield
verdict (the test suite).
Run: ``python gallery/plot_ground_truth.py [--draws N] [--warmup W] [--svi-steps S]
[--verdict-draws V] [--no-hopfield] [--out DIR] [--quick]``
"""
# mkdocs_gallery_thumbnail_path = "../gallery/results/ground_truth_density.png"

from __future__ import annotations

import argparse
import math
import os
import time

import matplotlib

matplotlib.use("Agg")
import arviz as az  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from matplotlib.collections import PathCollection  # noqa: E402
from matplotlib.patches import Ellipse  # noqa: E402

import structattn as sa  # noqa: E402

F64 = torch.float64
POINTS = [[-2.0, 0.5], [1.5, 1.0], [0.3, -1.8]]  # tests/inference/helpers.py's conjugate toy
HPD = (0.5, 0.9, 0.99)  # highest-density regions drawn and counted


# -- the model and its closed-form posterior -----------------------------------------------------
def conjugate_toy(s: float, tau: float):
    """The declaration, the observed points x ``(1, J, 2)`` and the initial state z₀ ``(1, 1, 2)``."""
    def program(x, z0):
        obs = sa.nodes("x", x)
        z = sa.latent("z", z0, scale=s)
        phi = sa.edges("pick", z, obs, sa.priors.Uniform())
        sa.potential(phi, sa.potentials.SquaredDistance(temperature=tau))
        return sa.infer(z)

    return program, torch.tensor([POINTS], dtype=F64), torch.zeros(1, 1, 2, dtype=F64)


class Mixture:
    """The exact posterior p(z | x) = Σ_j w_j N(z; m_j, v I) of the conjugate toy."""

    def __init__(self, x: torch.Tensor, s: float, tau: float):
        self.v = s * s * tau / (s * s + tau)
        self.w = torch.softmax(-(x ** 2).sum(-1) / (2 * (s * s + tau)), -1)  # (J,)
        self.means = x * s * s / (s * s + tau)  # (J, 2)
        self.mean = self.w @ self.means
        centred = self.means - self.mean
        self.cov = self.v * torch.eye(2, dtype=F64) + (self.w[:, None] * centred).T @ centred

    def log_parts(self, z: torch.Tensor) -> torch.Tensor:
        """log w_j N(z; m_j, v I) for z ``(…, 2)`` → ``(…, J)``."""
        d2 = ((z[..., None, :] - self.means) ** 2).sum(-1)
        return self.w.log() - d2 / (2 * self.v) - math.log(2 * math.pi * self.v)

    def density(self, z: torch.Tensor) -> torch.Tensor:
        return self.log_parts(z).logsumexp(-1).exp()

    def marginal(self, t: torch.Tensor, k: int) -> torch.Tensor:
        """The 1-D marginal density of coordinate k at t ``(n,)``."""
        d2 = (t[:, None] - self.means[:, k]) ** 2
        return (self.w * torch.exp(-d2 / (2 * self.v))).sum(-1) / math.sqrt(2 * math.pi * self.v)

    def gradient(self, z: torch.Tensor) -> torch.Tensor:
        """∇ log p(z | x): zero at every local mode."""
        r = torch.softmax(self.log_parts(z), -1)
        return (r[..., None] * (self.means - z[..., None, :])).sum(-2) / self.v

    def local_modes(self, starts: torch.Tensor, steps: int = 2000) -> torch.Tensor:
        """The EM fixed points z ← Σ_j r_j(z) m_j from each start, duplicates dropped."""
        z = starts.clone()
        for _ in range(steps):
            z, old = torch.softmax(self.log_parts(z), -1) @ self.means, z
            if float((z - old).abs().max()) < 1e-13:
                break
        modes = []
        for m in z:
            if all(float((m - o).abs().max()) > 1e-6 for o in modes):
                modes.append(m)
        return torch.stack(modes)


def hpd_levels(dens: np.ndarray, cell: float, masses=HPD) -> list[float]:
    """Density thresholds whose super-level sets hold each mass (on a grid of cell area)."""
    flat = np.sort(dens.ravel())[::-1]
    cum = np.cumsum(flat) * cell
    return [float(flat[min(np.searchsorted(cum, m), flat.size - 1)]) for m in masses]


# -- ground truth --------------------------------------------------------------------------------
def fit_everything(args, program, x, z0):
    """The compiled fixed point and posterior, SVI MAP and Normal fits, NUTS draws."""
    out = {}
    layer = sa.compile(program)
    with torch.no_grad(), sa.iteration(steps=1000, tol=1e-12):
        _, trace = layer(x, z0, return_trace=True)
        fixed, post = layer(x, z0, return_posterior=True)
    out["fixed"], out["compiled_post"], out["trace"] = fixed[0, 0], post.reshape(-1), trace
    # svi(...) fits its guide in place of the initial-state tensor it is given (the guide's
    # location parameter shares its storage): hand each fit a copy of z₀
    t = time.perf_counter()
    out["map"] = sa.inference.svi(program, x, z0.clone(), guide="map", num_steps=3000, lr=0.2,
                                  tol=1e-10, window=20, progress=False, seed=args.seed)
    out["t_map"] = time.perf_counter() - t
    t = time.perf_counter()
    out["normal"] = sa.inference.svi(program, x, z0.clone(), guide="normal",
                                     num_steps=args.svi_steps, lr=args.svi_lr, tol=None,
                                     progress=False, seed=args.seed,
                                     marginal_samples=args.marginal_samples)
    out["t_normal"] = time.perf_counter() - t
    t = time.perf_counter()
    out["draws"] = sa.inference.mcmc(program, x, z0, num_samples=args.draws,
                                     warmup_steps=args.warmup, num_chains=2, progress=False,
                                     seed=args.seed)
    out["t_mcmc"] = time.perf_counter() - t
    return out


def normal_guide(fit):
    """The mean-field Normal's location and scale ``(2,)`` each. ``fit.params`` is Pyro's
    param-store state, which holds *unconstrained* values: map them through their
    constraints (the scale is softplus-positive)."""
    state = fit.params
    out = []
    for name in ("AutoNormal.locs.z", "AutoNormal.scales.z"):
        value = state["params"][name].detach()
        out.append(torch.distributions.transform_to(state["constraints"][name])(value).reshape(-1))
    return tuple(out)


def edge_frequencies(draws, J):
    """NUTS edge frequencies ``(J,)`` and their MCSE from ArviZ's ESS of each indicator."""
    idx = draws.edges["pick"].reshape(draws.edges["pick"].shape[:2])  # (chains, draws)
    freq, se = torch.zeros(J, dtype=F64), torch.zeros(J, dtype=F64)
    for j in range(J):
        ind = (idx == j).to(F64).numpy()
        freq[j] = float(ind.mean())
        ess = float(az.ess(ind)) if 0 < ind.mean() < 1 else ind.size
        se[j] = math.sqrt(freq[j] * (1 - freq[j]) / max(ess, 1.0))
    return freq, se


# -- pictures ------------------------------------------------------------------------------------
def plot_density(mix, res, x, z0, modes, summary, path, title, grid_points=321):
    draws = res["draws"].latents["z"].reshape(2, -1, 2).numpy()  # (chains, draws, 2)
    loc, scale = normal_guide(res["normal"])
    fixed, svi_map = res["fixed"].numpy(), res["map"].latents["z"].reshape(-1).numpy()
    lo, hi = -3.2, 3.2
    g = torch.linspace(lo, hi, grid_points, dtype=F64)
    Z = torch.stack(torch.meshgrid(g, g, indexing="xy"), -1)
    dens = mix.density(Z).numpy()
    levels = hpd_levels(dens, float(g[1] - g[0]) ** 2)

    fig = plt.figure(figsize=(11.5, 6.6))
    grid = fig.add_gridspec(2, 2, width_ratios=(1.6, 1), hspace=0.35, wspace=0.18)
    ax = fig.add_subplot(grid[:, 0])
    ax.imshow(dens, extent=(lo, hi, lo, hi), origin="lower", cmap="Greys", vmin=0,
              vmax=1.7 * dens.max(), interpolation="bilinear")
    cs = ax.contour(g, g, dens, levels=sorted(levels), colors="k", linewidths=0.8)
    ax.clabel(cs, fmt={lv: f"{m:.0%}" for lv, m in zip(levels, HPD, strict=True)}, fontsize=7)
    for c, pts in enumerate(draws):
        ax.scatter(pts[:, 0], pts[:, 1], s=4, alpha=0.4, color=f"C{c}", linewidths=0,
                   label=f"NUTS chain {c + 1} ({pts.shape[0]} draws)")
    for k, (n, style) in enumerate(((1, "-"), (2, "--"))):
        ax.add_patch(Ellipse(loc.numpy(), 2 * n * float(scale[0]), 2 * n * float(scale[1]),
                             fill=False, color="C2", lw=1.6, ls=style,
                             label="SVI mean-field Normal: 1σ, 2σ" if k == 0 else None))
    ax.plot(*loc.numpy(), "+", color="C2", ms=10, mew=2)
    xs = x[0].numpy()
    ax.scatter(xs[:, 0], xs[:, 1], marker="^", s=70, color="k", label="observed points $x_j$")
    for j, p in enumerate(xs):
        ax.annotate(f"$x_{j + 1}$", p, xytext=(6, 4), textcoords="offset points", fontsize=10)
    others = [m for m in modes.numpy() if np.abs(m - fixed).max() > 1e-4]
    if others:
        o = np.array(others)
        ax.scatter(o[:, 0], o[:, 1], marker="D", s=40, facecolors="none", edgecolors="0.2",
                   label="other local modes of p(z | x)")
    ax.plot(*mix.mean.numpy(), "*", color="gold", mec="k", ms=13, label="exact posterior mean")
    ax.plot(*z0.reshape(-1).numpy(), "s", mfc="none", mec="k", ms=6, zorder=5,
            label="declared start $z_0 = 0$")
    nuts = summary.loc[["z[0, 0, 0]", "z[0, 0, 1]"]]
    ax.errorbar(*nuts["mean"].to_numpy(), xerr=2 * nuts["mcse_mean"].iloc[0],
                yerr=2 * nuts["mcse_mean"].iloc[1], fmt="P", color="C0", mec="k", ms=9,
                capsize=3, label="NUTS mean ± 2 MCSE")
    ax.plot(*svi_map, "o", ms=17, mfc="none", mec="m", mew=2, label="SVI MAP (guide=\"map\")")
    ax.plot(*fixed, "x", ms=11, color="C3", mew=2.5, label="compiled fixed point (EM from z₀)")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_aspect("equal")
    zoom = ax.inset_axes([0.055, 0.69, 0.26, 0.26])  # the means, which sit on top of z₀
    c = mix.mean.numpy()
    half = 0.25 + float(np.abs(np.r_[nuts["mean"].to_numpy() - c, loc.numpy() - c]).max())
    zoom.errorbar(*nuts["mean"].to_numpy(), xerr=2 * nuts["mcse_mean"].iloc[0],
                  yerr=2 * nuts["mcse_mean"].iloc[1], fmt="P", color="C0", mec="k", ms=8,
                  capsize=3)
    zoom.plot(*c, "*", color="gold", mec="k", ms=13)
    zoom.plot(*loc.numpy(), "+", color="C2", ms=10, mew=2)
    zoom.plot(*z0.reshape(-1).numpy(), "s", mfc="none", mec="k", ms=6)
    zoom.set_xlim(c[0] - half, c[0] + half)
    zoom.set_ylim(c[1] - half, c[1] + half)
    zoom.set_aspect("equal")
    zoom.tick_params(labelsize=5.5, pad=1, length=2)
    zoom.text(0.5, 0.96, "zoom on the means", transform=zoom.transAxes, ha="center", va="top",
              fontsize=6.5)
    ax.indicate_inset_zoom(zoom, edgecolor="0.3")
    ax.set_xlabel("$z_1$")
    ax.set_ylabel("$z_2$")
    legend = ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.09), ncols=3,
                       markerscale=0.7, frameon=False)
    for handle in legend.legend_handles:  # scatter points big enough to see in the legend
        if isinstance(handle, PathCollection):
            handle.set_sizes([24])
            handle.set_alpha(1)
    ax.set_title("p(z | x): exact density (contours: 50/90/99 % highest-density regions)",
                 fontsize=9)

    t = torch.linspace(lo, hi, 400, dtype=F64)
    for k in range(2):
        m = fig.add_subplot(grid[k, 1])
        m.hist(draws[..., k].ravel(), bins=40, range=(lo, hi), density=True, color="C0",
               alpha=0.45, label="NUTS (both chains)")
        m.plot(t, mix.marginal(t, k), "k", lw=1.6, label="exact (mixture)")
        normal = torch.exp(-(t - loc[k]) ** 2 / (2 * scale[k] ** 2)) / (
            math.sqrt(2 * math.pi) * scale[k])
        m.plot(t, normal, "--", color="C2", lw=1.4, label="SVI mean-field Normal")
        m.axvline(fixed[k], color="C3", lw=1, label="compiled fixed point = MAP")
        m.axvline(float(mix.mean[k]), color="gold", lw=1.5, ls=":", label="exact mean")
        m.set_xlim(lo, hi)
        m.set_xlabel(f"$z_{k + 1}$", fontsize=8)
        m.set_ylabel("density", fontsize=8)
        m.tick_params(labelsize=7)
        m.set_title(f"marginal density of $z_{k + 1}$", fontsize=8)
        if k == 0:
            m.legend(fontsize=6.5, loc="upper left")
    fig.suptitle(title, fontsize=9)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def plot_edges(bars, path, title):
    """bars: label → (values ``(J,)``, errors or None, colour, hatch)."""
    J = len(next(iter(bars.values()))[0])
    fig, ax = plt.subplots(figsize=(9.5, 4.6))
    n = len(bars)
    width = 0.8 / (n + 0.5)
    for b, (label, (vals, err, colour, hatch)) in enumerate(bars.items()):
        gap = 0.5 * width if b >= 3 else 0.0  # marginal | conditional at ẑ
        pos = np.arange(J) - 0.4 + gap + (b + 0.5) * width
        ax.bar(pos, vals, width, yerr=None if err is None else 2 * err, capsize=3, color=colour,
               hatch=hatch, edgecolor="k", lw=0.6, label=label)
        top = vals if err is None else vals + 2 * err
        for p, v, t in zip(pos, vals, top, strict=True):
            ax.annotate(f"{v:.3f}", (p, t), xytext=(0, 3), textcoords="offset points",
                        ha="center", fontsize=6.5, rotation=90)
    ax.set_xticks(range(J), [f"φ = {j + 1}  (picks $x_{j + 1}$)" for j in range(J)])
    ax.set_ylabel("p(φ = j | …)")
    ax.set_ylim(0, 1.18)
    ax.legend(fontsize=7.5, loc="upper left", ncols=2)
    ax.set_title(title, fontsize=8.5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- a small Hopfield model for a verdict picture ----------------------------------------------
def hopfield_verdict(seed: int):
    g = torch.Generator().manual_seed(seed)
    stored = torch.randn(1, 6, 4, generator=g, dtype=F64)
    stored = 2 * stored / stored.norm(dim=-1, keepdim=True)  # ‖y_j‖ = 2: no pattern dominates
    queries = stored[:, :3] + 0.3 * torch.randn(1, 3, 4, generator=g, dtype=F64)
    m = sa.models.hopfield(4, projections=False, beta=3.0,
                           iteration=sa.IterationOptions(steps=1000, tol=1e-12), dtype=F64)
    return sa.inference.compare(m, queries, stored, method="exact")


# -- main ---------------------------------------------------------------------------------------
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--s", type=float, default=1.5, help="prior scale of z")
    p.add_argument("--tau", type=float, default=0.7, help="temperature τ of the potential")
    p.add_argument("--draws", type=int, default=1000, help="NUTS draws per chain")
    p.add_argument("--warmup", type=int, default=500, help="NUTS warmup steps per chain")
    p.add_argument("--svi-steps", type=int, default=2000, help="SVI steps of the Normal guide")
    p.add_argument("--svi-lr", type=float, default=0.02, help="Adam lr of the Normal guide")
    p.add_argument("--marginal-samples", type=int, default=200,
                   help="guide draws for the SVI Normal's edge marginals")
    p.add_argument("--verdict-draws", type=int, default=400,
                   help="NUTS draws of compare(method='mcmc') (0: skip it)")
    p.add_argument("--no-hopfield", action="store_true",
                   help="skip the Hopfield verdict (its Pyro MAP search takes seconds)")
    p.add_argument("--grid", type=int, default=321, help="density grid points per axis")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "output",
                                                 "ground_truth"))
    p.add_argument("--quick", action="store_true", help="few draws and steps (test suite)")
    args = p.parse_args(argv)
    if args.quick:
        args.draws, args.warmup, args.svi_steps, args.svi_lr = 20, 20, 80, 0.05
        args.marginal_samples, args.verdict_draws, args.grid = 8, 0, 161
        args.no_hopfield = True
    os.makedirs(args.out, exist_ok=True)
    start = time.perf_counter()
    torch.manual_seed(args.seed)
    program, x, z0 = conjugate_toy(args.s, args.tau)
    mix = Mixture(x[0], args.s, args.tau)
    J = x.shape[1]
    res = fit_everything(args, program, x, z0)
    t_fits = time.perf_counter() - start
    draws, fixed = res["draws"], res["fixed"]
    modes = mix.local_modes(torch.cat([mix.means, z0.reshape(1, 2)]))

    written = []
    summary = az.summary(draws.to_arviz(), round_to="none")
    path = os.path.join(args.out, "ground_truth_summary.csv")
    summary.to_csv(path)
    written.append(path)

    # -- key numbers
    zrows = summary.loc[["z[0, 0, 0]", "z[0, 0, 1]"]]
    nuts_mean = torch.tensor(zrows["mean"].to_numpy(), dtype=F64)
    mcse = torch.tensor(zrows["mcse_mean"].to_numpy(), dtype=F64)
    nuts_sd = torch.tensor(zrows["sd"].to_numpy(), dtype=F64)
    z_mean = (nuts_mean - mix.mean) / mcse
    svi_map = res["map"].latents["z"].reshape(-1)
    loc, scale = normal_guide(res["normal"])
    gap_map = float((svi_map - fixed).abs().max())
    grad = float(mix.gradient(fixed).abs().max())
    closest = float((modes - fixed).abs().max(-1).values.min())
    dens_at = [float(mix.density(m)) for m in modes]
    flat = draws.latents["z"].reshape(-1, 2)
    g = torch.linspace(-6, 6, 601, dtype=F64)
    Zg = torch.stack(torch.meshgrid(g, g, indexing="xy"), -1)
    levels = hpd_levels(mix.density(Zg).numpy(), float(g[1] - g[0]) ** 2)
    inside = [float((mix.density(flat) >= lv).to(F64).mean()) for lv in levels]
    freq, freq_se = edge_frequencies(draws, J)
    diverging = int(draws.stats["diverging"].sum())
    print(f"conjugate toy: s = {args.s}, τ = {args.tau}, J = {J} points; exact posterior: "
          f"{J}-component mixture, w = {np.round(mix.w.numpy(), 4)}, component sd "
          f"{math.sqrt(mix.v):.4f}")
    print(f"NUTS: 2 chains × ({args.warmup} warmup + {args.draws} draws), {res['t_mcmc']:.1f} s; "
          f"max r̂ {summary['r_hat'].max():.3f}, min ESS bulk {summary['ess_bulk'].min():.0f}, "
          f"tail {summary['ess_tail'].min():.0f}; {diverging} divergent")
    for k in range(2):
        print(f"  E[z_{k + 1}]: exact {float(mix.mean[k]):+.4f}, NUTS {float(nuts_mean[k]):+.4f} "
              f"± {float(mcse[k]):.4f} (MCSE), z = {float(z_mean[k]):+.2f};  sd: exact "
              f"{math.sqrt(float(mix.cov[k, k])):.4f}, NUTS {float(nuts_sd[k]):.4f}, SVI Normal "
              f"{float(scale[k]):.4f} (loc {float(loc[k]):+.4f})")
    print("  NUTS draws inside the exact highest-density regions: " + ", ".join(
        f"{m:.0%} region {f:.1%}" for m, f in zip(HPD, inside, strict=True)))
    print(f"compiled fixed point ẑ = {np.round(fixed.numpy(), 6)} after {res['trace'].steps} EM "
          f"steps (converged {res['trace'].converged}); SVI MAP {np.round(svi_map.numpy(), 6)} "
          f"({len(res['map'].losses)} steps, {res['t_map']:.1f} s): max gap {gap_map:.2e}")
    print(f"  closed form: |∇ log p(ẑ | x)| = {grad:.1e}; distance to the nearest exact local mode "
          f"{closest:.1e}; local modes {np.round(modes.numpy(), 4).tolist()} with densities "
          f"{np.round(dens_at, 4).tolist()}")
    print("edge posterior p(φ = j | x):")
    rows = {"exact w_j": mix.w, "NUTS edge frequencies": freq,
            "SVI Normal E_q[p(φ|x,z)]": res["normal"].marginals["pick"].reshape(-1),
            "SVI MAP p(φ|x,ẑ)": res["map"].marginals["pick"].reshape(-1),
            "compiled p(φ|x,ẑ)": res["compiled_post"]}
    for name, v in rows.items():
        print(f"  {name:<26} " + "  ".join(f"{float(a):.4f}" for a in v)
              + (f"   (MCSE {', '.join(f'{float(e):.4f}' for e in freq_se)})"
                 if name.startswith("NUTS") else ""))
    print(f"  max |NUTS − exact| = {float((freq - mix.w).abs().max()):.4f}; max |compiled − SVI MAP|"
          f" = {float((res['compiled_post'] - rows['SVI MAP p(φ|x,ẑ)']).abs().max()):.1e}")

    # -- pictures
    path = os.path.join(args.out, "ground_truth_density.png")
    plot_density(mix, res, x, z0, modes, summary, path,
                 f"z ~ N(0, {args.s}²I), φ ~ Uniform(x_1…x_{J}), ψ = −‖z − x_j‖²/2τ (τ = {args.tau}):"
                 f" the exact posterior is a {J}-component Gaussian mixture\n"
                 f"E[z]: exact ({float(mix.mean[0]):+.3f}, {float(mix.mean[1]):+.3f}), NUTS "
                 f"({float(nuts_mean[0]):+.3f} ± {float(mcse[0]):.3f}, {float(nuts_mean[1]):+.3f}"
                 f" ± {float(mcse[1]):.3f}), max r̂ {summary['r_hat'].max():.3f};  "
                 f"compiled fixed point − SVI MAP: {gap_map:.1e}", args.grid)
    written.append(path)
    path = os.path.join(args.out, "ground_truth_edges.png")
    plot_edges({"exact marginal w_j": (mix.w.numpy(), None, "0.35", None),
                "NUTS edge frequencies (± 2 MCSE)": (freq.numpy(), freq_se.numpy(), "C0", None),
                "SVI mean-field Normal: E_q[p(φ | x, z)]":
                    (rows["SVI Normal E_q[p(φ|x,z)]"].numpy(), None, "C2", None),
                "SVI MAP: p(φ | x, ẑ)": (rows["SVI MAP p(φ|x,ẑ)"].numpy(), None, "m", "//"),
                "compiled layer at its fixed point: p(φ | x, ẑ)":
                    (res["compiled_post"].numpy(), None, "C3", "\\\\")},
               path,
               "Which point does z pick? Solid: the marginal p(φ = j | x) = ∫ p(φ | x, z) "
               "p(z | x) dz (exact, NUTS, SVI Normal).\nHatched: the compiled layer's posterior "
               f"is conditional on the MAP state\nẑ = ({float(fixed[0]):.2f}, "
               f"{float(fixed[1]):.2f}), the mode near $x_{int(res['compiled_post'].argmax()) + 1}$:"
               " p(φ = j | x, z = ẑ) — not integrated over z, so sharper than the marginal")
    written.append(path)

    t_pictures = time.perf_counter()
    with sa.iteration(steps=1000, tol=1e-12):
        reports = {"exact": sa.inference.compare(program, x, z0, method="exact")}
        t = time.perf_counter()
        reports["svi"] = sa.inference.compare(program, x, z0.clone(), method="svi")  # as above
        t_svi = time.perf_counter() - t
        t = time.perf_counter()
        if args.verdict_draws:  # its NUTS warm-up is compare's: 200 steps, not settable
            reports["mcmc"] = sa.inference.compare(program, x, z0, method="mcmc",
                                                   num_samples=args.verdict_draws)
        t_mcmc = time.perf_counter() - t
    path = os.path.join(args.out, "ground_truth_verdict_exact.png")
    reports["exact"].plot(path)
    written.append(path)
    checked = dict(reports)
    for name, r in reports.items():
        extra = {"svi": f" ({t_svi:.1f} s)", "mcmc": f" ({t_mcmc:.1f} s)"}.get(name, "")
        print(f"\ncompare(method={name!r}){extra}:\n{r}")
    if not args.verdict_draws:
        print("\ncompare(method='mcmc'): skipped (--verdict-draws 0; --quick: its NUTS warm-up, "
              "200 steps, cannot be shortened through compare)")
    if not args.no_hopfield:
        checked["exact, Hopfield"] = hop = hopfield_verdict(args.seed)
        path = os.path.join(args.out, "ground_truth_verdict_hopfield.png")
        hop.plot(path)
        written.append(path)
        print(f"\nsmall Hopfield model (3 queries, 6 stored patterns, d = 4, β = 3), "
              f"compare(method='exact'):\n{hop}")
    for name, r in checked.items():
        assert r.passed, f"compare(method={name!r}) failed:\n{r}"
    print(f"({time.perf_counter() - start:.1f} s: fits {t_fits:.1f} s — SVI MAP {res['t_map']:.1f}, "
          f"SVI Normal {res['t_normal']:.1f}, NUTS {res['t_mcmc']:.1f}; compare and pictures "
          f"{time.perf_counter() - t_pictures:.1f} s)\nwrote:\n  " + "\n  ".join(written))
    return written


if __name__ == "__main__":
    main()
