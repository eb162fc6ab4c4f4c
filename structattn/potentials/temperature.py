"""A potential's temperature τ > 0: one for every head, or one per head.

ψ_h / τ_h tempers head h's posterior. τ is a float, a scalar tensor (learnable), or a tensor
of shape ``(heads,)`` — one temperature per head (learnable too). A float is checked when
the potential is made; a tensor's shape too, its values (which change while learning) when
the potential is used, while validating.

Within a potential τ meets tensors whose heads dim sits ``trailing`` dims from the end
(``(*batch, H, C, k)``: 2; ``(*batch, H, C)``: 1): ``per_head`` shapes it for them.
"""

from __future__ import annotations

import math

import torch

from ..checking._validation import checks_on, passes, shape_str


def check_temperature(temperature, where: str, heads: int | None = None):
    """τ as given, checked: a float finite and > 0; a tensor of one element or, when ``heads``
    is given, of shape ``(heads,)``; a list or tuple of ``heads`` floats becomes a tensor."""
    if isinstance(temperature, (list, tuple)) and heads is not None:
        for t in temperature:
            check_temperature(t, where)
        temperature = torch.tensor(temperature, dtype=torch.float64)
    if isinstance(temperature, torch.Tensor):
        if heads is not None:
            check_temperature_shape(temperature, heads, where)
        return temperature
    try:
        t = float(temperature)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: temperature must be a finite number > 0 or a tensor; got "
                         f"{temperature!r}") from None
    if not (t > 0 and math.isfinite(t)):
        raise ValueError(f"{where}: temperature must be a finite number > 0; got {temperature}")
    return t


def check_temperature_shape(t: torch.Tensor, heads: int, where: str) -> None:
    """A tensor τ is one number (every head) or one per head, shape ``(heads,)``."""
    if t.numel() != 1 and tuple(t.shape) != (heads,):
        raise ValueError(
            f"{where}: temperature must be a scalar or one per head, shape ({heads},) for "
            f"heads={heads}; got shape {shape_str(t.shape)}")
    if not t.is_floating_point():
        raise ValueError(f"{where}: temperature must be a floating-point tensor; got {t.dtype}")


def check_temperature_value(t, family: str, heads: int = 1) -> None:
    """A tensor τ's shape, and (while validating, eagerly) that every entry is > 0."""
    if not isinstance(t, torch.Tensor):
        return
    check_temperature_shape(t, heads, f"edge family {family!r}")
    if checks_on() and not passes((t > 0).all()):
        got = t.detach().reshape(-1).tolist()
        got = f"{got[0]:g}" if len(got) == 1 else "[" + ", ".join(f"{v:g}" for v in got) + "]"
        raise ValueError(f"edge family {family!r}: temperature must be > 0; got {got}")


def per_head(t, like: torch.Tensor, trailing: int):
    """τ ready to divide a tensor like ``like`` whose heads dim sits ``trailing`` dims from the
    end: a float as it is; a tensor in ``like``'s dtype and device, one number as a 0-dim
    tensor, one per head as ``(H, 1, …, 1)``."""
    if not isinstance(t, torch.Tensor):
        return t
    t = t.to(dtype=like.dtype, device=like.device)
    if t.numel() == 1:
        return t.reshape(())
    return t.reshape(t.shape[0], *([1] * trailing))


def weighted(g: torch.Tensor, weight, t, trailing: int = 2) -> torch.Tensor:
    """``weight · g / τ`` (τ per head, its heads dim ``trailing`` dims from the end), in one
    multiplication when τ and the weight are numbers — none when ``weight / τ`` is one, up to
    the rounding of computing it (e.g. a Hopfield state's prior variance 1/β over τ = 1/β)."""
    if not isinstance(t, torch.Tensor) and not isinstance(weight, torch.Tensor):
        c = weight / t
        return g if math.isclose(c, 1.0, rel_tol=4e-16, abs_tol=0.0) else g * c
    g = g / per_head(t, g, trailing)
    return g if isinstance(weight, float) and weight == 1.0 else g * weight


def inverse(t):
    """1/τ as a potential's ``factor_scale``: a float, a 0-dim tensor, or one per head as
    ``(H, 1, 1)`` (broadcasting against ``(*batch, H, C, k)`` factors and ``(*batch, H, C, P)``
    scores). A tensor keeps τ's dtype: whoever multiplies by it casts it."""
    if not isinstance(t, torch.Tensor):
        return 1.0 / t
    return 1.0 / (t.reshape(()) if t.numel() == 1 else t.reshape(t.shape[0], 1, 1))


def per_feature(t, heads: int, features: int, like: torch.Tensor):
    """τ for a ``(…, heads*d)`` feature vector (heads concatenated): a float or 0-dim tensor
    as it is, one per head repeated over each head's d features."""
    t = per_head(t, like, 0)
    if not isinstance(t, torch.Tensor) or t.dim() == 0:
        return t
    return t.repeat_interleave(features // heads)


def describe_temperature(t) -> str:
    """τ for a drawing's label: ``0.5`` or ``[0.5, 2]`` (one per head)."""
    if isinstance(t, torch.Tensor):
        v = t.detach().reshape(-1).tolist()
        return f"{v[0]:.3g}" if len(v) == 1 else "[" + ", ".join(f"{x:.3g}" for x in v) + "]"
    return f"{float(t):.3g}"
