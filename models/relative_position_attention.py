"""Self attention with a learned relative-position prior (paper Table 1)."""

from __future__ import annotations

import torch
from torch import nn

import structattn as sa

from ._projections import ProjectedAttention


class RelativePositionAttention(ProjectedAttention):
    """φ_i ~ Categorical(softmax_j b_{clip(i−j, −K, K)}) per head (b learned, ``(heads, 2K+1)``);
    ψ = x_iᵀW_QᵀW_K x_j / τ; v = W_V x_j. The log prior is an additive SDPA bias.

    x: ``(*batch, n, d_model)`` → ``(*batch, n, d_model or heads·d_v)``.
    """

    def __init__(self, d_model, *, max_distance=16, d_k=None, d_v=None, heads=1, causal=False,
                 out_proj=True, temperature=None, device=None, dtype=None):
        d_k = d_k or d_model // heads
        d_v = d_v or d_k
        super().__init__(d_model, d_model, d_k, d_v, heads, d_model if out_proj else None,
                         temperature, device, dtype)
        if not isinstance(max_distance, int) or max_distance < 0:
            raise ValueError(f"RelativePositionAttention: max_distance must be an int ≥ 0; "
                             f"got {max_distance!r}")
        self.d_model, self.causal, self.max_distance = d_model, causal, max_distance
        self.position_logits = nn.Parameter(torch.zeros(heads, 2 * max_distance + 1,
                                                        device=device, dtype=dtype))

    def model(self, x):
        tokens = sa.nodes("x", x, features=self.d_model)
        prior = sa.priors.RelativePosition(self.position_logits, causal=self.causal)
        return self.attend("attn", tokens, tokens, prior)

    def example_inputs(self, n=5, batch=1):
        return (self._randn(batch, n, self.d_model),)


def relative_position_attention(d_model, **kwargs) -> RelativePositionAttention:
    """Relative-position self attention; see :class:`RelativePositionAttention`."""
    return RelativePositionAttention(d_model, **kwargs)
