"""The argument and value checks of graph attention (``structattn.operators.segment``): each raises a
ValueError naming the argument, the expected and the actual shape, dtype, device or value."""

from __future__ import annotations

import math

import torch

from ..checking._validation import checks_on, passes, same_device, shape_str

_EMPTY_MODES = ("error", "zero")


def _check_values(src, dst, num_parents: int, num_children: int, empty: str, who: str,
                  bias: torch.Tensor | None = None) -> None:
    """Index ranges, bias values and childless children: a pass over the edge list and one sync.

    Skipped under ``torch.compile`` and with ``structattn.set_validation(False)``;
    then out-of-range indices are undefined behaviour and childless children get a
    zero output whatever ``empty`` says. A child whose edges all have bias −∞ counts
    as childless. ``bias``: ``(G, E)``.
    """
    if not checks_on():
        return
    if src.numel() > 0 and not passes(((src >= 0) & (src < num_parents)).all()
                                      & ((dst >= 0) & (dst < num_children)).all()):
        lo_s, hi_s, lo_d, hi_d = torch.stack([src.min(), src.max(), dst.min(), dst.max()]).tolist()
        for name, lo, hi, n, what in (("src", lo_s, hi_s, num_parents, "parents P"),
                                      ("dst", lo_d, hi_d, num_children, "children C")):
            if lo < 0 or hi >= n:
                bad = lo if lo < 0 else hi
                raise ValueError(
                    f"{who}: {name} must hold indices in [0, {n}) ({what} = {n}); got a value {bad} "
                    f"(min {lo}, max {hi})"
                )
    if bias is not None and not passes(~(bias.isnan() | bias.isposinf()).any()):
        raise ValueError(f"{who}: bias must hold finite values or -inf (an edge outside the "
                         f"support); got NaN or +inf")
    if empty == "error" and num_children > 0:
        if bias is None:
            # index_fill_ (unlike bincount) stays legal under torch.use_deterministic_algorithms
            missing = torch.ones(num_children, dtype=torch.bool, device=dst.device).index_fill_(0, dst, False)
        else:  # (G, C): no incoming edge of finite bias
            finite = (~bias.isneginf()).to(torch.int32)
            counts = finite.new_zeros(finite.shape[0], num_children).index_add_(1, dst, finite)
            missing = counts == 0
        if not passes(~missing.any()):
            n_missing = int(missing.sum())
            first = int(missing.nonzero()[0, -1])
            raise ValueError(
                f"{who}: child {first} has no incoming edge{' of finite bias' if bias is not None else ''} "
                f"({n_missing} of {missing.numel()} children have none); every child needs at least "
                f"one parent in (src, dst) for its softmax to be defined. Pass empty='zero' to give "
                f"such children a zero output."
            )


def _prepare(a, b, v, src, dst, num_children, scale, chunk_size, empty, who, bias=None, checked=False):
    """Validate; return flattened ``(a, b, v, bias, src, dst, scale, lead)`` with a/b/v as
    (G, ·, ·) and bias (G, E) or None. ``checked``: the caller has already checked the
    values of the edge list (ranges, childless children), so they are not checked again."""
    lead, C, P, k = _check_factors(a, b, v, src, dst, num_children, who)
    _check_edges(src, dst, a, who)
    _check_options(scale, chunk_size, empty, who)
    E = src.shape[0]
    _check_bias(bias, a, lead, E, who)
    G = math.prod(lead)
    if bias is not None:
        bias = bias.expand(*lead, E).reshape(G, E)
    if not checked:
        _check_values(src, dst, P, C, empty, who, bias)
    a = a.reshape(G, C, k)
    b = b.reshape(G, P, k)
    v = v.reshape(G, P, v.shape[-1])
    return a, b, v, bias, src, dst, scale, lead


