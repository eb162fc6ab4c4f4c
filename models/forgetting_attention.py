"""Forgetting attention (FoX, Lin et al. ICLR 2025): causal self attention whose prior over
the past is a data-dependent forget gate."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from structattn.certificates.certified import certificate_option, window_options
from structattn.priors.forgetting import ForgettingGate

from ._catalogue import TOKEN_SIZES, Entry, randn64
from ._projections import TokenAttention


class ForgettingAttention(TokenAttention):
    r"""$p(φ_i = j) ∝ \prod_{l=j+1}^{i} f_{l,h}$ over $j ≤ i$, per head $h$, with forget gates
    $f_{l,h} = σ(w_hᵀ x_l + b_h)$ (``W_f: (heads, d_model)``, ``b_f: (heads,)``); $ψ = x_iᵀW_QᵀW_K x_j / τ$;
    $v = W_V x_j$. The log prior is $c_i − c_j$ ($c = \mathrm{cumsum} \log f$): lowered as SDPA with
    $−c_j$ as a mask over the parents (CPU; elsewhere one more key dimension), $O(n)$ memory,
    backward included.

    x: ``(*batch, n, d_model)`` → ``(*batch, n, d_model or heads·d_v)``.
    ``gate_bias``: b_h's initial value (σ(3) ≈ 0.95: the gates start mostly open).
    ``tol``: read only a window whose posterior mass beyond it is certified ≤ tol per token
    (``structattn.certificates.certified``: FoX's adaptive pruning, with a proof); ``block_size``: that
    band's block of tokens; ``certificate="blocks"``: read instead the key blocks each block
    of tokens needs, wherever they lie, per head (``structattn.block_sparse``).

    Args:
        d_model (int): the tokens' width, x's last dimension ``d_model``; a positive int.
        heads (int): the number of heads, a positive int; each head has its own forget gate
            (a row of ``W_f`` and an entry of ``b_f``). Default 1.
        gate_bias (float): the initial value of every head's gate bias b_h, a finite number.
            Default 3.0: σ(3) ≈ 0.95, the gates start mostly open.
        tol (float | None): None (default): read the whole past; a number in (0, 1): read
            only a window whose posterior mass beyond it is certified ≤ tol per token.
        block_size (int): the certified band's block of tokens, a positive int. Default 64.
        certificate (str): ``"window"`` (default: one band back from each token) or
            ``"blocks"`` (the key blocks each block of tokens needs, per head); ``"blocks"``
            needs a ``tol``.
        device (torch.device | str | None): where the parameters live; None: torch's default.
        dtype (torch.dtype | None): the parameters' dtype; None: torch's default.
        **kwargs (Any): TokenAttention's options (d_k, d_v, out_proj, temperature, rope_base,
            rope_dims, name); the model is always causal, so ``causal`` is not among them.
    """

    def __init__(self, d_model, *, heads=1, gate_bias=3.0, tol=None, block_size=64,
                 certificate="window", device=None, dtype=None, **kwargs):
        super().__init__(d_model, heads=heads, causal=True, device=device, dtype=dtype, **kwargs)
        window_options("ForgettingAttention", tol, block_size, True)
        self.certificate = certificate_option("ForgettingAttention", certificate, tol)
        if isinstance(gate_bias, bool) or not isinstance(gate_bias, (int, float)) \
                or not math.isfinite(gate_bias):
            raise ValueError(f"ForgettingAttention: gate_bias must be a finite number (the forget "
                             f"gates' initial logit b_h); got {gate_bias!r}")
        self.tol, self.block_size = tol, block_size
        kw = {"device": device, "dtype": dtype}
        self.W_f = nn.Parameter(torch.empty(self.heads, d_model, **kw))
        nn.init.xavier_uniform_(self.W_f)
        self.b_f = nn.Parameter(torch.full((self.heads,), float(gate_bias), **kw))

    def log_gates(self, x):
        """log f ``(*batch, heads, n)``."""
        return F.logsigmoid(F.linear(x, self.W_f, self.b_f)).movedim(-1, -2)

    def model(self, x):
        tokens = self.tokens(x)
        prior = ForgettingGate(self.log_gates(x), tol=self.tol, block_size=self.block_size,
                               certificate=self.certificate)
        return self.attend(self.family_name, tokens, tokens, prior)


def forgetting_attention(d_model, **kwargs) -> ForgettingAttention:
    """Forgetting attention (FoX); see ``ForgettingAttention``."""
    return ForgettingAttention(d_model, **kwargs)


def _case():
    m = forgetting_attention(7, d_k=3, heads=2, dtype=torch.float64)
    return m, (randn64(2, 5, 7),)


#: the catalogue's statement (structattn/models/_catalogue.py)
ENTRY = Entry(forgetting_attention, ForgettingAttention, case=_case,
              example=dict(d_model=8, heads=2),
              sizes={**TOKEN_SIZES, "block_size": 1})
