"""Relative-position priors: p(φ_i = j) depends on the offset i − j only."""

from __future__ import annotations

import torch

from ..checking._validation import shape_str
from ._registry import PriorEntry
from .base import Prior
from .uniform import dense_support


def offsets(num_children: int, num_parents: int, device) -> torch.Tensor:
    """``(C, P)`` long tensor of i − j."""
    return (torch.arange(num_children, device=device)[:, None]
            - torch.arange(num_parents, device=device)[None, :])


class RelativePosition(Prior):
    r"""$p(φ_i = j) ∝ \exp(b_{\mathrm{clip}(i−j, −K, K)})$: logits $b$ indexed by the clipped offset.

    Learned or fixed; offsets beyond ±K share the outermost logit. Its table over the offsets
    (``log_at_offsets``) is read per tile of scores by the CPU's distance-table kernel;
    elsewhere it is an additive bias ``(heads, C, P)``. Paper Table 1 (relative positional
    encodings).

    Args:
        logits (torch.Tensor): b, a floating-point tensor ``(2K+1,)`` (shared by every head)
            or ``(heads, 2K+1)``, entry ``K + i − j`` for the offset i − j; its odd length
            gives K (``max_distance``).
        causal (bool): the support j ≤ i; False (default): every parent.

    Raises:
        ValueError: ``logits`` not a floating-point tensor of 1 or 2 dims with an odd last
            dim.
    """

    def __init__(self, logits: torch.Tensor, *, causal: bool = False):
        if not isinstance(logits, torch.Tensor) or logits.dim() not in (1, 2) \
                or logits.shape[-1] % 2 != 1 or not logits.is_floating_point():
            got = shape_str(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
            raise ValueError(
                f"RelativePosition prior: logits must be a float tensor (2K+1,) or (heads, 2K+1) "
                f"indexed by K + i − j; got {got}"
            )
        self.logits, self.causal = logits, bool(causal)
        self.max_distance = (logits.shape[-1] - 1) // 2

    def support(self, num_children, num_parents):
        return dense_support(self.causal, None)

    def log_weight(self, child, parent, sizes):
        K = self.max_distance
        d = (child - parent).to(self.logits.device)
        return self.logits[..., d.clamp(-K, K) + K]  # (…, *index)

    def log_at_offsets(self, num_children, num_parents, device, causal):
        """The logits at the clipped offsets d = ``lowest`` … C − 1 (``Prior.log_at_offsets``)."""
        K, lowest = self.max_distance, 0 if causal else 1 - num_parents
        d = torch.arange(lowest, num_children, device=self.logits.device)
        return self.logits[..., d.clamp(-K, K) + K].reshape(-1, d.numel()).to(device), lowest

    def describe(self) -> str:
        return f"RelativePosition(K={self.max_distance}, {self.short_support()})"


def _formula(prior, C, P):
    import numpy as np

    K = prior.max_distance
    d = np.clip(np.arange(C)[:, None] - np.arange(P)[None, :], -K, K) + K
    logits = prior.logits.detach().numpy().reshape(-1, 2 * K + 1)[:, d]  # (H|1, C, P)
    causal = np.arange(P)[None, :] <= np.arange(C)[:, None]
    return np.where(causal, logits, -np.inf) if prior.causal else logits


def _parameters(g):
    return ((torch.randn(2, 5, generator=g, dtype=torch.float64),),
            lambda t: RelativePosition(t, causal=True))


ENTRY = PriorEntry(
    RelativePosition,
    lambda C, P, g: [RelativePosition(torch.randn(2, 5, generator=g, dtype=torch.float64))],
    _formula,
    bad={r"logits must be a float tensor \(2K\+1,\)": lambda: RelativePosition(torch.zeros(4))},
    parameters=_parameters)
