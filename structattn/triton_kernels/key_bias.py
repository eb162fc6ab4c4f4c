"""Attention under a log prior g_i + h_j in Triton, forward and backward with h's gradient.

``out_i = Σ_j softmax_j(scale·⟨a_i, b_j⟩ + h_j) u_j`` over j ≤ i (``causal``) or every j: g_i
drops out of the softmax. FoX's forget gate (h_j = −Σ_{l≤j} log f_l) and ALiBi (h_j = m·j)
are such priors. FlashAttention's scheme with h added to each block's scores: the forward
keeps a running maximum and sum per child (online softmax) and stores log Σ_j e^{s_ij}
(``lse``); the backward recomputes each block's probabilities from it, with
Δ_i = dout_i·out_i:

    ds_ij = p_ij (dout_i·u_j − Δ_i),   dh_j = Σ_i ds_ij,   da_i = scale Σ_j ds_ij b_j,
    db_j = scale Σ_i ds_ij a_i,        du_j = Σ_i p_ij dout_i.

One kernel per block of children (the output, then da), one per block of parents (db, du
and dh): no atomics, never the C×P table. Causal children are aligned at the first token
(j ≤ i), as ``scaled_dot_product_attention``'s ``is_causal``.

Half precision: the factors enter the products in their dtype, scores, h and sums are
float32, and the output is rounded to the factors' dtype. Δ_i = dout_i·out_i then misses the
backward's own Σ_j p_ij dout_i·u_j by eps·|out_i|, and since Σ_j ds_ij = Σ_j p_ij dout_i·u_j
− Δ_i, every dh_j inherits it: Σ_j dh_j, zero in exact arithmetic, drifts, and a prior whose
h is a cumulative sum (FoX: ∂L/∂log f_l = Σ_{j<l} dh_j) gets gate gradients several times
farther from float64's than PyTorch's own reading in that dtype. So the children's kernel
sums Σ_j p_ij dout_i·u_j on its way (no product more) and the parents' kernel reads that as
Δ_i; in float32 and float64 the output is exact enough and Δ_i stays dout_i·out_i.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._tiles import (
    dot,
    load_row,
    load_tile,
    online_softmax,
    scalar,
    statistics,
    store_tile,
)
from .key_bias_launch import TUNED as TUNED  # benchmarks/tune_key_bias.py fills it
from .key_bias_launch import common as _common


@triton.jit
def _allowed(rows, cols, C, P, w, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr):
    """Which (child, parent) pairs of a block are on the support (``WINDOWED``: i − w ≤ j)."""
    allowed = (cols[None, :] < P) & (rows[:, None] < C)
    if CAUSAL:
        allowed = allowed & (cols[None, :] <= rows[:, None])
    if WINDOWED:
        allowed = allowed & (cols[None, :] >= rows[:, None] - w)
    return allowed


@triton.jit
def _window(WIN, g, WINDOWED: tl.constexpr):
    """Row ``g``'s window w (distances 0..w read), 0 when not ``WINDOWED``."""
    if WINDOWED:
        return tl.load(WIN + g)
    else:
        return tl.full([], 0, tl.int32)


