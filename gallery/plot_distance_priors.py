"""Distance priors side by side
============================

What each distance prior expects a token to read, and what it reads.

Five priors over which past token a query reads, each a catalogue model with the same
W_Q, W_K, W_V and the same input — random tokens, and 20 back from the last one the token it
matches best (a strong match):

- ALiBi (−m·d), FoX's forget gate (Π f_l, data-dependent), BAM's generalised Gaussian
  (−|(d − μ)e^s|^β), the geometric–Beta prior (B(a + d − 1, b + 1)/B(a, b)) and
  stick-breaking (σ(ψ_ij) Π σ(−ψ_il): an edge-choice process; with a constant break
  probability β it is the geometric with q = 1 − β).

Row 1: the prior over the distance d = i − j for the last token — read from each compiled
layer with W_Q = 0 (no potential, so the posterior is the prior), on a log scale;
stick-breaking has no prior apart from its scores, so its panel shows the geometric it
becomes at three constant β. Row 2: the posterior p(φ_i = i − d | x) of the same token from
each compiled layer, with the planted match marked and each prior's window: the distance
holding 95% of the posterior mass; the certified window at tol = 1e-2 (``tol``: the
posterior mass beyond it is proved ≤ 1e-2, ``structattn.certificates.certified``) — this token's own and
the band the layer read, for every model but stick-breaking; for the geometric–Beta prior
also the 80% credible interval of the context length 1/(1 − q)
(``sa.windows.credible_context``); for stick-breaking the leftover mass ("no parent").

Writes ``distance_priors.png`` to ``--out`` (default ``gallery/output/distance_priors``).
Run: ``python gallery/plot_distance_priors.py [--out DIR] [--quick]``
"""
# mkdocs_gallery_thumbnail_path = "../gallery/results/distance_priors.png"

from __future__ import annotations

import argparse
import copy
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

import structattn as sa  # noqa: E402

f64 = torch.float64


def build(d_model: int):
    """The five models with one set of projections (heads=1, float64)."""
    torch.manual_seed(0)
    models = {
        "ALiBi (m = 0.1)": sa.models.alibi_attention(d_model, tol=1e-2, block_size=8,
                                                     dtype=f64),
        "FoX forget gate": sa.models.forgetting_attention(d_model, gate_bias=2.0, tol=1e-2,
                                                          block_size=8, dtype=f64),
        "generalised Gaussian (μ=8, β=2)": sa.models.generalised_gaussian_attention(
            d_model, width=6.0, shape=2.0, tol=1e-2, block_size=8, dtype=f64),
        "geometric–Beta (a=4, b=1.5)": sa.models.expanding_attention(
            d_model, inference=None, a=4.0, b=1.5, tol=1e-2, dtype=f64),
        "stick-breaking": sa.models.stick_breaking_attention(d_model, dtype=f64),
    }
    first = next(iter(models.values()))
    with torch.no_grad():
        first.W_q.mul_(3.0)  # sharpen the potential: the planted match stands out
        for m in models.values():
            for name in ("W_q", "W_k", "W_v", "W_o"):
                getattr(m, name).copy_(getattr(first, name))
        models["ALiBi (m = 0.1)"].slopes.fill_(0.1)
        models["generalised Gaussian (μ=8, β=2)"].loc.fill_(8.0)
    return models


