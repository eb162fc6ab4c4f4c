"""Dot-product potential ψ(x_j, x_i) = ⟨x_i, x_j⟩ / τ (no projections)."""

from __future__ import annotations

import torch

from .._validation import shape_str
from .base import Potential
from .bilinear import check_temperature, check_temperature_value


class DotProduct(Potential):
    """``ψ(x_j, x_i) = x_iᵀ x_j / τ`` — e.g. a classification layer's ``f_θ(X)_iᵀ y_j``
    (paper Table 1). One head; τ > 0 (float or tensor), default 1."""

    heads = 1

    def __init__(self, *, temperature: float | torch.Tensor = 1.0):
        self.temperature = check_temperature(temperature, "DotProduct potential")

    def factors(self, children, parents):
        return children.unsqueeze(-3), parents.unsqueeze(-3), 1.0 / self.temperature

    def validate(self, family, children, parents):
        check_temperature_value(self.temperature, family)
        if children.features != parents.features:
            raise ValueError(
                f"edge family {family!r}: a DotProduct potential needs children and parents of "
                f"equal feature size; got {children.name!r} {shape_str(children.states.shape)} and "
                f"{parents.name!r} {shape_str(parents.states.shape)}"
            )

    def describe(self) -> str:
        return "DotProduct"
