"""A generalised Gaussian over the distance (BAM): log p(φ_i = j) = −|(i − j − μ)·e^s|^β + const."""

from __future__ import annotations

import torch

from ..checking._validation import checks_on, passes, shape_str
from ._registry import PriorEntry
from .distance import DistancePrior


def _per_head(name: str, t) -> torch.Tensor:
    t = torch.as_tensor(t)
    if t.dim() > 1 or not t.is_floating_point():
        raise ValueError(f"GeneralisedGaussian prior: {name} must be a float scalar or a 1-D "
                         f"tensor (heads,); got {shape_str(t.shape)} {t.dtype}")
    return t


class GeneralisedGaussian(DistancePrior):
    r"""$p(φ_i = j) ∝ \exp(−\lvert(i − j − μ_h)\, e^{s_h}\rvert^{β_h})$ per head $h$ (BAM).

    A learned location $μ$ (the preferred distance), log scale $s$ and shape $β > 0$: $β = 1$ is a
    Laplace prior (ALiBi's $−m\lvert i − j\rvert$ with $μ = 0$, $e^s = m$), $β = 2$ a Gaussian, $β → ∞$ a
    window.
    Not a difference of per-token terms: the CPU's distance-table kernel reads it from its
    table over the offsets per tile of scores (``log_at_offsets``, ``kinds.distance_table``),
    a GPU's Triton kernel computes it per block of scores (``distance_shape``,
    ``kinds.distance_kernel``), and elsewhere (half precision on the CPU) the dense reading
    adds it as a ``(heads, C, P)`` bias; a certified window (``tol``) never builds that bias.

    Args:
        loc (float | torch.Tensor): μ, a float or a floating-point tensor ``()`` or
            ``(heads,)``, finite (values checked while validation is on).
        log_scale (float | torch.Tensor): s, as ``loc``.
        shape (float | torch.Tensor): β, as ``loc``, finite and > 0.
        causal (bool): the support j ≤ i; False: every parent. Default True.
        tol (float | None): causal only: the compiled reading reads the shortest window whose
            posterior mass beyond it is certified ≤ tol for every child, in (0, 1)
            (``structattn.certificates.certified``); the model, and so Pyro's reading, is still all of the
            past. None (default): all of the past.
        block_size (int): the band's block of children, an int ≥ 1. Default 64.

    Raises:
        ValueError: a parameter that is not a float scalar or a 1-D float tensor, ``loc`` or
            ``log_scale`` not finite, ``shape`` not finite and > 0, or an option
            ``DistancePrior`` refuses (``tol``, ``block_size``).
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
        self.loc, self.log_scale, self.shape = loc, log_scale, shape
        super().__init__("GeneralisedGaussian prior", causal=causal, tol=tol,
                         block_size=block_size)

    def log_at_distance(self, d, dtype=None):
        """−|(d − μ)·e^s|^β ``(H, *d.shape)`` at distances ``d``, in ``dtype`` (None: μ's)."""
        d = d.to(self.loc.device)
        lead = [1] * d.dim()
        mu, s, beta = (t.reshape(*t.shape, *lead) if dtype is None else
                       t.to(dtype).reshape(*t.shape, *lead)
                       for t in (self.loc, self.log_scale, self.shape))
        z = ((d.to(mu.dtype) - mu) * s.exp()).abs()  # (H, *index)
        # |z|^β with finite gradients at z = 0 (where β < 1 would give 0·∞)
        zero = z == 0
        return -torch.where(zero, torch.zeros_like(z), torch.where(zero, 1.0, z) ** beta)

    def distance_shape(self):
        """``(μ, s, β)``: the Triton kernel computes the weight per tile from them
        (``kinds.distance_kernel``)."""
        return self.loc, self.log_scale, self.shape

    @property
    def heads(self) -> int:
        return max(t.numel() for t in (self.loc, self.log_scale, self.shape))

    def head_counts(self):
        return {"loc": self.loc.numel(), "log_scale": self.log_scale.numel(),
                "shape": self.shape.numel()}

    def describe(self) -> str:
        return f"GeneralisedGaussian(heads={self.heads}, {self.short_support()})"


def _formula(prior, C, P):
    import numpy as np

    mu, s, beta = (t.detach().numpy().reshape(-1, 1, 1)
                   for t in (prior.loc, prior.log_scale, prior.shape))
    d = np.arange(C)[:, None] - np.arange(P)[None, :]
    w = -np.abs((d - mu) * np.exp(s)) ** beta  # (H, C, P)
    return np.where(d >= 0, w, -np.inf) if prior.causal else w


def _three(g, h=2):
    f64 = torch.float64
    return (torch.rand(h, generator=g, dtype=f64) * 2, torch.rand(h, generator=g, dtype=f64) - 1,
            torch.rand(h, generator=g, dtype=f64) + 0.8)


ENTRY = PriorEntry(
    GeneralisedGaussian,
    lambda C, P, g: [GeneralisedGaussian(*_three(g))] if C <= P else [],
    _formula,
    bad={"shape β must be finite and > 0": lambda: GeneralisedGaussian(0.0, 0.0, -1.0),
         "loc must be finite": lambda: GeneralisedGaussian(float("nan"), 0.0, 1.0),
         "loc must be a float scalar or a 1-D": lambda: GeneralisedGaussian(torch.zeros(2, 2),
                                                                            0.0, 1.0)},
    parameters=lambda g: (_three(g), lambda *t: GeneralisedGaussian(*t)),
    certified=lambda g: GeneralisedGaussian(torch.tensor([0.0, 2.0], dtype=torch.float64),
                                            torch.tensor([0.0, -0.5], dtype=torch.float64),
                                            torch.tensor([1.0, 2.0], dtype=torch.float64),
                                            tol=1e-2, block_size=8))
