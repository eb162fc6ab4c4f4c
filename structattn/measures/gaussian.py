"""The Gaussian measure h = N(μ, Σ) and a mixture of Gaussians with a shared covariance."""

from __future__ import annotations

import torch

from ..checking._validation import shape_str
from .base import Measure, check_covariance, check_tensor, weighted_covariance


class Gaussian(Measure):
    """h = N(μ, Σ): G(η) = μᵀη + ½ ηᵀΣη, ∇G = μ + Ση, ∇²G = Σ, p(x | η) = N(μ + Ση, Σ).

    Args:
        mean (torch.Tensor): μ, a finite floating-point tensor ``(*batch, d)``.
        covariance (torch.Tensor): Σ, ``(*batch, d, d)``, symmetric and positive definite.

    Raises:
        ValueError: a mean or covariance that is not a finite floating-point tensor, or a
            covariance not ``(…, d, d)``, not symmetric or not positive definite.
    """

    def __init__(self, mean: torch.Tensor, covariance: torch.Tensor):
        check_tensor("Gaussian", "mean", mean, 1)
        self.mu, self.dim = mean, mean.shape[-1]
        self.sigma = check_covariance("Gaussian", covariance, self.dim)

    def log_normaliser(self, eta):
        eta = self._check_eta(eta)
        mu = self.mu.unsqueeze(-2)
        return (mu * eta).sum(-1) + 0.5 * (eta * (eta @ self.sigma)).sum(-1)

    def mean(self, eta):
        eta = self._check_eta(eta)
        return self.mu.unsqueeze(-2) + eta @ self.sigma  # Σ symmetric

    def covariance(self, eta):
        eta = self._check_eta(eta)
        return self.sigma.unsqueeze(-3).expand(*eta.shape[:-1], self.dim, self.dim)

    def distribution(self, eta):
        from pyro.distributions import MultivariateNormal

        return MultivariateNormal(self.mean(eta), covariance_matrix=self.covariance(eta))


class GaussianMixture(Measure):
    """h = Σ_k π_k N(μ_k, Σ): a mixture of K Gaussians with a shared covariance.

    G(η) = log Σ_k π_k e^{μ_kᵀη} + ½ηᵀΣη; ∇G = Ση + Σ_k softmax_k(log π_k + μ_kᵀη) μ_k (an
    empirical measure on the means, i.e. attention, plus the Gaussian part);
    p(x | η) = Σ_k r_k N(μ_k + Ση, Σ) with r = that softmax (``responsibilities``).

    Args:
        log_weights (torch.Tensor): the unnormalised log π_k, finite, ``(*batch, K)``.
        means (torch.Tensor): μ_k, finite floating-point, ``(*batch, K, d)``.
        covariance (torch.Tensor): the shared Σ, ``(*batch, d, d)``, symmetric and positive
            definite.

    Raises:
        ValueError: arguments that are not finite floating-point tensors, log_weights not
            ``(*batch, K)``, or a covariance not ``(…, d, d)``, symmetric, positive definite.
    """

    def __init__(self, log_weights: torch.Tensor, means: torch.Tensor, covariance: torch.Tensor):
        check_tensor("GaussianMixture", "means", means, 2)
        check_tensor("GaussianMixture", "log_weights", log_weights, 1)
        if log_weights.shape != means.shape[:-1]:
            raise ValueError(f"GaussianMixture: log_weights must have shape "
                             f"{shape_str(means.shape[:-1])} (one per component); got "
                             f"{shape_str(log_weights.shape)}")
        self.log_pi = torch.log_softmax(log_weights, -1)
        self.means, self.dim = means, means.shape[-1]
        self.sigma = check_covariance("GaussianMixture", covariance, self.dim)

    def _logits(self, eta):  # log π_k + μ_kᵀη: (*batch, M, K)
        return eta @ self.means.transpose(-1, -2) + self.log_pi.unsqueeze(-2)

    def log_normaliser(self, eta):
        eta = self._check_eta(eta)
        return torch.logsumexp(self._logits(eta), -1) + 0.5 * (eta * (eta @ self.sigma)).sum(-1)

    def responsibilities(self, eta):
        """r_k = softmax_k(log π_k + μ_kᵀη): ``(*batch, M, K)``."""
        return torch.softmax(self._logits(self._check_eta(eta)), -1)

    def mean(self, eta):
        return eta @ self.sigma + self.responsibilities(eta) @ self.means

    def covariance(self, eta):
        return self.sigma.unsqueeze(-3) + weighted_covariance(self.responsibilities(eta),
                                                              self.means)

    def distribution(self, eta):
        import pyro.distributions as dist

        eta = self._check_eta(eta)
        logits = self._logits(eta)  # (*batch, M, K)
        locs = self.means.unsqueeze(-3) + (eta @ self.sigma).unsqueeze(-2)  # (*batch, M, K, d)
        cov = self.sigma.unsqueeze(-3).unsqueeze(-3).expand(*locs.shape, self.dim)
        comps = dist.MultivariateNormal(locs, covariance_matrix=cov)
        return dist.MixtureSameFamily(dist.Categorical(logits=logits), comps)