def sequence(n: int, d_model: int, back: int, m):
    """Random tokens; the token ``back`` before the last is the one the last matches best
    (along W_Kᵀ W_Q x_last, of the same norm as a random token)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, n, d_model, generator=g, dtype=f64)
    with torch.no_grad():
        best = m.W_k.T @ (m.W_q @ x[0, -1])
        x[0, -1 - back] = best / best.norm() * d_model ** 0.5 * 1.5
    return x


def last_row(post: torch.Tensor) -> torch.Tensor:
    """p(φ = i − d) for the last token i over d = 0..i, from a (1, 1, n, n) posterior."""
    row = post[0, 0, -1]
    return row.flip(0)  # index d: parent i − d


def mass_window(p: torch.Tensor, share: float = 0.95) -> int:
    """The smallest distance D with Σ_{d ≤ D} p_d ≥ share of the row's mass."""
    c = torch.cumsum(p, 0) / p.sum()
    return int((c < share).sum())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "output",
                                                      "distance_priors"))
    parser.add_argument("--quick", action="store_true", help="tiny sizes (for the test suite)")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    n, d_model, back = (32, 8, 12) if args.quick else (256, 8, 20)
    models = build(d_model)
    x = sequence(n, d_model, back, next(iter(models.values())))
    fig, axes = plt.subplots(2, len(models), figsize=(4.2 * len(models), 7), squeeze=False)
    d = torch.arange(n)
    for col, (name, m) in enumerate(models.items()):
        layer = sa.compile(m)
        with torch.no_grad():
            _, post, trace = layer(x, return_posterior=True, return_trace=True)
        # row 1: the prior (ψ ≡ 0: W_Q = 0), or stick-breaking's constant-β geometrics
        ax = axes[0, col]
        if "stick" in name:
            for beta in (0.05, 0.2, 0.5):
                dd = d[1:].to(f64)
                ax.semilogy(dd.numpy(), (beta * (1 - beta) ** (dd - 1)).numpy(), label=f"β = {beta}")
            ax.legend(fontsize=8)
            ax.set_title(f"{name}: constant β = geometric, q = 1 − β", fontsize=9)
        else:
            blank = copy.deepcopy(m)
            blank.tol = None  # the whole prior, not the window certified for the scores
            with torch.no_grad():
                blank.W_q.zero_()
                _, prior = sa.compile(blank)(x, return_posterior=True)
            p = last_row(prior)
            keep = p > 0
            ax.semilogy(d[keep].numpy(), p[keep].numpy(), color="C0")
            ax.set_title(f"{name}: prior over distance", fontsize=9)
        ax.set_ylim(1e-12, 2)
        ax.set_xlabel("distance d = i − j")
        ax.set_ylabel("p(φ_i = i − d)")
        # row 2: the posterior of the last token, its window(s)
        ax = axes[1, col]
        p = last_row(post)
        ax.bar(d.numpy(), p.numpy(), width=1.0, color="C0")
        ax.axvline(back, color="C3", ls=":", lw=1.5, label=f"planted match (d = {back})")
        w = mass_window(p)
        ax.axvspan(0, w, color="C2", alpha=0.12, label=f"95% of the mass: d ≤ {w}")
        if trace.truncation:  # every prior here but stick-breaking, which has its own tol
            cert = trace.truncation["attn"]
            own = int(cert.window[0, 0, -1])
            ax.axvline(own, color="C1", lw=1.2,
                       label=f"certified window (tol 1e-2): {own} (band read: {cert.width})")
        if "Beta" in name:
            ctx = sa.windows.credible_context(layer, x, level=0.8)
            lo, hi = float(ctx.length_low[0, 0, -1]), float(ctx.length_high[0, 0, -1])
            ax.axvspan(lo, min(hi, n), color="C4", alpha=0.18,
                       label=f"80% credible context 1/(1−q): {lo:.1f}–{hi:.1f}")
        if "stick" in name:
            left = float(trace.leftover["attn"][0, 0, -1])
            ax.plot([], [], " ", label=f"no parent (leftover): {left:.3f}")
        ax.set_title(f"{name}: posterior of the last token", fontsize=9)
        ax.set_xlabel("distance d = i − j")
        ax.set_ylabel("p(φ_i = i − d | x)")
        ax.set_xlim(-1, min(n, 120))
        ax.legend(fontsize=7, loc="upper right")
    fig.suptitle(f"Distance priors side by side: {n} random tokens, the last one's best match "
                 f"planted {back} back; same W_Q, W_K, W_V in every model", fontsize=11)
    fig.tight_layout()
    path = os.path.join(args.out, "distance_priors.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print("wrote", path)
    return [path]


if __name__ == "__main__":
    main()
