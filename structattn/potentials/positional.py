"""A potential evaluated at position-shifted states: ψ(x_j + e_j, x_i + e_i)."""

from __future__ import annotations

import torch

from ..checking._validation import shape_str
from .base import Potential


class Positional(Potential):
    """``ψ'(x_j, x_i) = ψ(x_j + e_j, x_i + e_i)``: absolute positional encodings enter the
    potential only (paper Table 1); the value still reads x_j.

    It has the base potential's heads. The encodings are checked when the family is
    declared: each broadcasts against its node set's states and ends with its ``(n, d)``.

    Args:
        base (Potential): ψ, the potential evaluated at the shifted states.
        e_children (torch.Tensor): the children's encodings e_i ``(…, C, d)``, learned or
            fixed (``sinusoidal(C, d)``).
        e_parents (torch.Tensor | None): the parents' encodings e_j ``(…, P, d)``. None
            (default): ``e_children`` (self-attention).
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


def sinusoidal(n: int, d: int, *, device=None, dtype=torch.float32,
               base: float = 10000.0) -> torch.Tensor:
    """Vaswani et al.'s fixed encodings: e[p, 2k] = sin(p/base^(2k/d)), e[p, 2k+1] = cos(·).

    Computed in float64, then cast to ``dtype``; for ``Positional``'s encodings.

    Args:
        n (int): the number of positions p = 0..n−1.
        d (int): the encoding width (an odd d ends with a sine column).
        device (torch.device | str | None): where to build the table. None (default):
            PyTorch's default device.
        dtype (torch.dtype): the returned dtype. Default float32.
        base (float): the base of the wavelengths base^(2k/d). Default 10000.

    Returns:
        The encodings, a tensor ``(n, d)``.

    Example:
        >>> import structattn as sa
        >>> e = sa.potentials.sinusoidal(3, 4)
        >>> e.shape, e[0].tolist()
        (torch.Size([3, 4]), [0.0, 1.0, 0.0, 1.0])
    """
    pos = torch.arange(n, device=device, dtype=torch.float64)[:, None]
    freq = base ** (-torch.arange(0, d, 2, device=device, dtype=torch.float64) / d)
    e = torch.zeros(n, d, device=device, dtype=torch.float64)
    e[:, 0::2] = torch.sin(pos * freq)
    e[:, 1::2] = torch.cos(pos * freq[: d // 2])
    return e.to(dtype)