@triton.jit
def _first_parent(m, w, BM: tl.constexpr, BN: tl.constexpr, WINDOWED: tl.constexpr):
    """The first parent a block of children reads (its window's start), on a block edge."""
    if WINDOWED:
        return (tl.maximum(m * BM - w, 0) // BN) * BN
    else:
        return tl.full([], 0, tl.int32)


@triton.jit
def _tile(a, B, H, g, rows, cols, ks, sbg, sbp, sbk, shg, shp, C, P, K, scale, w,
          CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, MASKED: tl.constexpr,
          PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """A block's scores s_ij + h_j ``(BM, BN)`` (``MASKED``: −∞ off the support; a block
    inside it for every child skips the mask) and its parents' b."""
    b = load_tile(B, g, sbg, cols, sbp, P, ks, sbk, K)
    h = load_row(H, g, shg, cols, shp, P)
    s = dot(a, tl.trans(b), PRECISION, UPCAST) * scale + h[None, :]
    if MASKED:
        s = tl.where(_allowed(rows, cols, C, P, w, CAUSAL, WINDOWED), s, -float("inf"))
    return s, b


@triton.jit
def _parent_spans(m, w, C, P, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr):
    """A block of children's parents as three spans of whole blocks ``lo ≤ inner_lo ≤
    inner_hi ≤ end``: [lo, inner_lo) crosses some child's window edge, [inner_lo, inner_hi)
    lies on every child's support (no mask), [inner_hi, end) crosses the diagonal or the
    last parent."""
    lo = _first_parent(m, w, BM, BN, WINDOWED)
    if CAUSAL:
        end = tl.minimum(m * BM + BM, P)
        inner_hi = tl.minimum((m * BM // BN) * BN, end)  # blocks ending before the first child
    else:
        end = P
        inner_hi = (P // BN) * BN
    inner_lo = lo
    if WINDOWED:  # blocks starting at or after the last child's window start
        edge = tl.maximum(m * BM + BM - 1 - w, 0)
        inner_lo = tl.minimum(tl.maximum((edge + BN - 1) // BN * BN, lo), inner_hi)
    return lo, inner_lo, inner_hi, end


@triton.jit
def _forward_span(acc, top, total, a, B, U, H, g, rows, ks, ds, lo, hi, sbg, sbp, sbk, sug, sup,
                  sud, shg, shp, C, P, K, D, scale, w, CAUSAL: tl.constexpr,
                  WINDOWED: tl.constexpr, MASKED: tl.constexpr, BN: tl.constexpr,
                  PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """The online softmax over the parent blocks [lo, hi)."""
    for start in range(lo, hi, BN):
        cols = start + tl.arange(0, BN)
        s, b = _tile(a, B, H, g, rows, cols, ks, sbg, sbp, sbk, shg, shp, C, P, K, scale, w,
                     CAUSAL, WINDOWED, MASKED, PRECISION, UPCAST)
        p, shrink, new = online_softmax(s, top)
        u = load_tile(U, g, sug, cols, sup, P, ds, sud, D)
        total = total * shrink + tl.sum(p, axis=1)
        acc = acc * shrink[:, None] + dot(p.to(u.dtype), u, PRECISION, UPCAST)
        top = new
    return acc, top, total


@triton.jit
def _forward(A, B, U, H, O, LSE, SCALE, WIN, C, P, K, D,
             sag, sac, sak, sbg, sbp, sbk, sug, sup, sud, shg, shp, sog, soc, sod, slg, slc,
             CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
             BK: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr,
             UPCAST: tl.constexpr):
    scale = tl.load(SCALE)  # in the accumulators' dtype (a float argument is float32)
    m = tl.program_id(0)
    g = tl.program_id(1)
    rows = m * BM + tl.arange(0, BM)
    ks = tl.arange(0, BK)
    ds = tl.arange(0, BD)
    rmask = rows < C
    a = load_tile(A, g, sag, rows, sac, C, ks, sak, K)
    top = tl.full([BM], -float("inf"), dtype=ACC)  # running max
    total = tl.zeros([BM], dtype=ACC)  # running Σ e^{s − top}
    acc = tl.zeros([BM, BD], dtype=ACC)
    w = _window(WIN, g, WINDOWED)
    lo, inner_lo, inner_hi, end = _parent_spans(m, w, C, P, CAUSAL, WINDOWED, BM, BN)
    acc, top, total = _forward_span(acc, top, total, a, B, U, H, g, rows, ks, ds, lo, inner_lo,
                                    sbg, sbp, sbk, sug, sup, sud, shg, shp, C, P, K, D, scale, w,
                                    CAUSAL, WINDOWED, True, BN, PRECISION, UPCAST)
    acc, top, total = _forward_span(acc, top, total, a, B, U, H, g, rows, ks, ds, inner_lo,
                                    inner_hi, sbg, sbp, sbk, sug, sup, sud, shg, shp, C, P, K, D,
                                    scale, w, CAUSAL, WINDOWED, False, BN, PRECISION, UPCAST)
    acc, top, total = _forward_span(acc, top, total, a, B, U, H, g, rows, ks, ds, inner_hi, end,
                                    sbg, sbp, sbk, sug, sup, sud, shg, shp, C, P, K, D, scale, w,
                                    CAUSAL, WINDOWED, True, BN, PRECISION, UPCAST)
    total = tl.where(rmask, total, 1.0)  # rows past the last child: nothing to divide
    top = tl.where(rmask, top, 0.0)
    store_tile(O, acc / total[:, None], g, sog, rows, soc, C, ds, sod, D)
    tl.store(LSE + g * slg + rows * slc, top + tl.log(total), mask=rmask)


@triton.jit
def _children_span(da, spent, a, do, lse, delta, B, U, H, g, rows, ks, ds, lo, hi, sbg, sbp,
                   sbk, sug, sup, sud, shg, shp, C, P, K, D, scale, w, CAUSAL: tl.constexpr,
                   WINDOWED: tl.constexpr, MASKED: tl.constexpr, BN: tl.constexpr,
                   PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """da's terms from the parent blocks [lo, hi), and Σ_j p_ij dout_i·u_j over them
    (``spent``: Δ_i as the backward's own products give it)."""
    for start in range(lo, hi, BN):
        cols = start + tl.arange(0, BN)
        s, b = _tile(a, B, H, g, rows, cols, ks, sbg, sbp, sbk, shg, shp, C, P, K, scale, w,
                     CAUSAL, WINDOWED, MASKED, PRECISION, UPCAST)
        p = tl.exp(s - lse[:, None])
        u = load_tile(U, g, sug, cols, sup, P, ds, sud, D)
        dpu = dot(do, tl.trans(u), PRECISION, UPCAST)
        dsc = p * (dpu - delta[:, None])
        spent += tl.sum(p * dpu, axis=1)
        da += dot(dsc.to(b.dtype), b, PRECISION, UPCAST)
    return da, spent


@triton.jit
def _children_backward(A, B, U, H, DO, LSE, DELTA, DA, SCALE, WIN, C, P, K, D,
                       sag, sac, sak, sbg, sbp, sbk, sug, sup, sud, shg, shp, sdg, sdc, sdd,
                       slg, slc, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr,
                       ACC: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                       RESUM: tl.constexpr):
    """da per block of children; then (``RESUM``: half precision) Δ_i = Σ_j p_ij dout_i·u_j
    into ``DELTA`` for the parents' kernel (module docstring)."""
    scale = tl.load(SCALE)  # in the accumulators' dtype (a float argument is float32)
    m = tl.program_id(0)
    g = tl.program_id(1)
    rows = m * BM + tl.arange(0, BM)
    ks = tl.arange(0, BK)
    ds = tl.arange(0, BD)
    a = load_tile(A, g, sag, rows, sac, C, ks, sak, K)
    do = load_tile(DO, g, sdg, rows, sdc, C, ds, sdd, D)
    lse = load_row(LSE, g, slg, rows, slc, C)
    delta = load_row(DELTA, g, slg, rows, slc, C)
    da = tl.zeros([BM, BK], dtype=ACC)
    spent = tl.zeros([BM], dtype=ACC)
    w = _window(WIN, g, WINDOWED)
    lo, inner_lo, inner_hi, end = _parent_spans(m, w, C, P, CAUSAL, WINDOWED, BM, BN)
    da, spent = _children_span(da, spent, a, do, lse, delta, B, U, H, g, rows, ks, ds, lo,
                               inner_lo, sbg, sbp, sbk, sug, sup, sud, shg, shp, C, P, K, D,
                               scale, w, CAUSAL, WINDOWED, True, BN, PRECISION, UPCAST)
    da, spent = _children_span(da, spent, a, do, lse, delta, B, U, H, g, rows, ks, ds, inner_lo,
                               inner_hi, sbg, sbp, sbk, sug, sup, sud, shg, shp, C, P, K, D,
                               scale, w, CAUSAL, WINDOWED, False, BN, PRECISION, UPCAST)
    da, spent = _children_span(da, spent, a, do, lse, delta, B, U, H, g, rows, ks, ds, inner_hi,
                               end, sbg, sbp, sbk, sug, sup, sud, shg, shp, C, P, K, D, scale,
                               w, CAUSAL, WINDOWED, True, BN, PRECISION, UPCAST)
    store_tile(DA, da * scale, g, sag, rows, sac, C, ks, sak, K)
    if RESUM:
        tl.store(DELTA + g * slg + rows * slc, spent, mask=rows < C)


@triton.jit
def _parents_span(db, du, dh, b, u, h, cols, A, DO, LSE, DELTA, g, ks, ds, lo, hi, sag, sac, sak,
                  sdg, sdc, sdd, slg, slc, C, P, K, D, scale, w, CAUSAL: tl.constexpr,
                  WINDOWED: tl.constexpr, MASKED: tl.constexpr, BM: tl.constexpr,
                  PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """db, du and dh's terms from the child blocks [lo, hi)."""
    for start in range(lo, hi, BM):
        rows = start + tl.arange(0, BM)
        a = load_tile(A, g, sag, rows, sac, C, ks, sak, K)
        do = load_tile(DO, g, sdg, rows, sdc, C, ds, sdd, D)
        lse = load_row(LSE, g, slg, rows, slc, C)
        delta = load_row(DELTA, g, slg, rows, slc, C)
        s = dot(a, tl.trans(b), PRECISION, UPCAST) * scale + h[None, :] - lse[:, None]
        if MASKED:
            s = tl.where(_allowed(rows, cols, C, P, w, CAUSAL, WINDOWED), s, -float("inf"))
        p = tl.exp(s)
        dsc = p * (dot(do, tl.trans(u), PRECISION, UPCAST) - delta[:, None])
        du += dot(tl.trans(p.to(do.dtype)), do, PRECISION, UPCAST)
        db += dot(tl.trans(dsc.to(a.dtype)), a, PRECISION, UPCAST)
        dh += tl.sum(dsc, axis=0)
    return db, du, dh


@triton.jit
def _parents_backward(A, B, U, H, DO, LSE, DELTA, DB, DU, DH, SCALE, WIN, C, P, K, D,
                      sag, sac, sak, sbg, sbp, sbk, sug, sup, sud, shg, shp, sdg, sdc, sdd,
                      slg, slc, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr,
                      ACC: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """db, du and dh per block of parents, reading the children that see them: the child
    blocks crossing the diagonal, then those past it on every parent's support (no mask:
    whole blocks before the last child), then those crossing the window's far edge."""
    scale = tl.load(SCALE)  # in the accumulators' dtype (a float argument is float32)
    n = tl.program_id(0)
    g = tl.program_id(1)
    cols = n * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    ds = tl.arange(0, BD)
    b = load_tile(B, g, sbg, cols, sbp, P, ks, sbk, K)
    u = load_tile(U, g, sug, cols, sup, P, ds, sud, D)
    h = load_row(H, g, shg, cols, shp, P)
    db = tl.zeros([BN, BK], dtype=ACC)
    du = tl.zeros([BN, BD], dtype=ACC)
    dh = tl.zeros([BN], dtype=ACC)
    w = _window(WIN, g, WINDOWED)
    first = (n * BN // BM) * BM if CAUSAL else 0  # children before the block see none of it
    last = tl.minimum(n * BN + BN + w, C) if WINDOWED else C  # nor those beyond its window
    # child blocks after every parent of the block (causal), within C (rows past the last
    # child would read lse = 0: no mask there) and inside every parent's window
    inner_lo = tl.minimum(((n * BN + BN - 1 + BM - 1) // BM) * BM, last) if CAUSAL else first
    inner_hi = tl.maximum(tl.minimum((last // BM) * BM, (C // BM) * BM), inner_lo)
    if WINDOWED:  # blocks whose last child reaches back to the block's first parent
        reach = n * BN + w - BM + 1
        inner_hi = tl.maximum(tl.minimum(inner_hi, tl.where(reach >= 0, (reach // BM + 1) * BM,
                                                            0)), inner_lo)
    db, du, dh = _parents_span(db, du, dh, b, u, h, cols, A, DO, LSE, DELTA, g, ks, ds, first,
                               inner_lo, sag, sac, sak, sdg, sdc, sdd, slg, slc, C, P, K, D, scale,
                               w, CAUSAL, WINDOWED, True, BM, PRECISION, UPCAST)
    db, du, dh = _parents_span(db, du, dh, b, u, h, cols, A, DO, LSE, DELTA, g, ks, ds, inner_lo,
                               inner_hi, sag, sac, sak, sdg, sdc, sdd, slg, slc, C, P, K, D, scale,
                               w, CAUSAL, WINDOWED, False, BM, PRECISION, UPCAST)
    db, du, dh = _parents_span(db, du, dh, b, u, h, cols, A, DO, LSE, DELTA, g, ks, ds, inner_hi,
                               last, sag, sac, sak, sdg, sdc, sdd, slg, slc, C, P, K, D, scale,
                               w, CAUSAL, WINDOWED, True, BM, PRECISION, UPCAST)
    store_tile(DB, db * scale, g, sbg, cols, sbp, P, ks, sbk, K)
    store_tile(DU, du, g, sug, cols, sup, P, ds, sud, D)
    tl.store(DH + g * shg + cols * shp, dh, mask=cols < P)


@torch.library.custom_op("structattn_triton::key_bias_forward", mutates_args=())
def forward(a: torch.Tensor, b: torch.Tensor, u: torch.Tensor, h: torch.Tensor, scale: float,
            causal: bool, window: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out (G, C, D), lse (G, C))`` for ``a (G, C, K)``, ``b (G, P, K)``, ``u (G, P, D)`` of
    one float dtype (half precision, float32 or float64) and ``h (G, P)`` in float32 or
    float64; ``lse`` in float32 (float64 for float64 inputs). ``window`` ``(G,)`` int32, with
    ``causal``: row g's children read the parents i − window_g ≤ j ≤ i only (a band per head)."""
    G, C, K = a.shape
    P, D = b.shape[1], u.shape[2]
    out = u.new_empty(G, C, D)
    lse = a.new_empty(G, C, dtype=statistics(a.dtype))
    if C and G:
        common = _common(a.dtype, K, D, causal, window, device=a.device)
        _forward[(triton.cdiv(C, common["BM"]), G)](
            a, b, u, h, out, lse, scalar(scale, a), _win(window, a), C, P, K, D, *a.stride(),
            *b.stride(), *u.stride(), *h.stride(), *out.stride(), *lse.stride(), **common)
    return out, lse


def _win(window: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """The windows as the kernels read them (int32), or a placeholder where there are none."""
    if window is None:
        return torch.zeros(1, dtype=torch.int32, device=like.device)
    return window.to(torch.int32).contiguous()


@forward.register_fake
def _(a, b, u, h, scale, causal, window=None):
    return (u.new_empty(a.shape[0], a.shape[1], u.shape[2]),
            a.new_empty(a.shape[:2], dtype=statistics(a.dtype)))


@torch.library.custom_op("structattn_triton::key_bias_backward", mutates_args=())
def backward(dout: torch.Tensor, a: torch.Tensor, b: torch.Tensor, u: torch.Tensor,
             h: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, scale: float,
             causal: bool, window: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(da, db, du, dh)`` of ``forward``'s output against ``dout``."""
    G, C, K = a.shape
    P, D = b.shape[1], u.shape[2]
    dout = dout.contiguous()
    stat = statistics(a.dtype)
    delta = (dout.to(stat) * out.to(stat)).sum(-1).contiguous()  # Δ_i, laid out as lse
    lse = lse.contiguous()
    da, db, du = torch.zeros_like(a), torch.zeros_like(b), torch.zeros_like(u)
    dh = torch.zeros_like(h, dtype=stat)
    if C and G and P:
        strides = (*a.stride(), *b.stride(), *u.stride(), *h.stride(), *dout.stride(),
                   *lse.stride())
        # da per block of children, then db, du, dh per block of parents: square blocks,
        # each program holding more accumulators than the forward's
        children = _common(a.dtype, K, D, causal, window, 64, 64, "children", a.device)
        parents = _common(a.dtype, K, D, causal, window, 64, 64, "parents", a.device)
        scale, win = scalar(scale, a), _win(window, a)
        _children_backward[(triton.cdiv(C, children["BM"]), G)](
            a, b, u, h, dout, lse, delta, da, scale, win, C, P, K, D, *strides, **children,
            RESUM=a.dtype in (torch.float16, torch.bfloat16))
        _parents_backward[(triton.cdiv(P, parents["BN"]), G)](
            a, b, u, h, dout, lse, delta, db, du, dh, scale, win, C, P, K, D, *strides,
            **parents)
    return da, db, du, dh.to(h.dtype)


@backward.register_fake
def _(dout, a, b, u, h, out, lse, scale, causal, window=None):
    return (torch.empty_like(a), torch.empty_like(b), torch.empty_like(u),
            torch.empty_like(h))


def _setup(ctx, inputs, output):
    a, b, u, h, scale, causal, window = inputs
    out, lse = output
    ctx.save_for_backward(a, b, u, h, out, lse, window)
    ctx.scale, ctx.causal = scale, causal
    ctx.mark_non_differentiable(lse)


def _backward_rule(ctx, dout, _):
    a, b, u, h, out, lse, window = ctx.saved_tensors
    da, db, du, dh = backward(dout, a, b, u, h, out, lse, ctx.scale, ctx.causal, window)
    return da, db, du, dh, None, None, None


forward.register_autograd(_backward_rule, setup_context=_setup)
