"""Self attention with a learned relative-position prior (paper Table 1)."""

from __future__ import annotations

import torch
from torch import nn

from structattn.checks import check_size
from structattn.priors import RelativePosition

from ._catalogue import TOKEN_SIZES, Entry, randn64
from ._projections import TokenAttention


class RelativePositionAttention(TokenAttention):
    r"""$φ_i ∼ \mathrm{Categorical}(\mathrm{softmax}_j\, b_{\mathrm{clip}(i−j, −K, K)})$ per head ($b$
    learned, ``(heads, 2K+1)``); $ψ = x_iᵀW_QᵀW_K x_j / τ$; $v = W_V x_j$. The log prior is read from its
    table over the offsets per tile (the CPU's distance-table kernel), elsewhere an additive
    SDPA bias.

    x: ``(*batch, n, d_model)`` → ``(*batch, n, d_model or heads·d_v)``.

    Args:
        d_model (int): the tokens' features, a positive int.
        max_distance (int): K, an int ≥ 0: offsets i − j are clipped to [−K, K], one learned
            logit per head and clipped offset (``position_logits``, initially 0: uniform).
            Default 16.
        heads (int): attention heads, a positive int. Default 1.
        device (torch.device | str | None): where the parameters are made; None: PyTorch's
            default.
        dtype (torch.dtype | None): the parameters' dtype; None: PyTorch's default.
        **kwargs (Any): TokenAttention's options (d_k, d_v, causal, out_proj, temperature,
            rope_base, rope_dims, name).
    """

    def __init__(self, d_model, *, max_distance=16, heads=1, device=None, dtype=None, **kwargs):
        super().__init__(d_model, heads=heads, device=device, dtype=dtype, **kwargs)
        max_distance = check_size(type(self).__name__, "max_distance", max_distance, 0)
        self.max_distance = max_distance
        self.position_logits = nn.Parameter(torch.zeros(heads, 2 * max_distance + 1,
                                                        device=device, dtype=dtype))

    def model(self, x):
        tokens = self.tokens(x)
        prior = RelativePosition(self.position_logits, causal=self.causal)
        return self.attend(self.family_name, tokens, tokens, prior)


def relative_position_attention(d_model, **kwargs) -> RelativePositionAttention:
    """Relative-position self attention; see ``RelativePositionAttention``."""
    return RelativePositionAttention(d_model, **kwargs)


def _case():
    m = relative_position_attention(7, max_distance=2, d_k=3, heads=2, causal=True,
                                    dtype=torch.float64)
    with torch.no_grad():
        m.position_logits.normal_()
    return m, (randn64(2, 5, 7),)


#: the catalogue's statement (structattn/models/_catalogue.py)
ENTRY = Entry(relative_position_attention, RelativePositionAttention, case=_case,
              example=dict(d_model=8, max_distance=2, heads=2, causal=True),
              sizes={**TOKEN_SIZES, "max_distance": 0})