def _check_factors(a, b, v, src, dst, num_children, who: str) -> tuple:
    """a, b, v (and src, dst) tensors of the documented shapes, one float dtype, one device,
    the same leading dims; ``(lead, C, P, k)``."""
    for name, t in (("a", a), ("b", b), ("v", v), ("src", src), ("dst", dst)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{who}: {name} must be a torch.Tensor; got {type(t).__name__}")
    for name, t, want in (("a", a, "(*lead, C, k)"), ("b", b, "(*lead, P, k)"), ("v", v, "(*lead, P, d_v)")):
        if t.dim() < 2:
            raise ValueError(
                f"{who}: {name} must have shape {want} (at least 2 dims); got {shape_str(t.shape)}"
            )
        if not t.is_floating_point():
            raise ValueError(f"{who}: {name} must be floating point; got dtype {t.dtype}")
    if not (a.dtype == b.dtype == v.dtype):
        raise ValueError(
            f"{who}: a, b and v must share a dtype; got a {a.dtype}, b {b.dtype}, v {v.dtype}"
        )
    if not (same_device(a.device, b.device) and same_device(a.device, v.device)):
        raise ValueError(
            f"{who}: a, b and v must be on one device; got a on {a.device}, b on {b.device}, v on {v.device}"
        )
    lead = a.shape[:-2]
    if b.shape[:-2] != lead or v.shape[:-2] != lead:
        raise ValueError(
            f"{who}: a, b and v must share leading dims; got a {shape_str(a.shape)} (lead "
            f"{shape_str(lead)}), b {shape_str(b.shape)} (lead {shape_str(b.shape[:-2])}), v "
            f"{shape_str(v.shape)} (lead {shape_str(v.shape[:-2])})"
        )
    if isinstance(num_children, bool) or not isinstance(num_children, (int, torch.SymInt)):
        raise ValueError(f"{who}: num_children must be an int; got {type(num_children).__name__}")
    C, k = a.shape[-2], a.shape[-1]
    if C != num_children:
        raise ValueError(
            f"{who}: a must have shape (*lead, num_children={num_children}, k); got {shape_str(a.shape)}"
        )
    if b.shape[-1] != k:
        raise ValueError(
            f"{who}: a and b must share their last (feature) dim; got a {shape_str(a.shape)}, "
            f"b {shape_str(b.shape)}"
        )
    P = b.shape[-2]
    if v.shape[-2] != P:
        raise ValueError(
            f"{who}: v must have shape (*lead, P={P}, d_v) with P = b.shape[-2]; got v {shape_str(v.shape)}, "
            f"b {shape_str(b.shape)}"
        )
    return lead, C, P, k


def _check_edges(src, dst, a, who: str) -> None:
    """src and dst: 1-D int64 edge lists of one length, on a's device."""
    for name, t in (("src", src), ("dst", dst)):
        if t.dtype != torch.long:
            raise ValueError(f"{who}: {name} must have dtype torch.int64 (long); got {t.dtype}")
        if t.dim() != 1:
            raise ValueError(f"{who}: {name} must be 1-D (E,); got shape {shape_str(t.shape)}")
        if not same_device(t.device, a.device):
            raise ValueError(f"{who}: {name} must be on a's device {a.device}; got {t.device}")
    if src.shape != dst.shape:
        raise ValueError(
            f"{who}: src and dst must have equal length E; got src {shape_str(src.shape)}, "
            f"dst {shape_str(dst.shape)}"
        )


def _check_options(scale, chunk_size, empty, who: str) -> None:
    """scale a float or a 0-dim float tensor; chunk_size a positive int or None; empty a mode
    of ``_EMPTY_MODES``."""
    if isinstance(scale, torch.Tensor):
        if scale.dim() != 0:
            raise ValueError(
                f"{who}: scale must be a float or a 0-dim tensor; got shape {shape_str(scale.shape)}"
            )
        if not scale.is_floating_point():
            raise ValueError(f"{who}: scale tensor must be floating point; got dtype {scale.dtype}")
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ValueError(f"{who}: scale must be a float or a 0-dim tensor; got {type(scale).__name__}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                   or chunk_size < 1):
        raise ValueError(f"{who}: chunk_size must be a positive int or None (auto); got {chunk_size!r}")
    if empty not in _EMPTY_MODES:
        raise ValueError(f"{who}: empty must be one of {_EMPTY_MODES}; got {empty!r}")


def _check_bias(bias, a, lead, E: int, who: str) -> None:
    """bias None, or a tensor of a's dtype and device broadcasting to (*lead, E)."""
    if bias is None:
        return
    if not isinstance(bias, torch.Tensor) or bias.dtype != a.dtype:
        got = bias.dtype if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise ValueError(f"{who}: bias must be a tensor of a's dtype {a.dtype}; got {got}")
    if not same_device(bias.device, a.device):
        raise ValueError(f"{who}: bias must be on a's device {a.device}; got {bias.device}")
    try:
        ok = tuple(torch.broadcast_shapes(bias.shape, (*lead, E))) == (*lead, E)
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(f"{who}: bias must broadcast to (*lead, E)={shape_str((*lead, E))}; "
                         f"got {shape_str(bias.shape)}")
