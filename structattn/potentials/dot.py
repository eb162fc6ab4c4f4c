"""Dot-product potential ψ(x_j, x_i) = ⟨x_i, x_j⟩ / τ (no projections)."""

from __future__ import annotations

import torch

from ..checking._validation import shape_str
from ..heads import gather_parents, merge_heads, split_heads
from .base import Potential
from .temperature import check_temperature, check_temperature_value, inverse, per_head, weighted


class DotProduct(Potential):
    """``ψ_h(x_j, x_i) = ⟨x_i^h, x_j^h⟩ / τ_h`` on the h-th of ``heads`` equal slices of the
    features, with no projections.

    E.g. a classification layer's ``f_θ(X)_iᵀ y_j`` (paper Table 1, one head) or a Hopfield
    retrieval ``β ξᵀ x_j`` (τ = 1/β, §4.2). Children and parents have the same width, a
    multiple of ``heads`` (checked when the family is declared). Linear in each side:
    closed-form expected gradient, zero curvature.

    Args:
        temperature (float | torch.Tensor): τ > 0: a finite float, a (learnable) scalar
            tensor, or one per head, a floating-point tensor ``(heads,)`` (a list of floats
            becomes one); a tensor's values are checked when the family is declared.
            Default 1.
        heads (int): the number of heads H, a positive int. Default 1.

    Raises:
        ValueError: ``heads`` not a positive int, or a ``temperature`` that is not a finite
            number > 0, a scalar tensor or one per head.
    """

    def __init__(self, *, temperature: float | torch.Tensor = 1.0, heads: int = 1):
        if not isinstance(heads, int) or isinstance(heads, bool) or heads < 1:
            raise ValueError(f"DotProduct potential: heads must be a positive int; got {heads!r}")
        self.temperature = check_temperature(temperature, "DotProduct potential", heads)
        self.heads = heads

    def child_factor(self, children):
        return split_heads(children, self.heads)

    def parent_factor(self, parents):
        return split_heads(parents, self.heads)

    def factor_scale(self):
        return inverse(self.temperature)

    def at(self, children, parents, index):
        """The Pyro reading, from the definition: ⟨x_i^h, x_{φ_i}^h⟩ / τ_h per head slice."""
        H = self.heads
        xc = children.reshape(*children.shape[:-1], H, -1).movedim(-2, -3)  # (*batch, H, C, d/H)
        xp = parents.reshape(*parents.shape[:-1], H, -1).movedim(-2, -3)
        psi = (xc * gather_parents(xp, index)).sum(-1)  # (…, H, C)
        return psi / per_head(self.temperature, psi, 1)

    def expected_gradient(self, side, op, weight=1.0):
        a, b, _ = op.factors(self)
        g = op.attend(b) if side == "children" else op.adjoint(a)
        return merge_heads(weighted(g, weight, self.temperature))

    def expected_gradient_offset(self, side, op):
        return self.expected_gradient(side, op)  # linear in each side: no own term

    def expected_curvature(self, side, op):
        return 0.0

    def validate(self, family, children, parents):
        check_temperature_value(self.temperature, family, self.heads)
        if children.features != parents.features:
            raise ValueError(
                f"edge family {family!r}: a DotProduct potential needs children and parents of "
                f"equal feature size; got {children.name!r} {shape_str(children.states.shape)} and "
                f"{parents.name!r} {shape_str(parents.states.shape)}"
            )
        if children.features % self.heads:
            raise ValueError(
                f"edge family {family!r}: a DotProduct potential with heads={self.heads} needs a "
                f"feature size divisible by {self.heads}; got {children.features}"
            )

    def describe(self) -> str:
        return "DotProduct" if self.heads == 1 else f"DotProduct(heads={self.heads})"
