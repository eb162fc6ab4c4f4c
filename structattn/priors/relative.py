"""Relative-position priors: p(φ_i = j) depends on the offset i − j only."""

from __future__ import annotations

import torch

from .._validation import checks_on, passes, shape_str
from .base import Prior
from .distance import DistancePrior
from .uniform import dense_support


def offsets(num_children: int, num_parents: int, device) -> torch.Tensor:
    """``(C, P)`` long tensor of i − j."""
    return (torch.arange(num_children, device=device)[:, None]
            - torch.arange(num_parents, device=device)[None, :])


class RelativePosition(Prior):
    """``p(φ_i = j) ∝ exp(b_{clip(i−j, −K, K)})`` with logits ``b`` of shape ``(2K+1,)`` or
    ``(heads, 2K+1)`` (index ``K + i − j``), learned or fixed; K = ``max_distance``.
    Lowered as an additive bias ``(heads, C, P)``. Paper Table 1 (relative positional encodings).
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

    def describe(self) -> str:
        return f"RelativePosition(K={self.max_distance}, {self.short_support()})"


def alibi_slopes(heads: int) -> torch.Tensor:
    """The ALiBi paper's geometric slopes 2^(−8h/H), h = 1..H."""
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)])


class ALiBi(DistancePrior):
    """``p(φ_i = j) ∝ exp(−m_h |i − j|)`` per head (ALiBi, Press et al. 2022): a
    relative-position prior with fixed slopes m (default: the geometric 2^(−8h/H)).

    ``tol`` ∈ (0, 1) (causal only): the compiled reading reads the shortest window whose
    posterior mass beyond it is certified ≤ tol for every child (``structattn.certified``;
    the trace's ``truncation[family]`` reports it), in blocks of ``block_size`` children; with
    ``certificate="blocks"``, the key blocks each block of children needs, per head
    (``structattn.block_sparse``). The model, and so Pyro's reading, is still all of the
    past."""

    def __init__(self, heads: int = 1, *, slopes: torch.Tensor | None = None, causal: bool = False,
                 tol: float | None = None, block_size: int = 64, certificate: str = "window"):
        slopes = alibi_slopes(heads) if slopes is None else torch.as_tensor(slopes)
        checking = checks_on()
        if slopes.dim() != 1 or (checking and not passes(((slopes >= 0) & slopes.isfinite()).all())):
            raise ValueError(f"ALiBi prior: slopes must be a 1-D tensor of finite m ≥ 0; got {slopes}")
        self.slopes = slopes
        super().__init__("ALiBi prior", causal=causal, tol=tol, block_size=block_size,
                         certificate=certificate)

    def log_at_distance(self, d, dtype=None):
        """−m_h·|d|."""
        m = self.slopes.to(device=d.device, dtype=dtype or self.slopes.dtype)
        return -m.reshape(-1, *([1] * d.dim())) * d.abs().to(m.dtype)  # (H, *d)

    @property
    def heads(self) -> int:
        return len(self.slopes)

    def terms(self, num_children, num_parents, device):
        """Under j ≤ i, −m|i − j| = −m·i + m·j: a difference of per-token terms."""
        if not self.causal:
            return None
        m = self.slopes.to(device)[:, None]  # (H, 1)
        return (-m * torch.arange(num_children, device=device, dtype=m.dtype),
                m * torch.arange(num_parents, device=device, dtype=m.dtype))

    def describe(self) -> str:
        return f"ALiBi(heads={len(self.slopes)}, {self.short_support()})"
