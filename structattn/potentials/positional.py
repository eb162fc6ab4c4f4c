"""A potential evaluated at position-shifted states: ψ(x_j + e_j, x_i + e_i)."""

from __future__ import annotations

import torch

from .._validation import shape_str
from .base import Potential


class Positional(Potential):
    """``ψ'(x_j, x_i) = ψ(x_j + e_j, x_i + e_i)``: absolute positional encodings enter the
    potential only (paper Table 1), the value still reads x_j.

    base: the potential to shift; e_children ``(…, C, d)`` and e_parents ``(…, P, d)``
    (default: e_children) — learned or sinusoidal (``sinusoidal(n, d)``).
    """

    def __init__(self, base: Potential, e_children: torch.Tensor,
                 e_parents: torch.Tensor | None = None):
        self.base, self.heads = base, base.heads
        self.e_children = e_children
        self.e_parents = e_children if e_parents is None else e_parents

    @property
    def is_factorised(self) -> bool:
        return self.base.is_factorised

    def factors(self, children, parents):
        return self.base.factors(children + self.e_children, parents + self.e_parents)

    def pairwise(self, children, parents):
        return self.base.pairwise(children + self.e_children, parents + self.e_parents)

    def at(self, children, parents, index):
        return self.base.at(children + self.e_children, parents + self.e_parents, index)

    def validate(self, family, children, parents):
        for role, ns, e in (("children", children, self.e_children),
                            ("parents", parents, self.e_parents)):
            try:
                torch.broadcast_shapes(e.shape, ns.states.shape)
                ok = e.shape[-2:] == ns.states.shape[-2:]
            except RuntimeError:
                ok = False
            if not ok:
                raise ValueError(
                    f"edge family {family!r}: positional encodings for {role} {ns.name!r} must "
                    f"have shape (…, {ns.size}, {ns.features}); got {shape_str(e.shape)}"
                )
        self.base.validate(family, children, parents)

    def describe(self) -> str:
        return f"Positional({self.base.describe()})"


def sinusoidal(n: int, d: int, *, device=None, dtype=torch.float32, base: float = 10000.0):
    """Vaswani et al.'s fixed encodings: e[p, 2k] = sin(p/base^(2k/d)), e[p, 2k+1] = cos(·)."""
    pos = torch.arange(n, device=device, dtype=torch.float64)[:, None]
    freq = base ** (-torch.arange(0, d, 2, device=device, dtype=torch.float64) / d)
    e = torch.zeros(n, d, device=device, dtype=torch.float64)
    e[:, 0::2] = torch.sin(pos * freq)
    e[:, 1::2] = torch.cos(pos * freq[: d // 2])
    return e.to(dtype)
