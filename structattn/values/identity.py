"""Identity value v_i(x, φ_i = j) = x_j."""

from __future__ import annotations

from .base import Value


class Identity(Value):
    """``v_i(x, φ_i = j) = x_j`` (one head) — e.g. a classification layer predicts the class
    embedding y_j (paper Table 1); E[v_i] = Σ_j p(φ_i = j | x) y_j."""

    heads = 1

    def parent_values(self, parents):
        return parents.unsqueeze(-3)  # (*batch, 1, P, d)
