"""Multihop attention (paper §5.1): the value walks k steps along the edges."""

from __future__ import annotations

import torch

from structattn.priors import Uniform
from structattn.values import Hops

from ._catalogue import TOKEN_SIZES, Entry, randn64
from ._projections import TokenAttention


class MultihopAttention(TokenAttention):
    r"""$φ_i ∼ \mathrm{Uniform}$ (causal: $j ≤ i$); $ψ = x_iᵀW_QᵀW_K x_j / τ$;
    $v_i = \sum_k w_k W_V x_{φ^k(i)}$ ($φ^k$: $k$ steps along the edges)
    $⇒ y = W_O[\sum_k w_k P^k V X]_\text{heads}$.

    ``hop_weights``: (w_0, …, w_K), finite, not all zero (a weight may be negative: the
    value is a linear combination of hops); (0, 1, 1) is the paper's (P + P²)VX, (⅓, ⅓, ⅓)
    the authors' code. Compiled as K attention calls on the values (P^k is never formed).
    x: ``(*batch, n, d_model)`` → ``(*batch, n, d_model or heads·d_v)``.

    Args:
        d_model (int): the tokens' width, x's last dimension ``d_model``; a positive int.
        hop_weights (tuple[float, ...]): (w_0, …, w_K) with K ≥ 1, finite numbers, not all
            zero; w_k weighs the value k hops away. Default (0.0, 1.0, 1.0).
        heads (int): the number of heads, a positive int. Default 1.
        **kwargs (Any): TokenAttention's options (d_k, d_v, causal, out_proj, temperature,
            rope_base, rope_dims, device, dtype, name).
    """

    def __init__(self, d_model, *, hop_weights=(0.0, 1.0, 1.0), heads=1, **kwargs):
        super().__init__(d_model, heads=heads, **kwargs)
        Hops(self.W_v, hop_weights, heads=heads)  # validate the weights now
        self.hop_weights = tuple(float(w) for w in hop_weights)

    def model(self, x):
        tokens = self.tokens(x)
        value = Hops(self.W_v, self.hop_weights, heads=self.heads)
        return self.attend(self.family_name, tokens, tokens, Uniform(causal=self.causal),
                           value=value)


def multihop_attention(d_model, **kwargs) -> MultihopAttention:
    """Multihop self attention; see ``MultihopAttention``."""
    return MultihopAttention(d_model, **kwargs)


def _case():
    m = multihop_attention(7, d_k=3, heads=2, hop_weights=(1 / 3, 1 / 3, 1 / 3),
                           dtype=torch.float64)
    return m, (randn64(2, 4, 7),)


#: the catalogue's statement (structattn/models/_catalogue.py)
ENTRY = Entry(multihop_attention, MultihopAttention, case=_case,
              example=dict(d_model=8, heads=2, causal=True),
              sizes=TOKEN_SIZES)
