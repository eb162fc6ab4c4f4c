"""Shared by the inference tests: a chi-square check of draws against probabilities, and a
conjugate toy whose posterior is known in closed form."""

import torch
from scipy import stats

import structattn as sa

f64 = torch.float64


def chi_square_ok(counts: torch.Tensor, probs: torch.Tensor, alpha: float = 1e-3) -> bool:
    """Each row of ``counts`` (…, K) against ``probs`` (…, K), Bonferroni over the rows."""
    counts, probs = counts.reshape(-1, counts.shape[-1]), probs.reshape(-1, probs.shape[-1])
    level = alpha / counts.shape[0]
    for c, p in zip(counts, probs, strict=True):
        keep = p > 0
        assert c[~keep].sum() == 0  # never outside the support
        n = c.sum()
        if keep.sum() < 2:
            continue
        _, pval = stats.chisquare(c[keep].numpy(), (n * p[keep]).numpy())
        if pval < level:
            return False
    return True


def conjugate_toy(s=1.5, tau=0.7):
    """z ~ N(0, s²) (d = 2); φ ~ Uniform(observed x_j); ψ = −‖z − x_j‖²/2τ. The posterior is a
    Gaussian mixture: weights w_j ∝ N(x_j; 0, (s² + τ)I), means x_j s²/(s² + τ)."""
    def program(x, z0):
        obs = sa.nodes("x", x)
        z = sa.latent("z", z0, scale=s)
        phi = sa.edges("pick", z, obs, sa.priors.Uniform())
        sa.potential(phi, sa.potentials.SquaredDistance(temperature=tau))
        return sa.infer(z)

    x = torch.tensor([[[-2.0, 0.5], [1.5, 1.0], [0.3, -1.8]]], dtype=f64)
    w = torch.softmax(-(x[0] ** 2).sum(-1) / (2 * (s * s + tau)), -1)
    mean = (w[:, None] * x[0] * s * s / (s * s + tau)).sum(0)
    return program, x, torch.zeros(1, 1, 2, dtype=f64), w, mean
