"""Self attention (paper §3.2, A.8.1): each token picks one token (causal: j ≤ i)."""

from __future__ import annotations

import torch

from structattn.priors import Uniform

from ._catalogue import TOKEN_SIZES, Entry, randn64
from ._projections import TokenAttention


class SelfAttention(TokenAttention):
    """φ_i ~ Uniform({j ≤ i} if causal else all); ψ(x_j, x_i) = x_iᵀW_QᵀW_K x_j / τ;
    v = W_V x_j; y_i = W_O [E v_i]_heads.

    x: ``(*batch, n, d_model)`` → ``(*batch, n, d_model or heads·d_v)``.
    ``support``: optional boolean ``(n, n)`` (or ``(*batch, heads, n, n)``) restriction
    of who may attend to whom. Cost O(n²·heads·(d_k + d_v)), memory O(n·d).

    ::

        x_1 → x_2 → x_3 → …   (causal: every x_j with j ≤ i may be φ_i)
    """

    def model(self, x, support=None):
        tokens = self.tokens(x)
        prior = Uniform(causal=self.causal, support=support)
        return self.attend(self.family_name, tokens, tokens, prior)


def self_attention(d_model, **kwargs) -> SelfAttention:
    """The self-attention declaration; see ``SelfAttention``."""
    return SelfAttention(d_model, **kwargs)


def _case():
    m = self_attention(7, d_k=3, d_v=5, heads=2, causal=True, dtype=torch.float64)
    return m, (randn64(2, 5, 7),)


#: the catalogue's statement (structattn/models/_catalogue.py)
ENTRY = Entry(self_attention, SelfAttention, case=_case,
              example=dict(d_model=8, heads=2, causal=True),
              sizes=TOKEN_SIZES)
