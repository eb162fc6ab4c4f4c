"""Gaussian potential ψ(x_j, x_i) = −‖x_i − x_j‖² / (2τ): the log-likelihood of an isotropic
Gaussian mixture component (soft k-means, EM)."""

from __future__ import annotations

import torch

from ..checking._validation import shape_str
from ..heads import gather_parents, merge_heads, split_heads
from .base import Potential
from .temperature import (
    check_temperature,
    check_temperature_value,
    inverse,
    per_feature,
    per_head,
    weighted,
)


class SquaredDistance(Potential):
    """``ψ_h(x_j, x_i) = −‖x_i^h − x_j^h‖² / (2τ_h)`` on the h-th of ``heads`` equal slices of
    the features (one head: the whole vector): an isotropic Gaussian mixture component.

    Factorised for the fused kernels as ⟨a_i, b_j⟩/τ with a = [x_i, −½‖x_i‖², 1] and
    b = [x_j, 1, −½‖x_j‖²] per head. For a latent side the expected gradient is
    (Σ_j p_ij x_j − x_i)/τ (children) or (Σ_i p_ij x_i − m_j x_j)/τ with m_j = Σ_i p_ij
    (parents), and the curvature is 1/τ resp. m_j/τ: the CCCP/EM update is the
    posterior-weighted mean (a Gaussian mixture's M-step). Children and parents have the
    same width, a multiple of ``heads`` (checked when the family is declared).

    Args:
        temperature (float | torch.Tensor): τ > 0, the component variance: a finite float, a
            (learnable) scalar tensor, or one per head, a floating-point tensor ``(heads,)``
            (a list of floats becomes one); a tensor's values are checked when the family is
            declared. Default 1.
        heads (int): the number of heads H, a positive int. Default 1.

    Raises:
        ValueError: ``heads`` not a positive int, or a ``temperature`` that is not a finite
            number > 0, a scalar tensor or one per head.
    """

    def __init__(self, *, temperature: float | torch.Tensor = 1.0, heads: int = 1):
        if not isinstance(heads, int) or isinstance(heads, bool) or heads < 1:
            raise ValueError(f"SquaredDistance potential: heads must be a positive int; got "
                             f"{heads!r}")
        self.temperature = check_temperature(temperature, "SquaredDistance potential", heads)
        self.heads = heads

    def child_factor(self, children):
        x = split_heads(children, self.heads)  # (*batch, H, C, d)
        return torch.cat([x, -0.5 * (x * x).sum(-1, keepdim=True), torch.ones_like(x[..., :1])],
                         -1)  # (*batch, H, C, d + 2)

    def parent_factor(self, parents):
        x = split_heads(parents, self.heads)  # (*batch, H, P, d)
        return torch.cat([x, torch.ones_like(x[..., :1]), -0.5 * (x * x).sum(-1, keepdim=True)],
                         -1)  # (*batch, H, P, d + 2)

    def factor_scale(self):
        return inverse(self.temperature)

    def at(self, children, parents, index):
        """The Pyro reading: −‖x_i − x_{φ_i}‖²/(2τ_h) per head, computed directly (not from the
        factors)."""
        xc, xp = split_heads(children, self.heads), split_heads(parents, self.heads)
        diff = xc - gather_parents(xp, index)
        psi = -0.5 * (diff * diff).sum(-1)  # (…, H, C)
        return psi / per_head(self.temperature, psi, 1)

    def expected_gradient(self, side, op, weight=1.0):
        xc = split_heads(op.family.children.states, self.heads)
        xp = split_heads(op.family.parents.states, self.heads)
        if side == "children":
            g = op.attend(xp) - xc
        else:
            g = op.adjoint(xc) - op.mass() * xp
        return merge_heads(weighted(g, weight, self.temperature))

    def expected_gradient_offset(self, side, op):
        """Σ_j p_ij x_j/τ (children) or Σ_i p_ij x_i/τ (parents): the expected gradient less
        its −c·x term (c = 1/τ resp. m_j/τ) — the M-step's weighted sum."""
        if side == "children":
            g = op.attend(split_heads(op.family.parents.states, self.heads))
        else:
            g = op.adjoint(split_heads(op.family.children.states, self.heads))
        return merge_heads(weighted(g, 1.0, self.temperature))

    def expected_curvature(self, side, op):
        if side == "children":  # each head's posterior row sums to one: 1/τ_h per feature
            xc = op.family.children.states
            return 1.0 / per_feature(self.temperature, self.heads, xc.shape[-1], xc)
        xp = op.family.parents.states
        m = op.mass().expand(*op.mass().shape[:-1], xp.shape[-1] // self.heads)
        return merge_heads(m / per_head(self.temperature, m, 2))  # (*batch, P, features)

    def validate(self, family, children, parents):
        check_temperature_value(self.temperature, family, self.heads)
        if children.features != parents.features:
            raise ValueError(
                f"edge family {family!r}: a SquaredDistance potential needs children and parents "
                f"of equal feature size; got {children.name!r} {shape_str(children.states.shape)} "
                f"and {parents.name!r} {shape_str(parents.states.shape)}"
            )
        if children.features % self.heads:
            raise ValueError(
                f"edge family {family!r}: a SquaredDistance potential with heads={self.heads} "
                f"needs a feature size divisible by {self.heads}; got {children.features}"
            )

    def describe(self) -> str:
        return "SquaredDistance" if self.heads == 1 else f"SquaredDistance(heads={self.heads})"
