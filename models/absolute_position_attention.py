"""Self attention with absolute positional encodings in the potential (paper Table 1)."""

from __future__ import annotations

import torch
from torch import nn

from structattn.checks import check_size
from structattn.potentials import sinusoidal
from structattn.priors import Uniform

from ._catalogue import TOKEN_SIZES, Entry, randn64
from ._projections import TokenAttention


class AbsolutePositionAttention(TokenAttention):
    r"""$φ_i ∼ \mathrm{Uniform}$ (causal: $j ≤ i$); $ψ = (x_i + e_i)ᵀW_QᵀW_K(x_j + e_j) / τ$; $v = W_V x_j$.

    e: learned ``(max_len, d_model)`` (``positions="learned"``) or fixed sinusoidal
    (``"sinusoidal"``). x: ``(*batch, n ≤ max_len, d_model)`` → ``(*batch, n, d_model)``.

    Args:
        d_model (int): the tokens' feature size, a positive int (also the encodings' width).
        max_len (int): the most tokens a call may hold, a positive int: the encodings cover
            positions 0 … max_len − 1, and a longer x raises a ValueError. Default 512.
        positions (str): ``"learned"`` (default: a parameter ``(max_len, d_model)``
            initialised at 0.02·N(0, 1)) or ``"sinusoidal"`` (Vaswani et al.'s fixed
            encodings, a buffer).
        device (torch.device | str | None): the device of the parameters and encodings.
        dtype (torch.dtype | None): the dtype of the parameters and encodings.
        **kwargs (Any): passed to ``TokenAttention`` (d_k, d_v, heads, causal, out_proj,
            temperature, rope_base, rope_dims, name).
    """

    def __init__(self, d_model, *, max_len=512, positions="learned", device=None, dtype=None,
                 **kwargs):
        super().__init__(d_model, device=device, dtype=dtype, **kwargs)
        self.max_len = max_len = check_size(type(self).__name__, "max_len", max_len)
        if positions == "learned":
            self.positions = nn.Parameter(0.02 * torch.randn(max_len, d_model, device=device,
                                                             dtype=dtype))
        elif positions == "sinusoidal":
            self.register_buffer("positions", sinusoidal(
                max_len, d_model, device=device, dtype=dtype or torch.get_default_dtype()))
        else:
            raise ValueError(f"AbsolutePositionAttention: positions must be 'learned' or "
                             f"'sinusoidal'; got {positions!r}")

    def model(self, x):
        tokens = self.tokens(x)
        if tokens.size > self.max_len:
            raise ValueError(f"node set 'x' has {tokens.size} tokens but positional encodings "
                             f"exist for max_len={self.max_len}")
        prior = Uniform(causal=self.causal)
        return self.attend(self.family_name, tokens, tokens, prior, positions=self.positions[: tokens.size])


def absolute_position_attention(d_model, **kwargs) -> AbsolutePositionAttention:
    """Absolute-position self attention; see ``AbsolutePositionAttention``."""
    return AbsolutePositionAttention(d_model, **kwargs)


def _case():
    m = absolute_position_attention(7, max_len=11, d_k=3, heads=2, temperature="learned",
                                    dtype=torch.float64)
    with torch.no_grad():
        m.positions.normal_()
    return m, (randn64(2, 5, 7),)


#: the catalogue's statement (structattn/models/_catalogue.py)
ENTRY = Entry(absolute_position_attention, AbsolutePositionAttention, case=_case,
              example=dict(d_model=8, max_len=16, heads=2, causal=True),
              sizes={**TOKEN_SIZES, "max_len": 1})
