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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._tiles import dot, load_row, load_tile, scalar, settings, statistics, store_tile, width


@triton.jit
def _allowed(rows, cols, C, P, CAUSAL: tl.constexpr):
    """Which (child, parent) pairs of a block are on the support."""
    allowed = (cols[None, :] < P) & (rows[:, None] < C)
    if CAUSAL:
        allowed = allowed & (cols[None, :] <= rows[:, None])
    return allowed


@triton.jit
def _tile(a, B, H, g, rows, cols, ks, sbg, sbp, sbk, shg, shp, C, P, K, scale,
          CAUSAL: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """A block's scores s_ij + h_j ``(BM, BN)`` (−∞ off the support) and its parents' b."""
    b = load_tile(B, g, sbg, cols, sbp, P, ks, sbk, K)
    h = load_row(H, g, shg, cols, shp, P)
    s = dot(a, tl.trans(b), PRECISION, UPCAST) * scale + h[None, :]
    return tl.where(_allowed(rows, cols, C, P, CAUSAL), s, -float("inf")), b


@triton.jit
def _forward(A, B, U, H, O, LSE, SCALE, C, P, K, D,
             sag, sac, sak, sbg, sbp, sbk, sug, sup, sud, shg, shp, sog, soc, sod, slg, slc,
             CAUSAL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
             BD: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr,
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
    end = tl.minimum(m * BM + BM, P) if CAUSAL else P
    for start in range(0, end, BN):
        cols = start + tl.arange(0, BN)
        s, b = _tile(a, B, H, g, rows, cols, ks, sbg, sbp, sbk, shg, shp, C, P, K, scale,
                     CAUSAL, PRECISION, UPCAST)
        new = tl.maximum(top, tl.max(s, axis=1))
        safe = tl.where(new == -float("inf"), 0.0, new)  # a row with nothing yet
        p = tl.exp(s - safe[:, None])
        shrink = tl.exp(top - safe)
        u = load_tile(U, g, sug, cols, sup, P, ds, sud, D)
        total = total * shrink + tl.sum(p, axis=1)
        acc = acc * shrink[:, None] + dot(p.to(u.dtype), u, PRECISION, UPCAST)
        top = new
    total = tl.where(rmask, total, 1.0)  # rows past the last child: nothing to divide
    top = tl.where(rmask, top, 0.0)
    store_tile(O, acc / total[:, None], g, sog, rows, soc, C, ds, sod, D)
    tl.store(LSE + g * slg + rows * slc, top + tl.log(total), mask=rmask)


@triton.jit
def _children_backward(A, B, U, H, DO, LSE, DELTA, DA, SCALE, C, P, K, D,
                       sag, sac, sak, sbg, sbp, sbk, sug, sup, sud, shg, shp, sdg, sdc, sdd,
                       slg, slc, CAUSAL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                       BK: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr,
                       PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """da per block of children."""
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
    end = tl.minimum(m * BM + BM, P) if CAUSAL else P
    for start in range(0, end, BN):
        cols = start + tl.arange(0, BN)
        s, b = _tile(a, B, H, g, rows, cols, ks, sbg, sbp, sbk, shg, shp, C, P, K, scale,
                     CAUSAL, PRECISION, UPCAST)
        p = tl.exp(s - lse[:, None])
        u = load_tile(U, g, sug, cols, sup, P, ds, sud, D)
        dsc = p * (dot(do, tl.trans(u), PRECISION, UPCAST) - delta[:, None])
        da += dot(dsc.to(b.dtype), b, PRECISION, UPCAST)
    store_tile(DA, da * scale, g, sag, rows, sac, C, ks, sak, K)


@triton.jit
def _parents_backward(A, B, U, H, DO, LSE, DELTA, DB, DU, DH, SCALE, C, P, K, D,
                      sag, sac, sak, sbg, sbp, sbk, sug, sup, sud, shg, shp, sdg, sdc, sdd,
                      slg, slc, CAUSAL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                      BK: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr,
                      PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """db, du and dh per block of parents, reading the children that see them."""
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
    first = (n * BN // BM) * BM if CAUSAL else 0  # children before the block see none of it
    for start in range(first, C, BM):
        rows = start + tl.arange(0, BM)
        a = load_tile(A, g, sag, rows, sac, C, ks, sak, K)
        do = load_tile(DO, g, sdg, rows, sdc, C, ds, sdd, D)
        lse = load_row(LSE, g, slg, rows, slc, C)
        delta = load_row(DELTA, g, slg, rows, slc, C)
        s = dot(a, tl.trans(b), PRECISION, UPCAST) * scale + h[None, :]
        p = tl.exp(tl.where(_allowed(rows, cols, C, P, CAUSAL), s - lse[:, None],
                            -float("inf")))
        dsc = p * (dot(do, tl.trans(u), PRECISION, UPCAST) - delta[:, None])
        du += dot(tl.trans(p.to(do.dtype)), do, PRECISION, UPCAST)
        db += dot(tl.trans(dsc.to(a.dtype)), a, PRECISION, UPCAST)
        dh += tl.sum(dsc, axis=0)
    store_tile(DB, db * scale, g, sbg, cols, sbp, P, ks, sbk, K)
    store_tile(DU, du, g, sug, cols, sup, P, ds, sud, D)
    tl.store(DH + g * shg + cols * shp, dh, mask=cols < P)


@torch.library.custom_op("structattn_triton::key_bias_forward", mutates_args=())
def forward(a: torch.Tensor, b: torch.Tensor, u: torch.Tensor, h: torch.Tensor, scale: float,
            causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out (G, C, D), lse (G, C))`` for ``a (G, C, K)``, ``b (G, P, K)``, ``u (G, P, D)`` of
    one float dtype (half precision, float32 or float64) and ``h (G, P)`` in float32 or
    float64; ``lse`` in float32 (float64 for float64 inputs)."""
    G, C, K = a.shape
    P, D = b.shape[1], u.shape[2]
    out = u.new_empty(G, C, D)
    lse = a.new_empty(G, C, dtype=statistics(a.dtype))
    if C and G:
        common = _common(a.dtype, K, D, causal)
        _forward[(triton.cdiv(C, common["BM"]), G)](
            a, b, u, h, out, lse, scalar(scale, a), C, P, K, D, *a.stride(), *b.stride(),
            *u.stride(), *h.stride(), *out.stride(), *lse.stride(), **common)
    return out, lse




def _common(dtype: torch.dtype, K: int, D: int, causal: bool, children: int = 128,
            parents: int = 64) -> dict:
    BK, BD = width(K), width(D)
    return dict(settings(dtype, max(BK, BD), children, parents), CAUSAL=causal, BK=BK, BD=BD)


@forward.register_fake
def _(a, b, u, h, scale, causal):
    return (u.new_empty(a.shape[0], a.shape[1], u.shape[2]),
            a.new_empty(a.shape[:2], dtype=statistics(a.dtype)))


@torch.library.custom_op("structattn_triton::key_bias_backward", mutates_args=())
def backward(dout: torch.Tensor, a: torch.Tensor, b: torch.Tensor, u: torch.Tensor,
             h: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, scale: float,
             causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
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
        common = _common(a.dtype, K, D, causal, 64, 64)
        scale = scalar(scale, a)
        _children_backward[(triton.cdiv(C, common["BM"]), G)](
            a, b, u, h, dout, lse, delta, da, scale, C, P, K, D, *strides, **common)
        _parents_backward[(triton.cdiv(P, common["BN"]), G)](
            a, b, u, h, dout, lse, delta, db, du, dh, scale, C, P, K, D, *strides, **common)
    return da, db, du, dh.to(h.dtype)


@backward.register_fake
def _(dout, a, b, u, h, out, lse, scale, causal):
    return (torch.empty_like(a), torch.empty_like(b), torch.empty_like(u),
            torch.empty_like(h))


def _setup(ctx, inputs, output):
    a, b, u, h, scale, causal = inputs
    out, lse = output
    ctx.save_for_backward(a, b, u, h, out, lse)
    ctx.scale, ctx.causal = scale, causal
    ctx.mark_non_differentiable(lse)


def _backward_rule(ctx, dout, _):
    a, b, u, h, out, lse = ctx.saved_tensors
    da, db, du, dh = backward(dout, a, b, u, h, out, lse, ctx.scale, ctx.causal)
    return da, db, du, dh, None, None


forward.register_autograd(_backward_rule, setup_context=_setup)
