"""Linear value v_i(x, φ_i = j) = W_V x_j, one per head."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..checking._validation import check_like, shape_str
from ..heads import split_heads
from .base import Value


class Linear(Value):
    """``v_i(x, φ_i = j) = W_V^h x_j`` per head h: a projection of the chosen parent's state.
    Paper §3.2.

    Args:
        W_v (torch.Tensor): the value projection, a matrix ``(heads*d_v, d_parent)``, head h's
            W_V^h its h-th block of d_v rows; the parents' width must be ``d_parent``
            (checked when the family is declared).
        heads (int): the number of heads H, a positive int dividing ``W_v``'s rows. Default 1.

    Raises:
        ValueError: ``W_v`` not a matrix whose rows are a multiple of ``heads``.
    """

    def __init__(self, W_v: torch.Tensor, *, heads: int = 1):
        if not isinstance(W_v, torch.Tensor) or W_v.dim() != 2 or W_v.shape[0] % heads:
            got = shape_str(W_v.shape) if isinstance(W_v, torch.Tensor) else type(W_v).__name__
            raise ValueError(
                f"Linear value: W_v must be a matrix (heads*d_v, features) with heads={heads}; "
                f"got {got}"
            )
        self.W_v, self.heads = W_v, heads
        self.d_v = W_v.shape[0] // heads

    def parent_values(self, parents):
        return split_heads(F.linear(parents, self.W_v), self.heads)  # (*batch, H, P, d_v)

    def validate(self, family, children, parents):
        x = parents.states
        if x.shape[-1] != self.W_v.shape[1]:
            raise ValueError(
                f"edge family {family!r}: parents node set {parents.name!r} must have shape "
                f"(*batch, n, {self.W_v.shape[1]}) to match value W_v {shape_str(self.W_v.shape)}; "
                f"got {shape_str(x.shape)}"
            )
        check_like(f"edge family {family!r}: parents node set {parents.name!r}", x, self.W_v,
                   "value W_v")

    def describe(self) -> str:
        return f"Linear(heads={self.heads}, d_v={self.d_v})"
