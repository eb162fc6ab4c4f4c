"""Distance potential ψ(x_j, x_i) = −(k/p)‖x_i − x_j‖₂^p, p ∈ {1, 2}: the Euclidean norm of
the error (p = 1, the authors' predictive-coding code) or its square (p = 2, a Gaussian)."""

from __future__ import annotations

import torch

from ..checking._validation import shape_str
from ..heads import gather_parents
from .base import Potential
from .temperature import check_temperature, check_temperature_value


class Distance(Potential):
    """``ψ(x_j, x_i) = −(k/p)‖x_i − x_j‖₂^p`` with precision k > 0 and power p ∈ {1, 2}. One
    head.

    p = 1 is the Euclidean norm of the error (a cone, whose gradient has length k wherever
    x_i ≠ x_j; the authors' predictive-coding code), p = 2 its square, an isotropic Gaussian
    of variance 1/k. Dense (``pairwise``: O(children · parents · d)); for a latent side the
    expected gradient is −k Σ_j p_ij ‖e_ij‖^{p−2} e_ij (children) or k Σ_i p_ij ‖e_ij‖^{p−2}
    e_ij (parents), with e_ij = x_i − x_j and, for p = 1, the subgradient 0 where e_ij = 0.
    Children and parents have the same width d (checked when the family is declared).

    Args:
        precision (float | torch.Tensor): k, a finite float > 0 or a one-element
            floating-point tensor (learnable; its value checked > 0 when the family is
            declared). Default 1.
        power (int): p, 1 (default: the Euclidean norm) or 2 (its square).

    Raises:
        ValueError: ``power`` not 1 or 2, or a ``precision`` float that is not finite and > 0.
    """

    heads = 1

    def __init__(self, *, precision: float | torch.Tensor = 1.0, power: int = 1):
        if power not in (1, 2) or isinstance(power, bool):
            raise ValueError(f"Distance potential: power must be 1 (the Euclidean norm) or 2 (its "
                             f"square); got {power!r}")
        self.precision = check_temperature(precision, "Distance potential (precision)")
        self.power = power

    def _errors(self, children, parents):
        """e_ij = x_i − x_j: ``(*batch, C, P, d)``."""
        return children.unsqueeze(-2) - parents.unsqueeze(-3)

    def _psi(self, e):
        """−(k/p)‖e‖^p over the last dim. The coefficient is a tensor: a Python number's
        product, differentiated by ``torch.func.grad`` inside ``make_fx`` (a recorded plan),
        fails in PyTorch 2.13 ("Cannot access data pointer of Tensor that doesn't have
        storage")."""
        raw = (e * e).sum(-1) if self.power == 2 else torch.linalg.vector_norm(e, dim=-1)
        coefficient = -self.precision / self.power
        if not isinstance(coefficient, torch.Tensor):
            coefficient = torch.tensor(coefficient, dtype=raw.dtype, device=raw.device)
        return raw * coefficient.to(raw.dtype)

    def pairwise(self, children, parents):
        return self._psi(self._errors(children, parents)).unsqueeze(-3)

    def at(self, children, parents, index):
        """The Pyro reading at the chosen parents, from the states directly."""
        e = children.unsqueeze(-3) - gather_parents(parents.unsqueeze(-3), index)  # (…, C, d)
        return self._psi(e)

    def expected_gradient(self, side, op, weight=1.0):
        post = op.dense_posterior()[..., 0, :, :]  # (*batch, C, P)
        e = self._errors(op.family.children.states, op.family.parents.states)
        if self.power == 1:  # e/‖e‖, and 0 where e = 0
            norm = torch.linalg.vector_norm(e, dim=-1, keepdim=True)
            e = torch.where(norm > 0, e / norm.clamp_min(torch.finfo(e.dtype).tiny), 0.0)
        if side == "children":  # −k Σ_j p_ij u_ij
            g = -self.precision * (post.unsqueeze(-2) @ e).squeeze(-2)  # (*batch, C, d)
        else:  # k Σ_i p_ij u_ij
            g = self.precision * (post.unsqueeze(-1) * e).sum(-3)  # (*batch, P, d)
        return g if isinstance(weight, float) and weight == 1.0 else weight * g

    def validate(self, family, children, parents):
        check_temperature_value(self.precision, family)
        if children.features != parents.features:
            raise ValueError(
                f"edge family {family!r}: a Distance potential compares children and parents "
                f"of the same width; got children {children.name!r} "
                f"{shape_str(children.states.shape)} and parents {parents.name!r} "
                f"{shape_str(parents.states.shape)}")

    def describe(self) -> str:
        return "Distance(k, ‖·‖)" if self.power == 1 else "Distance(k, ½‖·‖²)"
