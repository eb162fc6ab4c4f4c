"""Identity value v_i(x, φ_i = j) = x_j."""

from __future__ import annotations

from ..heads import split_heads
from .base import Value


class Identity(Value):
    """``v_i(x, φ_i = j) = x_j`` — e.g. a classification layer predicts the class embedding y_j
    (paper Table 1), a Hopfield network retrieves the stored pattern; E[v_i] = Σ_j p(φ_i = j | x)
    x_j. With ``heads`` the h-th slice of the features is head h's value."""

    def __init__(self, *, heads: int = 1):
        if not isinstance(heads, int) or isinstance(heads, bool) or heads < 1:
            raise ValueError(f"Identity value: heads must be a positive int; got {heads!r}")
        self.heads = heads

    def parent_values(self, parents):
        return split_heads(parents, self.heads)  # (*batch, H, P, d / H)
