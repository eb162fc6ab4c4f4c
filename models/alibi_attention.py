"""Self attention with ALiBi's fixed-slope relative-position prior."""

from __future__ import annotations

import torch

from structattn.certificates.certified import certificate_option, window_options
from structattn.priors import ALiBi
from structattn.priors.alibi import alibi_slopes

from ._catalogue import TOKEN_SIZES, Entry, randn64
from ._projections import TokenAttention


class ALiBiAttention(TokenAttention):
    r"""$φ_i ∼ \mathrm{Categorical}(\mathrm{softmax}_j\, {−m_h \lvert i − j\rvert})$ per head $h$ (slopes
    $m_h = 2^{−8h/H}$, fixed); $ψ = x_iᵀW_QᵀW_K x_j / τ$; $v = W_V x_j$. Causal by default, as in Press et al.
    (2022). ``tol`` (causal): read only a window whose posterior mass beyond it is certified ≤ tol per token
    (``structattn.certificates.certified``); ``block_size``: that band's block of tokens;
    ``certificate="blocks"``: read
    instead the key blocks each block of tokens needs, wherever they lie, per head
    (``structattn.block_sparse``: the slow heads no longer hold the fast ones).

    x: ``(*batch, n, d_model)`` → ``(*batch, n, d_model or heads·d_v)``.

    Args:
        d_model (int): the tokens' feature size, a positive int.
        heads (int): the number of heads, a positive int; head h gets the slope
            m_h = 2^(−8h/heads). Default 1.
        causal (bool): True (default) restricts each token's parents to itself and its past
            (j ≤ i); False reads both sides, |i − j|.
        tol (float | None): the posterior mass a certified window may leave out per token,
            in (0, 1), causal only; None, the default, reads the whole past.
        block_size (int): the band's block of tokens, a positive int. Default 64.
        certificate (str): ``"window"`` (default: one band back from each token) or
            ``"blocks"`` (the key blocks each block of tokens needs, per head; needs
            ``tol``).
        device (torch.device | str | None): the device of the parameters and slopes.
        dtype (torch.dtype | None): the dtype of the parameters and slopes.
        **kwargs (Any): passed to ``TokenAttention`` (d_k, d_v, out_proj, temperature,
            rope_base, rope_dims, name).
    """

    def __init__(self, d_model, *, heads=1, causal=True, tol=None, block_size=64,
                 certificate="window", device=None, dtype=None, **kwargs):
        super().__init__(d_model, heads=heads, causal=causal, device=device, dtype=dtype, **kwargs)
        self.register_buffer("slopes", alibi_slopes(heads).to(
            device=device, dtype=dtype))
        window_options("ALiBiAttention", tol, block_size, causal)
        self.certificate = certificate_option("ALiBiAttention", certificate, tol)
        self.tol, self.block_size = tol, block_size

    def model(self, x):
        tokens = self.tokens(x)
        prior = ALiBi(self.heads, slopes=self.slopes, causal=self.causal, tol=self.tol,
                      block_size=self.block_size, certificate=self.certificate)
        return self.attend(self.family_name, tokens, tokens, prior)


def alibi_attention(d_model, **kwargs) -> ALiBiAttention:
    """ALiBi self attention; see ``ALiBiAttention``."""
    return ALiBiAttention(d_model, **kwargs)


def _case():
    m = alibi_attention(7, d_k=3, heads=3, dtype=torch.float64)
    return m, (randn64(2, 5, 7),)


#: the catalogue's statement (structattn/models/_catalogue.py)
ENTRY = Entry(alibi_attention, ALiBiAttention, case=_case,
              example=dict(d_model=8, heads=2),
              sizes={**TOKEN_SIZES, "block_size": 1})
