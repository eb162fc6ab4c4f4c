"""ALiBi (Press et al. 2022): p(φ_i = j) ∝ exp(−m_h |i − j|), a fixed slope per head."""

from __future__ import annotations

import torch

from ..checking._validation import checks_on, passes
from ._registry import PriorEntry
from .distance import DistancePrior


def alibi_slopes(heads: int) -> torch.Tensor:
    """The ALiBi paper's geometric slopes 2^(−8h/H), h = 1..H."""
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)])


class ALiBi(DistancePrior):
    r"""$p(φ_i = j) ∝ \exp(−m_h \lvert i − j\rvert)$ per head $h$ (ALiBi, Press et al. 2022).

    A relative-position prior with fixed slopes m, by default the paper's geometric
    $2^{−8h/H}$, $h = 1..H$. Under $j ≤ i$ its log weight is $−m i + m j$, a difference of per-token
    terms (``terms``): the dense and window operators lower it as one more key dimension,
    never a C×P bias.

    Args:
        heads (int): the number of heads H of the default slopes; ignored when ``slopes`` is
            given. Default 1.
        slopes (torch.Tensor | None): the slopes m, a 1-D tensor ``(heads,)`` (or anything
            ``torch.as_tensor`` takes) of finite m ≥ 0 (the values checked while validation
            is on). None (default): 2^(−8h/H).
        causal (bool): the support j ≤ i; False (default): every parent.
        tol (float | None): causal only: the compiled reading reads the shortest window whose
            posterior mass beyond it is certified ≤ tol for every child, in (0, 1)
            (``structattn.certificates.certified``; the trace's ``truncation[family]`` reports it); the
            model, and so Pyro's reading, is still all of the past. None (default): all of
            the past.
        block_size (int): the band's block of children, an int ≥ 1. Default 64.
        certificate (str): ``"window"`` (default) or, with a ``tol``, ``"blocks"``: the key
            blocks each block of children needs, per head (``structattn.block_sparse``).

    Raises:
        ValueError: ``slopes`` not 1-D or not finite and ≥ 0, or an option ``DistancePrior``
            refuses (``tol``, ``block_size``, ``certificate``).
    """

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

    def head_counts(self):
        return {"slopes": len(self.slopes)}

    def terms(self, num_children, num_parents, device):
        """Under j ≤ i, −m|i − j| = −m·i + m·j: a difference of per-token terms."""
        if not self.causal:
            return None
        m = self.slopes.to(device)[:, None]  # (H, 1)
        return (-m * torch.arange(num_children, device=device, dtype=m.dtype),
                m * torch.arange(num_parents, device=device, dtype=m.dtype))

    def describe(self) -> str:
        return f"ALiBi(heads={len(self.slopes)}, {self.short_support()})"


def _formula(prior, C, P):
    import numpy as np

    d = np.abs(np.arange(C)[:, None] - np.arange(P)[None, :])
    w = -prior.slopes.detach().numpy()[:, None, None] * d  # (H, C, P)
    causal = np.arange(P)[None, :] <= np.arange(C)[:, None]
    return np.where(causal, w, -np.inf) if prior.causal else w


def _parameters(g):
    slopes = torch.rand(2, generator=g, dtype=torch.float64) + 0.1
    return (slopes,), lambda m: ALiBi(2, slopes=m, causal=True)


ENTRY = PriorEntry(
    ALiBi, lambda C, P, g: [ALiBi(2)] + ([ALiBi(2, causal=True)] if C <= P else []), _formula,
    bad={"slopes must be a 1-D tensor of finite m ≥ 0":
         lambda: ALiBi(2, slopes=torch.tensor([-1.0, 1.0])),
         r"tol \(the posterior mass a certified window may leave out\) must be None or in":
         lambda: ALiBi(2, causal=True, tol=2.0),
         "needs the causal support": lambda: ALiBi(2, tol=0.1)},
    parameters=_parameters,
    certified=lambda g: ALiBi(2, causal=True, tol=1e-2, block_size=8))
