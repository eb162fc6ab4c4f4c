"""Residual attention dynamics: η ← RN(η + ∇G(η)), a gradient-ascent step on G then a
renormalisation (the drafts' reading of attention + residual + LayerNorm)."""

from __future__ import annotations

import math

import torch

from .base import Measure
from .empirical import Empirical

RENORMS = (None, "layernorm", "batchnorm", "sphere")


def renormalise(x: torch.Tensor, kind: str | None, eps: float = 1e-5) -> torch.Tensor:
    """RN(x): the renormalisation a residual step applies to the points.

    Args:
        x (torch.Tensor): the points, ``(*batch, N, d)``.
        kind (str | None): None (x as it is), "layernorm" (each point to zero mean, unit
            variance over its features), "batchnorm" (each feature to zero mean, unit
            variance over the points) or "sphere" (each point to norm √d).
        eps (float): added to the variance (to the norm's floor for "sphere"); default 1e-5.

    Returns:
        torch.Tensor: the renormalised points, ``(*batch, N, d)``.

    Raises:
        ValueError: a ``kind`` not among these.
    """
    if kind is None:
        return x
    if kind == "layernorm":
        return torch.nn.functional.layer_norm(x, x.shape[-1:], eps=eps)
    if kind == "batchnorm":
        mu, var = x.mean(-2, keepdim=True), x.var(-2, unbiased=False, keepdim=True)
        return (x - mu) / (var + eps).sqrt()
    if kind == "sphere":
        return x / x.norm(dim=-1, keepdim=True).clamp_min(eps) * math.sqrt(x.shape[-1])
    raise ValueError(f"renormalisation must be one of {RENORMS}; got {kind!r}")


def residual_dynamics(points: torch.Tensor, steps: int, *, renorm: str | None = "layernorm",
                      measure: Measure | None = None, beta: float = 1.0) -> torch.Tensor:
    """Iterate η ← RN(η + ∇G(βη)) from the points: attention, residual, renormalisation.

    Args:
        points (torch.Tensor): the start η, ``(*batch, N, d)``.
        steps (int): the number of steps, an int ≥ 0.
        renorm (str | None): RN, a kind of ``renormalise`` (None, "layernorm", "batchnorm",
            "sphere"); default "layernorm".
        measure (Measure | None): the fixed measure whose G is ascended (cross-attention);
            None, the default: the empirical measure of the current points (self-attention).
        beta (float): the inverse temperature scaling η inside G, a finite number > 0;
            default 1.0.

    Returns:
        torch.Tensor: the trajectory ``(steps + 1, *batch, N, d)``; ``[0]`` is the start as
            given (not renormalised).

    Raises:
        ValueError: ``steps`` not an int ≥ 0, an unknown ``renorm``, ``beta`` not a finite
            number > 0, or points that overflow (non-finite) during the iteration.
    """
    if not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps must be an int ≥ 0; got {steps!r}")
    if renorm not in RENORMS:
        raise ValueError(f"renorm must be one of {RENORMS}; got {renorm!r}")
    try:
        beta_f = float(beta)
    except (TypeError, ValueError):
        beta_f = float("nan")
    if isinstance(beta, bool) or not (beta_f > 0 and math.isfinite(beta_f)):
        raise ValueError(f"beta must be a finite number > 0; got {beta!r}")
    eta, path = points, [points]
    for t in range(steps):
        h = Empirical(eta) if measure is None else measure
        eta = renormalise(eta + h.mean(beta_f * eta), renorm)
        if not bool(torch.isfinite(eta).all()):
            raise ValueError(
                f"residual_dynamics: the points overflowed at step {t + 1} of {steps} "
                f"(renorm={renorm!r}: without a renormalisation the cloud expands "
                f"geometrically); renormalise, take fewer steps or use float64")
        path.append(eta)
    return torch.stack(path)
