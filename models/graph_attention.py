"""Graph / sparse attention (paper Table 1): each node picks one of its neighbours."""

from __future__ import annotations

import torch

from structattn.priors import Uniform

from ._projections import TokenAttention


class GraphAttention(TokenAttention):
    """φ_i ~ Uniform(N(i)), N(i) = the parents of node i in ``adjacency``;
    ψ = x_iᵀW_QᵀW_K x_j / τ; v = W_V x_j.

    adjacency: a dense boolean ``(n, n)`` mask (``adjacency[i, j]``: i may attend to j;
    lowered to SDPA with a boolean mask) or an ``edge_index`` ``(2, E)`` int64 with row 0
    the parents j and row 1 the children i (PyG's source → target; lowered to an
    O(E)-memory segment softmax, so 10⁵ nodes and 10⁶ edges never build an n×n matrix).
    ``empty="zero"`` lets nodes without parents output zero instead of raising.
    x: ``(*batch, n, d_model)`` → ``(*batch, n, d_model or heads·d_v)``; with an edge list
    the posterior (``return_posterior=True``) is per edge, ``(*batch, heads, E)``.
    """

    def __init__(self, d_model, *, empty="error", **kwargs):
        super().__init__(d_model, **kwargs)
        if empty not in ("error", "zero"):
            raise ValueError(f"GraphAttention: empty must be 'error' or 'zero'; got {empty!r}")
        self.empty = empty

    def model(self, x, adjacency):
        tokens = self.tokens(x)
        if isinstance(adjacency, torch.Tensor) and adjacency.dtype == torch.bool:
            prior = Uniform(support=adjacency, causal=self.causal, empty=self.empty)
        elif isinstance(adjacency, torch.Tensor) and adjacency.dtype == torch.long:
            prior = Uniform(edge_index=adjacency, causal=self.causal, empty=self.empty)
        else:
            got = adjacency.dtype if isinstance(adjacency, torch.Tensor) else type(adjacency).__name__
            raise ValueError(
                f"GraphAttention: adjacency must be a boolean (n, n) mask or an int64 edge_index "
                f"(2, E); got {got}"
            )
        return self.attend(self.family_name, tokens, tokens, prior)

    def example_inputs(self, n=5, batch=1):
        ring = torch.arange(n)
        edge_index = torch.cat([torch.stack([ring, ring]), torch.stack([ring, (ring + 1) % n]),
                                torch.stack([(ring + 2) % n, ring])], dim=1)
        return (self._randn(batch, n, self.d_model), edge_index)


def graph_attention(d_model, **kwargs) -> GraphAttention:
    """Graph attention over a dense mask or an edge list; see :class:`GraphAttention`."""
    return GraphAttention(d_model, **kwargs)
