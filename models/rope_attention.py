"""Rotary self attention (RoPE; Su et al., RoFormer): the baseline the distance priors' papers
compare against — a uniform (causal) prior and the query and key rotated by their positions."""

from __future__ import annotations

import torch

from structattn.priors import Uniform

from ._catalogue import TOKEN_SIZES, Entry, randn64
from ._projections import TokenAttention


class RoPEAttention(TokenAttention):
    r"""$φ_i ∼ \mathrm{Uniform}(\{j ≤ i\})$ if causal, else uniform over all parents;
    $ψ(x_j, x_i) = (R_i W_Q x_i)ᵀ(R_j W_K x_j)/τ$ with $R_p$ the rotation by $p θ_k$,
    $θ_k = \mathrm{base}^{−2k/\mathrm{dims}}$ (``potentials.Rotary``), so $ψ$ depends on the positions
    through $j − i$ only; $v = W_V x_j$; $y_i = W_O [\mathbb{E}\, v_i]_\text{heads}$.

    x: ``(*batch, n, d_model)`` → ``(*batch, n, d_model or heads·d_v)``. ``rope_base``
    (default 10,000) and ``rope_dims`` (rotated dimensions per head, even; default d_k).
    Rotary positions go with any prior: ``forgetting_attention(d, rope_base=10000.0)`` is
    FoX with RoPE (FoX's "Pro" recipe), and likewise for ALiBi, stick-breaking and
    expanding attention. Cost as self attention's, plus the rotation of Q and K.

    Args:
        d_model (int): the tokens' features, a positive int.
        causal (bool): whether token i attends only to tokens j ≤ i. Default True.
        rope_base (float): the base of the frequencies θ_k = base^(−2k/dims), a finite
            number > 1. Default 10000.0.
        **kwargs (Any): TokenAttention's options (d_k, d_v, heads, out_proj, temperature,
            rope_dims, device, dtype, name).
    """

    def __init__(self, d_model, *, causal=True, rope_base=10000.0, **kwargs):
        super().__init__(d_model, causal=causal, rope_base=rope_base, **kwargs)

    def model(self, x):
        tokens = self.tokens(x)
        return self.attend(self.family_name, tokens, tokens, Uniform(causal=self.causal))


def rope_attention(d_model, **kwargs) -> RoPEAttention:
    """Rotary (RoPE) self attention; see ``RoPEAttention``."""
    return RoPEAttention(d_model, **kwargs)


def _case():
    m = rope_attention(8, d_k=4, heads=2, rope_base=100.0, dtype=torch.float64)
    return m, (randn64(2, 6, 8),)


def _partial():
    m = rope_attention(8, d_k=4, heads=2, rope_base=100.0, rope_dims=2, causal=False,
                       dtype=torch.float64)
    return m, (randn64(2, 6, 8),)


#: the catalogue's statement (structattn/models/_catalogue.py)
ENTRY = Entry(rope_attention, RoPEAttention, case=_case,
              example=dict(d_model=8, heads=2),
              variants={"partial": _partial},
              sizes=TOKEN_SIZES)
