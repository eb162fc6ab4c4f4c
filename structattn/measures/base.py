"""An intrinsic measure h and its exponential family p(x | η) ∝ h(x) e^{⟨x, η⟩}.

G(η) = log ∫ h(x) e^{⟨x, η⟩} dx is the log-normaliser (an energy); ∇G(η) = E_{p(x|η)}[x]
(the attention output) and ∇²G(η) = Cov_{p(x|η)}[x]. Every measure is batched over leading
dims ``(*batch)``; η is ``(*batch, M, d)`` (M natural parameters, e.g. queries) and G(η) is
``(*batch, M)``.
"""

from __future__ import annotations

import torch

from ..checking._validation import shape_str


class Measure:
    """An intrinsic measure h and its family p(x | η) ∝ h(x) e^{⟨x, η⟩}, G(η) its log-normaliser.

    The base class of ``Empirical``, ``Gaussian`` and ``GaussianMixture``: a subclass states
    ``log_normaliser`` G(η), ``mean`` ∇G(η), ``covariance`` ∇²G(η) and ``distribution``
    p(x | η), each taking η ``(*batch, M, d)``; each refuses (ValueError) an η of another
    shape or with non-finite values.

    Attributes:
        dim (int): d, the dimension of x and η.
    """

    dim: int

    def log_normaliser(self, eta: torch.Tensor) -> torch.Tensor:
        """G(η): ``(*batch, M)``."""
        raise NotImplementedError

    def mean(self, eta: torch.Tensor) -> torch.Tensor:
        """∇G(η) = E_{p(x|η)}[x]: ``(*batch, M, d)``."""
        raise NotImplementedError

    def covariance(self, eta: torch.Tensor) -> torch.Tensor:
        """∇²G(η) = Cov_{p(x|η)}[x]: ``(*batch, M, d, d)``."""
        raise NotImplementedError

    def distribution(self, eta: torch.Tensor):
        """The tilted p(x | η) as a Pyro/torch distribution (batch ``(*batch, M)``, event ``(d,)``)."""
        raise NotImplementedError

    def _check_eta(self, eta) -> torch.Tensor:
        name = type(self).__name__
        if not isinstance(eta, torch.Tensor) or eta.dim() < 2 or eta.shape[-1] != self.dim:
            got = shape_str(eta.shape) if isinstance(eta, torch.Tensor) else type(eta).__name__
            raise ValueError(f"{name}: eta must have shape (*batch, M, {self.dim}); got {got}")
        if not bool(torch.isfinite(eta).all()):
            raise ValueError(f"{name}: eta contains non-finite values")
        return eta


def check_tensor(where: str, what: str, t, min_dim: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() < min_dim:
        got = shape_str(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{where}: {what} must be a floating-point tensor with at least "
                         f"{min_dim} dims; got {got}")
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{where}: {what} contains non-finite values")
    return t


def check_covariance(where: str, cov: torch.Tensor, d: int) -> torch.Tensor:
    check_tensor(where, "covariance", cov, 2)
    if cov.shape[-2:] != (d, d):
        raise ValueError(f"{where}: covariance must have shape (…, {d}, {d}) to match the means' "
                         f"dimension {d}; got {shape_str(cov.shape)}")
    if not torch.allclose(cov, cov.transpose(-1, -2), atol=1e-8, rtol=1e-6):
        raise ValueError(f"{where}: covariance must be symmetric")
    _, info = torch.linalg.cholesky_ex(cov)
    if bool((info != 0).any()):
        raise ValueError(f"{where}: covariance must be positive definite (its Cholesky "
                         f"factorisation failed)")
    return cov


def weighted_covariance(w: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    """Covariance of ``points`` ``(*batch, K, d)`` under weights ``w`` ``(*batch, M, K)`` (rows
    sum to one): ``(*batch, M, d, d)``."""
    m = w @ points
    second = torch.einsum("...mk,...ki,...kj->...mij", w, points, points)
    return second - m.unsqueeze(-1) * m.unsqueeze(-2)
