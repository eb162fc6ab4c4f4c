"""Gaussian potential ψ(x_j, x_i) = −‖x_i − x_j‖² / (2τ): the log-likelihood of an isotropic
Gaussian mixture component (soft k-means, EM)."""

from __future__ import annotations

import torch

from .._validation import shape_str
from ..heads import gather_parents
from .base import Potential
from .bilinear import check_temperature, check_temperature_value


class SquaredDistance(Potential):
    """``ψ(x_j, x_i) = −‖x_i − x_j‖² / (2τ)`` (one head; τ > 0, the component variance).

    Factorised for the fused kernels as ⟨a_i, b_j⟩/τ with a = [x_i, −½‖x_i‖², 1] and
    b = [x_j, 1, −½‖x_j‖²]. For a latent side the expected gradient is
    (Σ_j p_ij x_j − x_i)/τ (children) or (Σ_i p_ij x_i − m_j x_j)/τ with m_j = Σ_i p_ij
    (parents), and the curvature is 1/τ resp. m_j/τ: the CCCP/EM update is the
    posterior-weighted mean (a Gaussian mixture's M-step).
    """

    heads = 1

    def __init__(self, *, temperature: float | torch.Tensor = 1.0):
        self.temperature = check_temperature(temperature, "SquaredDistance potential")

    def child_factor(self, children):
        one = children.new_ones(*children.shape[:-1], 1)
        return torch.cat([children, -0.5 * (children * children).sum(-1, keepdim=True), one],
                         -1).unsqueeze(-3)  # (*batch, 1, C, d + 2)

    def parent_factor(self, parents):
        one = parents.new_ones(*parents.shape[:-1], 1)
        return torch.cat([parents, one, -0.5 * (parents * parents).sum(-1, keepdim=True)],
                         -1).unsqueeze(-3)  # (*batch, 1, P, d + 2)

    def factor_scale(self):
        return 1.0 / self.temperature

    def at(self, children, parents, index):
        """The Pyro reading: −‖x_i − x_{φ_i}‖²/(2τ), computed directly (not from the factors)."""
        diff = children.unsqueeze(-3) - gather_parents(parents.unsqueeze(-3), index)
        return -0.5 * (diff * diff).sum(-1) / self.temperature

    def expected_gradient(self, side, op):
        xc, xp = op.family.children.states, op.family.parents.states
        if side == "children":
            g = op.attend(xp.unsqueeze(-3)).squeeze(-3) - xc
        else:
            g = op.adjoint(xc.unsqueeze(-3)).squeeze(-3) - op.mass().squeeze(-3) * xp
        return g / self.temperature

    def expected_curvature(self, side, op):
        if side == "children":
            return 1.0 / self.temperature
        return op.mass().squeeze(-3) / self.temperature  # (*batch, P, 1)

    def validate(self, family, children, parents):
        check_temperature_value(self.temperature, family)
        if children.features != parents.features:
            raise ValueError(
                f"edge family {family!r}: a SquaredDistance potential needs children and parents "
                f"of equal feature size; got {children.name!r} {shape_str(children.states.shape)} "
                f"and {parents.name!r} {shape_str(parents.states.shape)}"
            )

    def describe(self) -> str:
        return "SquaredDistance"
