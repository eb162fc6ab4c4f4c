"""Self attention with a learned generalised-Gaussian prior over the distance (BAM)."""

from __future__ import annotations

import math

import torch
from torch import nn

from structattn.certificates.certified import window_options
from structattn.priors.generalised_gaussian import GeneralisedGaussian

from ._catalogue import TOKEN_SIZES, Entry, randn64
from ._projections import TokenAttention


class GeneralisedGaussianAttention(TokenAttention):
    r"""$p(φ_i = j) ∝ \exp(−\lvert(i − j − μ_h)\, e^{s_h}\rvert^{β_h})$ per head $h$, with $μ_h$, $s_h$ and
    $β_h = \exp(\log β_h)$ learned (``loc``, ``log_scale``, ``log_shape``, each ``(heads,)``);
    $ψ = x_iᵀW_QᵀW_K x_j / τ$; $v = W_V x_j$. Causal by default.

    x: ``(*batch, n, d_model)`` → ``(*batch, n, d_model or heads·d_v)``.
    Initial prior: μ = 0, scale e^s = 1/``width`` (``width`` = 16: distances are read in units
    of 16 tokens), β = ``shape`` (1: Laplace). ``tol`` (causal): read only a window whose
    posterior mass beyond it is certified ≤ tol per token (``structattn.certificates.certified``); without
    it, the prior's table over the offsets is read per tile (the CPU's distance-table kernel;
    a Triton kernel on CUDA); ``block_size``: that band's block of tokens.

    Args:
        d_model (int): the tokens' width, x's last dimension ``d_model``; a positive int.
        heads (int): the number of heads, a positive int; each head has its own ``loc``,
            ``log_scale`` and ``log_shape``. Default 1.
        causal (bool): True (default): token i attends to j ≤ i; False: to every token.
        width (float): the initial prior's width 1/e^s in tokens, a finite number > 0.
            Default 16.0.
        shape (float): the initial shape β, a finite number > 0 (1: Laplace, the default;
            2: Gaussian).
        tol (float | None): None (default): read every pair the support allows; a number in
            (0, 1): read only a certified window (needs ``causal=True``).
        block_size (int): the certified band's block of tokens, a positive int. Default 64.
        device (torch.device | str | None): where the parameters live; None: torch's default.
        dtype (torch.dtype | None): the parameters' dtype; None: torch's default.
        **kwargs (Any): TokenAttention's options (d_k, d_v, out_proj, temperature, rope_base,
            rope_dims, name).
    """

    def __init__(self, d_model, *, heads=1, causal=True, width=16.0, shape=1.0, tol=None,
                 block_size=64, device=None, dtype=None, **kwargs):
        super().__init__(d_model, heads=heads, causal=causal, device=device, dtype=dtype, **kwargs)
        window_options("GeneralisedGaussianAttention", tol, block_size, causal)
        self.tol, self.block_size = tol, block_size
        if not (isinstance(width, (int, float)) and width > 0 and math.isfinite(width)):
            raise ValueError(f"GeneralisedGaussianAttention: width must be a finite number > 0; "
                             f"got {width!r}")
        if not (isinstance(shape, (int, float)) and shape > 0 and math.isfinite(shape)):
            raise ValueError(f"GeneralisedGaussianAttention: shape must be a finite number > 0 "
                             f"(1: Laplace, 2: Gaussian); got {shape!r}")
        kw = {"device": device, "dtype": dtype}
        self.loc = nn.Parameter(torch.zeros(self.heads, **kw))
        self.log_scale = nn.Parameter(torch.full((self.heads,), -math.log(width), **kw))
        self.log_shape = nn.Parameter(torch.full((self.heads,), math.log(shape), **kw))

    def model(self, x):
        tokens = self.tokens(x)
        prior = GeneralisedGaussian(self.loc, self.log_scale, self.log_shape.exp(),
                                    causal=self.causal, tol=self.tol, block_size=self.block_size)
        return self.attend(self.family_name, tokens, tokens, prior)


def generalised_gaussian_attention(d_model, **kwargs) -> GeneralisedGaussianAttention:
    """Generalised-Gaussian distance-prior attention (BAM); see
    ``GeneralisedGaussianAttention``."""
    return GeneralisedGaussianAttention(d_model, **kwargs)


def _case():
    m = generalised_gaussian_attention(7, d_k=3, heads=2, width=2.0, dtype=torch.float64)
    with torch.no_grad():  # distinct heads, off-zero location and shape
        m.loc.copy_(torch.tensor([0.5, 1.7], dtype=torch.float64))
        m.log_shape.copy_(torch.tensor([0.3, -0.4], dtype=torch.float64))
    return m, (randn64(2, 5, 7),)


#: the catalogue's statement (structattn/models/_catalogue.py)
ENTRY = Entry(generalised_gaussian_attention, GeneralisedGaussianAttention, case=_case,
              example=dict(d_model=8, heads=2, width=2.0),
              sizes={**TOKEN_SIZES, "block_size": 1})
