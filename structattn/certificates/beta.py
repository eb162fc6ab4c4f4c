"""The Beta distribution's pieces expanding attention needs: log B(x, y), the predictive
tail of the beta-geometric P(φ > W) = B(α + W, β)/B(α, β), its quantile, and E[ln q],
E[ln(1 − q)] under Beta(α, β)."""

from __future__ import annotations

import torch


def log_beta(x, y):
    """log B(x, y) = lgamma(x) + lgamma(y) − lgamma(x + y)."""
    return torch.lgamma(x) + torch.lgamma(y) - torch.lgamma(x + y)


def beta_quantile(alpha: torch.Tensor, beta: torch.Tensor, tol: float, cap: int) -> torch.Tensor:
    """Smallest integer W in [1, cap] with P(φ > W) = B(α + W, β)/B(α, β) < tol, elementwise
    (``cap`` where even cap is not enough). Bisection: O(log cap) vectorised steps, no grad."""
    alpha, beta = torch.broadcast_tensors(alpha.detach(), beta.detach())
    log_tol = torch.log(torch.tensor(tol, dtype=alpha.dtype, device=alpha.device))
    base = log_beta(alpha, beta)
    lo = torch.zeros_like(alpha, dtype=torch.long)  # invariant: tail(lo) ≥ tol (tail(0) = 1)
    hi = torch.full_like(lo, cap)  # tail(hi) < tol, or hi = cap
    for _ in range(int(cap).bit_length() + 1):
        mid = (lo + hi) // 2
        below = (log_beta(alpha + mid.to(alpha.dtype), beta) - base) < log_tol
        hi, lo = torch.where(below, mid, hi), torch.where(below, lo, mid)
    return hi.clamp(min=1)


def plug_in_quantile(alpha, beta, tol: float, cap: int) -> torch.Tensor:
    """Smallest W in [1, cap] with q̄^W < tol, q̄ = α/(α + β) (the plug-in geometric)."""
    log_q = torch.log(alpha.detach() / (alpha.detach() + beta.detach()))
    w = torch.floor(torch.log(torch.tensor(tol, dtype=log_q.dtype)) / log_q) + 1
    return w.clamp(1, cap).to(torch.long)


def log_q_expectations(alpha, beta, kind):
    """``(E[ln q], E[ln(1 − q)])`` under Beta(α, β): digamma, or ln E[q] plugged in."""
    if kind == "digamma":
        total = torch.digamma(alpha + beta)
        return torch.digamma(alpha) - total, torch.digamma(beta) - total
    total = torch.log(alpha + beta)
    return torch.log(alpha) - total, torch.log(beta) - total
