"""Self attention with ALiBi's fixed-slope relative-position prior."""

from __future__ import annotations

import structattn as sa

from ._projections import ProjectedAttention


class ALiBiAttention(ProjectedAttention):
    """φ_i ~ Categorical(softmax_j −m_h |i − j|) per head h (slopes m_h = 2^(−8h/H), fixed);
    ψ = x_iᵀW_QᵀW_K x_j / τ; v = W_V x_j. Causal by default, as in Press et al. (2022).

    x: ``(*batch, n, d_model)`` → ``(*batch, n, d_model or heads·d_v)``.
    """

    def __init__(self, d_model, *, d_k=None, d_v=None, heads=1, causal=True, out_proj=True,
                 temperature=None, device=None, dtype=None):
        d_k = d_k or d_model // heads
        d_v = d_v or d_k
        super().__init__(d_model, d_model, d_k, d_v, heads, d_model if out_proj else None,
                         temperature, device, dtype)
        self.d_model, self.causal = d_model, causal
        self.register_buffer("slopes", sa.priors.relative.alibi_slopes(heads).to(
            device=device, dtype=dtype))

    def model(self, x):
        tokens = sa.nodes("x", x, features=self.d_model)
        prior = sa.priors.ALiBi(self.heads, slopes=self.slopes, causal=self.causal)
        return self.attend("attn", tokens, tokens, prior)

    def example_inputs(self, n=5, batch=1):
        return (self._randn(batch, n, self.d_model),)


def alibi_attention(d_model, **kwargs) -> ALiBiAttention:
    """ALiBi self attention; see :class:`ALiBiAttention`."""
    return ALiBiAttention(d_model, **kwargs)
