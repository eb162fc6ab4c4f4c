"""Uniform prior: p(φ_i = j) = 1/|Φ_i| on the support Φ_i."""

from __future__ import annotations

import torch

from .base import Prior


class Uniform(Prior):
    """``p(φ_i = j) = 1/|Φ_i|``, Φ_i = all parents, optionally ∩ {j ≤ i} (``causal``)
    and ∩ {j : support[…, i, j]} (a boolean mask ``(…, children, parents)``).

    Paper §3.2 (cross/self attention), Table 1 (graph/sparse attention).
    """

    def __init__(self, *, causal: bool = False, support: torch.Tensor | None = None):
        if support is not None:
            if not isinstance(support, torch.Tensor) or support.dtype != torch.bool:
                got = support.dtype if isinstance(support, torch.Tensor) else type(support).__name__
                raise ValueError(
                    f"Uniform prior: support must be a boolean tensor (…, children, parents); "
                    f"got {got}"
                )
        self.causal = bool(causal)
        self.support = support

    def support_mask(self, num_children, num_parents, device):
        return None if self.support is None else self.support.to(device)

    def describe(self) -> str:
        return f"Uniform({self.short_support()})"
