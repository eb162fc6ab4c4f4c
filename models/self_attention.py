"""Self attention (paper §3.2, A.8.1): each token picks one token (causal: j ≤ i)."""

from __future__ import annotations

import torch

from structattn.priors import Uniform

from ._catalogue import TOKEN_SIZES, Entry, randn64
from ._projections import TokenAttention


class SelfAttention(TokenAttention):
    r"""$φ_i ∼ \mathrm{Uniform}(\{j ≤ i\})$ if causal, else uniform over all parents;
    $ψ(x_j, x_i) = x_iᵀW_QᵀW_K x_j / τ$; $v = W_V x_j$; $y_i = W_O [\mathbb{E}\, v_i]_\text{heads}$.

    x: ``(*batch, n, d_model)`` → ``(*batch, n, d_model or heads·d_v)``.
    ``support``: optional boolean ``(n, n)`` (or ``(*batch, heads, n, n)``) restriction
    of who may attend to whom. Cost O(n²·heads·(d_k + d_v)), memory O(n·d).

    ::

        x_1 → x_2 → x_3 → …   (causal: every x_j with j ≤ i may be φ_i)

    Args:
        d_model (int): the tokens' features, a positive int.
        d_k (int | None): each head's query and key size, a positive int; None (default):
            d_model / heads (which must then divide d_model).
        d_v (int | None): each head's value size, a positive int; None (default): d_k.
        heads (int): attention heads, a positive int. Default 1.
        causal (bool): whether token i attends only to tokens j ≤ i. Default False.
        out_proj (bool): whether W_O maps the merged heads back to d_model (default True);
            False: the output is the heads' values, ``heads·d_v`` wide.
        temperature (float | torch.Tensor | str | None): τ, a finite number > 0, a tensor of
            one value or one per head ``(heads,)``, or ``"learned"`` (τ = exp(log τ), a
            parameter starting at √d_k); None (default): √d_k.
        rope_base (float | None): rotary positions on the potential with this base, a
            finite number > 1 (e.g. 10000.0); None (default): none.
        rope_dims (int | None): the rotated dimensions of each head, even and ≤ d_k; only
            with ``rope_base``; None (default): d_k.
        device (torch.device | str | None): where the parameters are made; None: PyTorch's
            default.
        dtype (torch.dtype | None): the parameters' dtype; None: PyTorch's default.
        name (str): the edge family's name, a non-empty string (distinct names let layers
            share a model). Default ``"attn"``.
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
