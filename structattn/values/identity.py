"""Identity value v_i(x, φ_i = j) = x_j."""

from __future__ import annotations

from ..heads import split_heads
from .base import Value


class Identity(Value):
    """``v_i(x, φ_i = j) = x_j``: the chosen parent's own state.

    E.g. a classification layer predicts the class embedding y_j (paper Table 1), a
    Hopfield network retrieves the stored pattern; E[v_i] = Σ_j p(φ_i = j | x) x_j.

    Args:
        heads (int): the number of heads H, a positive int: the h-th of H equal slices of the
            features is head h's value. Default 1.

    Raises:
        ValueError: ``heads`` not a positive int.
    """

    def __init__(self, *, heads: int = 1):
        if not isinstance(heads, int) or isinstance(heads, bool) or heads < 1:
            raise ValueError(f"Identity value: heads must be a positive int; got {heads!r}")
        self.heads = heads

    def parent_values(self, parents):
        return split_heads(parents, self.heads)  # (*batch, H, P, d / H)
