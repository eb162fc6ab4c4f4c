"""Self attention (paper §3.2, A.8.1): each token picks one token (causal: j ≤ i)."""

from __future__ import annotations

import structattn as sa

from ._projections import ProjectedAttention


class SelfAttention(ProjectedAttention):
    """φ_i ~ Uniform({j ≤ i} if causal else all); ψ(x_j, x_i) = x_iᵀW_QᵀW_K x_j / τ;
    v = W_V x_j; y_i = W_O [E v_i]_heads.

    x: ``(*batch, n, d_model)`` → ``(*batch, n, d_model or heads·d_v)``.
    ``support``: optional boolean ``(n, n)`` (or ``(*batch, heads, n, n)``) restriction
    of who may attend to whom. Cost O(n²·heads·(d_k + d_v)), memory O(n·d).

    ::

        x_1 → x_2 → x_3 → …   (causal: every x_j with j ≤ i may be φ_i)
    """

    def __init__(self, d_model, *, d_k=None, d_v=None, heads=1, causal=False, out_proj=True,
                 temperature=None, device=None, dtype=None):
        d_k = d_k or d_model // heads
        d_v = d_v or d_k
        super().__init__(d_model, d_model, d_k, d_v, heads, d_model if out_proj else None,
                         temperature, device, dtype)
        self.d_model, self.causal = d_model, causal

    def model(self, x, support=None):
        tokens = sa.nodes("x", x, features=self.d_model)
        prior = sa.priors.Uniform(causal=self.causal, support=support)
        return self.attend("attn", tokens, tokens, prior)

    def example_inputs(self, n=5, batch=1):
        return (self._randn(batch, n, self.d_model),)


def self_attention(d_model, **kwargs) -> SelfAttention:
    """The self-attention declaration; see :class:`SelfAttention`."""
    return SelfAttention(d_model, **kwargs)
