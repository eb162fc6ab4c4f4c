"""A generalised Gaussian over the distance (BAM): log p(φ_i = j) = −|(i − j − μ)·e^s|^β + const."""

from __future__ import annotations

import torch

from .._validation import checks_on, passes, shape_str
from ..certified import window_options
from ..kinds.window import Window
from .base import Prior
from .tables import PriorTables, _check_log_weights
from .uniform import dense_support


def _per_head(name: str, t) -> torch.Tensor:
    t = torch.as_tensor(t)
    if t.dim() > 1 or not t.is_floating_point():
        raise ValueError(f"GeneralisedGaussian prior: {name} must be a float scalar or a 1-D "
                         f"tensor (heads,); got {shape_str(t.shape)} {t.dtype}")
    return t


class GeneralisedGaussian(Prior):
    """``p(φ_i = j) ∝ exp(−|(i − j − μ_h)·e^{s_h}|^{β_h})`` per head h: a learned location μ
    (the preferred distance), log scale s and shape β > 0 — β = 1 is a Laplace prior (ALiBi's
    −m|i − j| with μ = 0, e^s = m), β = 2 a Gaussian, β → ∞ a window. Not a difference of
    per-token terms, so it lowers as an additive ``(heads, C, P)`` bias.

    ``loc``, ``log_scale``, ``shape``: scalars or ``(heads,)``; ``causal``: j ≤ i; ``tol`` ∈
    (0, 1) (causal only): the compiled reading reads the shortest window whose posterior mass
    beyond it is certified ≤ tol for every child (``structattn.certified``), in blocks of
    ``block_size`` children — never the dense bias; the model, and so Pyro's reading, is still
    all of the past.
    """

    def __init__(self, loc, log_scale, shape, *, causal: bool = True, tol: float | None = None,
                 block_size: int = 64):
        loc, log_scale, shape = (_per_head(n, t) for n, t in
                                 (("loc", loc), ("log_scale", log_scale), ("shape", shape)))
        if checks_on():
            for name, t in (("loc", loc), ("log_scale", log_scale)):
                if not passes(t.isfinite().all()):
                    raise ValueError(f"GeneralisedGaussian prior: {name} must be finite; got "
                                     f"{t.detach().tolist()}")
            if not passes(((shape > 0) & shape.isfinite()).all()):
                raise ValueError(f"GeneralisedGaussian prior: shape β must be finite and > 0 "
                                 f"(1: Laplace, 2: Gaussian); got {shape.detach().tolist()}")
        self.loc, self.log_scale, self.shape, self.causal = loc, log_scale, shape, bool(causal)
        self.tol, self.block_size = window_options("GeneralisedGaussian prior", tol,
                                                             block_size, self.causal)

    def support(self, num_children, num_parents):
        if self.tol is not None:  # all of the past, j ≤ i, read through a certified window
            return Window(None, first=0)
        return dense_support(self.causal, None)

    def _at(self, d: torch.Tensor, dtype=None) -> torch.Tensor:
        """−|(d − μ)·e^s|^β ``(H, *d.shape)`` at distances ``d``, in ``dtype`` (None: μ's)."""
        lead = [1] * d.dim()
        mu, s, beta = (t.reshape(*t.shape, *lead) if dtype is None else
                       t.to(dtype).reshape(*t.shape, *lead)
                       for t in (self.loc, self.log_scale, self.shape))
        z = ((d.to(mu.dtype) - mu) * s.exp()).abs()  # (H, *index)
        # |z|^β with finite gradients at z = 0 (where β < 1 would give 0·∞)
        zero = z == 0
        return -torch.where(zero, torch.zeros_like(z), torch.where(zero, 1.0, z) ** beta)

    def log_weight(self, child, parent, sizes):
        return self._at((child - parent).to(self.loc.device))

    def log_by_distance(self, window, device, dtype):
        """``(heads, window + 1)`` at d = 0..window (a stationary prior)."""
        return self._at(torch.arange(window + 1, device=self.loc.device), dtype).reshape(
            -1, window + 1).to(device)

    def tables(self, num_children, num_parents, device):
        return (DistanceTables if self.tol is not None else PriorTables)(
            self, num_children, num_parents, device)

    def describe(self) -> str:
        heads = self.loc.numel()
        return f"GeneralisedGaussian(heads={heads}, {self.short_support()})"


class DistanceTables(PriorTables):
    """The generic tables, except that declaring a family checks the prior's distance table
    ``(heads, N)`` instead of the dense C×P one, which a certified window never builds:
    every log weight is one of its entries (j ≤ i reads d = 0..N − 1), and every child reads
    d = 0."""

    def validate(self, family: str, *, batch_shape=(), heads: int = 1) -> None:
        prior, n = self.prior, max(self.num_children, self.num_parents)
        h = prior.loc.numel()
        if h not in (1, heads):
            raise ValueError(f"edge family {family!r}: {type(prior).__name__} has {h} heads "
                             f"of parameters but the family has heads={heads}")
        if not checks_on():
            return
        table = prior.log_by_distance(max(n - 1, 0), self.device, None)  # (H, N)
        _check_log_weights(family, table, "at distance index")
        if not passes(~torch.isneginf(table[:, 0]).any()):
            raise ValueError(f"edge family {family!r}: {type(prior).__name__}'s log weight at "
                             f"distance 0 is −inf (|μ·e^s|^β overflows), so child 0 has an "
                             f"empty support; got loc={prior.loc.detach().tolist()}")
