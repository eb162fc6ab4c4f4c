"""The empirical measure h = Σ_n w_n δ_{x_n}: its exponential family is softmax attention."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .base import Measure, check_tensor, weighted_covariance


class Empirical(Measure):
    """h(x) = Σ_n w_n δ(x − x_n): the empirical measure of N points, w = softmax(log_weights).

    G(η) = log Σ_n w_n e^{⟨x_n, η⟩}; ∇G(η) = Σ_n softmax_n(log w_n + ⟨x_n, η⟩) x_n — softmax
    attention with queries η and keys = values = the points (one SDPA call); ∇²G = the
    covariance of the points under those weights. p(x | η) is a categorical over the points.

    Args:
        points (torch.Tensor): x_n, a finite floating-point tensor ``(*batch, N, d)``.
        log_weights (torch.Tensor | None): the unnormalised log w_n, finite, ``(*batch, N)``;
            None, the default: uniform, 1/N.

    Raises:
        ValueError: points not a finite floating-point tensor of at least 2 dims, or
            log_weights not a finite floating-point tensor of shape ``(*batch, N)``.
    """

    def __init__(self, points: torch.Tensor, log_weights: torch.Tensor | None = None):
        check_tensor("Empirical", "points", points, 2)
        if log_weights is not None:
            check_tensor("Empirical", "log_weights", log_weights, 1)
            if log_weights.shape != points.shape[:-1]:
                raise ValueError(f"Empirical: log_weights must have shape {tuple(points.shape[:-1])} "
                                 f"(one per point); got {tuple(log_weights.shape)}")
            log_weights = torch.log_softmax(log_weights, -1)
        self.points, self.log_weights, self.dim = points, log_weights, points.shape[-1]

    def _logits(self, eta):  # log w_n + ⟨x_n, η_m⟩: (*batch, M, N)
        s = eta @ self.points.transpose(-1, -2)
        if self.log_weights is None:
            return s - math.log(self.points.shape[-2])
        return s + self.log_weights.unsqueeze(-2)

    def log_normaliser(self, eta):
        return torch.logsumexp(self._logits(self._check_eta(eta)), -1)

    def mean(self, eta):
        eta = self._check_eta(eta)
        bias = None if self.log_weights is None else self.log_weights.unsqueeze(-2)
        x = self.points
        return F.scaled_dot_product_attention(eta.unsqueeze(-3), x.unsqueeze(-3), x.unsqueeze(-3),
                                              attn_mask=None if bias is None else bias.unsqueeze(-3),
                                              scale=1.0).squeeze(-3)

    def covariance(self, eta):
        p = torch.softmax(self._logits(self._check_eta(eta)), -1)  # (*batch, M, N)
        return weighted_covariance(p, self.points)

    def distribution(self, eta):
        import pyro.distributions as dist

        logits = self._logits(self._check_eta(eta))  # (*batch, M, N)
        comps = dist.Delta(self.points.unsqueeze(-3).expand(*logits.shape, self.dim), event_dim=1)
        return dist.MixtureSameFamily(dist.Categorical(logits=logits), comps)
