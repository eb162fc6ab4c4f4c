"""Stick-breaking attention (Tan et al., ICLR 2025): each token scans back from its
predecessor and reads the first token it breaks at."""

from __future__ import annotations

import torch

from structattn.priors import StickBreaking

from ._catalogue import TOKEN_SIZES, Entry, randn64
from ._projections import TokenAttention


class StickBreakingAttention(TokenAttention):
    r"""$φ_i$: scan $l = i − 1, i − 2, …$, break at $l$ with probability $β_{il} = σ(ψ_{il})$,
    $ψ = x_iᵀW_QᵀW_K x_l / τ$, per head: $p(φ_i = j) = β_{ij} \prod_{j<l<i} (1 − β_{il})$, and no parent
    with the leftover $\prod_{l<i} (1 − β_{il})$ (value zero); $v = W_V x_j$. No position encoding is
    needed: the scan's order is the position.

    x: ``(*batch, n, d_model)`` → ``(*batch, n, d_model or heads·d_v)``. Compiled, the CPU
    kernel (``structattn.kinds.stick_breaking``) reads it forward and backward without the
    n×n posterior; ``return_trace=True`` gives ``trace.leftover[name]`` ``(*batch, H, n)``.
    ``tol``: the stick left at which the kernel stops a scan (``StickBreaking``; None: under
    rounding, 0: every pair).

    Args:
        d_model (int): the tokens' features, a positive int.
        heads (int): attention heads, a positive int. Default 1.
        tol (float | None): the stick left at which the kernel stops a scan, a number in
            [0, 1); None (default): the rounding level.
        device (torch.device | str | None): where the parameters are made; None: PyTorch's
            default.
        dtype (torch.dtype | None): the parameters' dtype; None: PyTorch's default.
        **kwargs (Any): TokenAttention's options (d_k, d_v, out_proj, temperature, rope_base,
            rope_dims, name); ``causal`` is always True here.
    """

    def __init__(self, d_model, *, heads=1, tol=None, device=None, dtype=None, **kwargs):
        super().__init__(d_model, heads=heads, causal=True, device=device, dtype=dtype, **kwargs)
        StickBreaking(tol=tol)  # refuse a bad tol now, not at the first call
        self.tol = tol

    def model(self, x):
        tokens = self.tokens(x)
        return self.attend(self.family_name, tokens, tokens, StickBreaking(tol=self.tol))


def stick_breaking_attention(d_model, **kwargs) -> StickBreakingAttention:
    """Stick-breaking attention; see ``StickBreakingAttention``."""
    return StickBreakingAttention(d_model, **kwargs)


def _case():
    m = stick_breaking_attention(7, d_k=3, heads=2, dtype=torch.float64)
    return m, (randn64(2, 5, 7),)


#: the catalogue's statement (structattn/models/_catalogue.py)
ENTRY = Entry(stick_breaking_attention, StickBreakingAttention, case=_case,
              example=dict(d_model=8, heads=2),
              sizes=TOKEN_SIZES)
