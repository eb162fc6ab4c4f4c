"""Attention under a generalised Gaussian over the distance in Triton, its bias computed per tile.

``out_i = Σ_j softmax_j(scale·⟨a_i, b_j⟩ − |(i − j − μ_g)·e^{s_g}|^{β_g}) u_j`` over j ≤ i
(``causal``) or every j, with one (μ, s, β) per row g (a head of a batch): BAM's prior. The
log prior is a function of the distance alone, not a sum g_i + h_j, so the key-bias kernels'
per-parent term does not hold it; here each block of scores computes it from its pairs'
distances and the row's three parameters, in float32 (float64 for float64 inputs): never a
C×P table. The blocks, spans and band per row are the key-bias kernels' (``key_bias.py``),
and so is the backward, with Δ_i = dout_i·out_i and ds_ij = p_ij (dout_i·u_j − Δ_i); the
parameters' gradients are sums over the pairs of ds_ij times the prior's derivatives, with
y = z^β and z = |(d − μ)·e^s|:

    ∂/∂μ = β·y / (d − μ),   ∂/∂s = −β·y,   ∂/∂β = −y·log z   (each 0 where z = 0),

summed by each block of parents over its children and stored per parent; the op sums them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._tiles import dot, load_row, load_tile, online_softmax, scalar, statistics, store_tile
from .key_bias import _allowed, _parent_spans, _win, _window
from .key_bias_launch import common as _common


@triton.jit
def _log_prior(rows, cols, mu, es, beta, ACC: tl.constexpr):
    """``(−y, y, log₂ z)`` at a block's pairs ``(BM, BN)``: the log prior −y = −z^β =
    −2^{β·log₂ z} with z = |(i − j − μ)·e^s| (y = 0 where z = 0, as
    ``GeneralisedGaussian.log_at_distance``; log₂ z is 0 there)."""
    d = (rows[:, None] - cols[None, :]).to(ACC)
    z = tl.abs((d - mu) * es)
    pos = z > 0
    lz = tl.log2(tl.where(pos, z, 1.0))
    y = tl.where(pos, tl.exp2(beta * lz), 0.0)
    return -y, y, lz


@triton.jit
def _params(PRIOR, g, spg):
    """Row g's (μ, e^s, β) from ``PRIOR (G, 3)`` = (μ, s, β)."""
    return tl.load(PRIOR + g * spg), tl.exp(tl.load(PRIOR + g * spg + 1)), \
        tl.load(PRIOR + g * spg + 2)


@triton.jit
def _tile(a, B, g, rows, cols, ks, sbg, sbp, sbk, C, P, K, scale, w, mu, es, beta,
          CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, MASKED: tl.constexpr,
          PRECISION: tl.constexpr, UPCAST: tl.constexpr, ACC: tl.constexpr):
    """A block's scores s_ij − z_ij^β ``(BM, BN)`` (``MASKED``: −∞ off the support) and its
    parents' b."""
    b = load_tile(B, g, sbg, cols, sbp, P, ks, sbk, K)
    bias, _, _ = _log_prior(rows, cols, mu, es, beta, ACC)
    s = dot(a, tl.trans(b), PRECISION, UPCAST) * scale + bias
    if MASKED:
        s = tl.where(_allowed(rows, cols, C, P, w, CAUSAL, WINDOWED), s, -float("inf"))
    return s, b


@triton.jit
def _forward_span(acc, top, total, a, B, U, g, rows, ks, ds, lo, hi, sbg, sbp, sbk, sug, sup,
                  sud, C, P, K, D, scale, w, mu, es, beta, CAUSAL: tl.constexpr,
                  WINDOWED: tl.constexpr, MASKED: tl.constexpr, BN: tl.constexpr,
                  PRECISION: tl.constexpr, UPCAST: tl.constexpr, ACC: tl.constexpr):
    """The online softmax over the parent blocks [lo, hi)."""
    for start in range(lo, hi, BN):
        cols = start + tl.arange(0, BN)
        s, b = _tile(a, B, g, rows, cols, ks, sbg, sbp, sbk, C, P, K, scale, w, mu, es, beta,
                     CAUSAL, WINDOWED, MASKED, PRECISION, UPCAST, ACC)
        p, shrink, new = online_softmax(s, top)
        u = load_tile(U, g, sug, cols, sup, P, ds, sud, D)
        total = total * shrink + tl.sum(p, axis=1)
        acc = acc * shrink[:, None] + dot(p.to(u.dtype), u, PRECISION, UPCAST)
        top = new
    return acc, top, total


@triton.jit
def _forward(A, B, U, PRIOR, O, LSE, SCALE, WIN, C, P, K, D,
             sag, sac, sak, sbg, sbp, sbk, sug, sup, sud, spg, sog, soc, sod, slg, slc,
             CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
             BK: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr,
             UPCAST: tl.constexpr):
    scale = tl.load(SCALE)
    m = tl.program_id(0)
    g = tl.program_id(1)
    mu, es, beta = _params(PRIOR, g, spg)
    rows = m * BM + tl.arange(0, BM)
    ks = tl.arange(0, BK)
    ds = tl.arange(0, BD)
    rmask = rows < C
    a = load_tile(A, g, sag, rows, sac, C, ks, sak, K)
    top = tl.full([BM], -float("inf"), dtype=ACC)
    total = tl.zeros([BM], dtype=ACC)
    acc = tl.zeros([BM, BD], dtype=ACC)
    w = _window(WIN, g, WINDOWED)
    lo, inner_lo, inner_hi, end = _parent_spans(m, w, C, P, CAUSAL, WINDOWED, BM, BN)
    acc, top, total = _forward_span(acc, top, total, a, B, U, g, rows, ks, ds, lo, inner_lo,
                                    sbg, sbp, sbk, sug, sup, sud, C, P, K, D, scale, w, mu, es,
                                    beta, CAUSAL, WINDOWED, True, BN, PRECISION, UPCAST, ACC)
    acc, top, total = _forward_span(acc, top, total, a, B, U, g, rows, ks, ds, inner_lo,
                                    inner_hi, sbg, sbp, sbk, sug, sup, sud, C, P, K, D, scale, w,
                                    mu, es, beta, CAUSAL, WINDOWED, False, BN, PRECISION, UPCAST,
                                    ACC)
    acc, top, total = _forward_span(acc, top, total, a, B, U, g, rows, ks, ds, inner_hi, end,
                                    sbg, sbp, sbk, sug, sup, sud, C, P, K, D, scale, w, mu, es,
                                    beta, CAUSAL, WINDOWED, True, BN, PRECISION, UPCAST, ACC)
    total = tl.where(rmask, total, 1.0)
    top = tl.where(rmask, top, 0.0)
    store_tile(O, acc / total[:, None], g, sog, rows, soc, C, ds, sod, D)
    tl.store(LSE + g * slg + rows * slc, top + tl.log(total), mask=rmask)


@triton.jit
def _children_span(da, a, do, lse, delta, B, U, g, rows, ks, ds, lo, hi, sbg, sbp, sbk, sug,
                   sup, sud, C, P, K, D, scale, w, mu, es, beta, CAUSAL: tl.constexpr,
                   WINDOWED: tl.constexpr, MASKED: tl.constexpr, BN: tl.constexpr,
                   PRECISION: tl.constexpr, UPCAST: tl.constexpr, ACC: tl.constexpr):
    """da's terms from the parent blocks [lo, hi)."""
    for start in range(lo, hi, BN):
        cols = start + tl.arange(0, BN)
        s, b = _tile(a, B, g, rows, cols, ks, sbg, sbp, sbk, C, P, K, scale, w, mu, es, beta,
                     CAUSAL, WINDOWED, MASKED, PRECISION, UPCAST, ACC)
        p = tl.exp(s - lse[:, None])
        u = load_tile(U, g, sug, cols, sup, P, ds, sud, D)
        dsc = p * (dot(do, tl.trans(u), PRECISION, UPCAST) - delta[:, None])
        da += dot(dsc.to(b.dtype), b, PRECISION, UPCAST)
    return da


@triton.jit
def _children_backward(A, B, U, PRIOR, DO, LSE, DELTA, DA, SCALE, WIN, C, P, K, D,
                       sag, sac, sak, sbg, sbp, sbk, sug, sup, sud, spg, sdg, sdc, sdd,
                       slg, slc, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr,
                       ACC: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """da per block of children."""
    scale = tl.load(SCALE)
    m = tl.program_id(0)
    g = tl.program_id(1)
    mu, es, beta = _params(PRIOR, g, spg)
    rows = m * BM + tl.arange(0, BM)
    ks = tl.arange(0, BK)
    ds = tl.arange(0, BD)
    a = load_tile(A, g, sag, rows, sac, C, ks, sak, K)
    do = load_tile(DO, g, sdg, rows, sdc, C, ds, sdd, D)
    lse = load_row(LSE, g, slg, rows, slc, C)
    delta = load_row(DELTA, g, slg, rows, slc, C)
    da = tl.zeros([BM, BK], dtype=ACC)
    w = _window(WIN, g, WINDOWED)
    lo, inner_lo, inner_hi, end = _parent_spans(m, w, C, P, CAUSAL, WINDOWED, BM, BN)
    da = _children_span(da, a, do, lse, delta, B, U, g, rows, ks, ds, lo, inner_lo, sbg, sbp,
                        sbk, sug, sup, sud, C, P, K, D, scale, w, mu, es, beta, CAUSAL,
                        WINDOWED, True, BN, PRECISION, UPCAST, ACC)
    da = _children_span(da, a, do, lse, delta, B, U, g, rows, ks, ds, inner_lo, inner_hi, sbg,
                        sbp, sbk, sug, sup, sud, C, P, K, D, scale, w, mu, es, beta, CAUSAL,
                        WINDOWED, False, BN, PRECISION, UPCAST, ACC)
    da = _children_span(da, a, do, lse, delta, B, U, g, rows, ks, ds, inner_hi, end, sbg, sbp,
                        sbk, sug, sup, sud, C, P, K, D, scale, w, mu, es, beta, CAUSAL,
                        WINDOWED, True, BN, PRECISION, UPCAST, ACC)
    store_tile(DA, da * scale, g, sag, rows, sac, C, ks, sak, K)


@triton.jit
def _parents_span(db, du, dmu, dls, dbeta, b, u, cols, A, DO, LSE, DELTA, g, ks, ds, lo, hi,
                  sag, sac, sak, sdg, sdc, sdd, slg, slc, C, P, K, D, scale, w, mu, es, beta,
                  CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, MASKED: tl.constexpr,
                  BM: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                  ACC: tl.constexpr):
    """db, du and the parameters' terms from the child blocks [lo, hi)."""
    for start in range(lo, hi, BM):
        rows = start + tl.arange(0, BM)
        a = load_tile(A, g, sag, rows, sac, C, ks, sak, K)
        do = load_tile(DO, g, sdg, rows, sdc, C, ds, sdd, D)
        lse = load_row(LSE, g, slg, rows, slc, C)
        delta = load_row(DELTA, g, slg, rows, slc, C)
        bias, y, lz = _log_prior(rows, cols, mu, es, beta, ACC)
        s = dot(a, tl.trans(b), PRECISION, UPCAST) * scale + bias - lse[:, None]
        if MASKED:
            s = tl.where(_allowed(rows, cols, C, P, w, CAUSAL, WINDOWED), s, -float("inf"))
        p = tl.exp(s)
        dsc = p * (dot(do, tl.trans(u), PRECISION, UPCAST) - delta[:, None])
        du += dot(tl.trans(p.to(do.dtype)), do, PRECISION, UPCAST)
        db += dot(tl.trans(dsc.to(a.dtype)), a, PRECISION, UPCAST)
        # the prior's derivatives where a pair carries a gradient (off the support, or where
        # y overflowed to a zero probability, 0·∞ would be NaN)
        gap = (rows[:, None] - cols[None, :]).to(ACC) - mu
        live = (dsc != 0) & (gap != 0)  # (z = 0 exactly where the gap is)
        dy = tl.where(live, dsc * y, 0.0)  # ds_ij·y_ij
        dmu += tl.sum(tl.where(live, dy / tl.where(live, gap, 1.0), 0.0), axis=0)
        dls += tl.sum(dy, axis=0)
        dbeta += tl.sum(dy * lz, axis=0)  # Σ ds·y·log₂ z: the op multiplies by ln 2
    return db, du, dmu, dls, dbeta


@triton.jit
def _parents_backward(A, B, U, PRIOR, DO, LSE, DELTA, DB, DU, DPRIOR, SCALE, WIN, C, P, K, D,
                      sag, sac, sak, sbg, sbp, sbk, sug, sup, sud, spg, sdg, sdc, sdd,
                      slg, slc, sqi, sqg, sqp, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr,
                      ACC: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """db, du per block of parents, and per parent j the sums over its children of ds_ij
    times y/(d − μ), y and y·log₂ z into ``DPRIOR (3, G, P)`` (the op scales and sums them)."""
    scale = tl.load(SCALE)
    n = tl.program_id(0)
    g = tl.program_id(1)
    mu, es, beta = _params(PRIOR, g, spg)
    cols = n * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    ds = tl.arange(0, BD)
    b = load_tile(B, g, sbg, cols, sbp, P, ks, sbk, K)
    u = load_tile(U, g, sug, cols, sup, P, ds, sud, D)
    db = tl.zeros([BN, BK], dtype=ACC)
    du = tl.zeros([BN, BD], dtype=ACC)
    dmu = tl.zeros([BN], dtype=ACC)
    dls = tl.zeros([BN], dtype=ACC)
    dbeta = tl.zeros([BN], dtype=ACC)
    w = _window(WIN, g, WINDOWED)
    # the child blocks as key_bias._parents_backward reads them
    first = (n * BN // BM) * BM if CAUSAL else 0
    last = tl.minimum(n * BN + BN + w, C) if WINDOWED else C
    inner_lo = tl.minimum(((n * BN + BN - 1 + BM - 1) // BM) * BM, last) if CAUSAL else first
    inner_hi = tl.maximum(tl.minimum((last // BM) * BM, (C // BM) * BM), inner_lo)
    if WINDOWED:
        reach = n * BN + w - BM + 1
        inner_hi = tl.maximum(tl.minimum(inner_hi, tl.where(reach >= 0, (reach // BM + 1) * BM,
                                                            0)), inner_lo)
    db, du, dmu, dls, dbeta = _parents_span(
        db, du, dmu, dls, dbeta, b, u, cols, A, DO, LSE, DELTA, g, ks, ds, first, inner_lo,
        sag, sac, sak, sdg, sdc, sdd, slg, slc, C, P, K, D, scale, w, mu, es, beta, CAUSAL,
        WINDOWED, True, BM, PRECISION, UPCAST, ACC)
    db, du, dmu, dls, dbeta = _parents_span(
        db, du, dmu, dls, dbeta, b, u, cols, A, DO, LSE, DELTA, g, ks, ds, inner_lo, inner_hi,
        sag, sac, sak, sdg, sdc, sdd, slg, slc, C, P, K, D, scale, w, mu, es, beta, CAUSAL,
        WINDOWED, False, BM, PRECISION, UPCAST, ACC)
    db, du, dmu, dls, dbeta = _parents_span(
        db, du, dmu, dls, dbeta, b, u, cols, A, DO, LSE, DELTA, g, ks, ds, inner_hi, last,
        sag, sac, sak, sdg, sdc, sdd, slg, slc, C, P, K, D, scale, w, mu, es, beta, CAUSAL,
        WINDOWED, True, BM, PRECISION, UPCAST, ACC)
    store_tile(DB, db * scale, g, sbg, cols, sbp, P, ks, sbk, K)
    store_tile(DU, du, g, sug, cols, sup, P, ds, sud, D)
    pmask = cols < P
    tl.store(DPRIOR + g * sqg + cols * sqp, dmu, mask=pmask)
    tl.store(DPRIOR + sqi + g * sqg + cols * sqp, dls, mask=pmask)
    tl.store(DPRIOR + 2 * sqi + g * sqg + cols * sqp, dbeta, mask=pmask)


@torch.library.custom_op("structattn_triton::generalised_gaussian_forward", mutates_args=())
def forward(a: torch.Tensor, b: torch.Tensor, u: torch.Tensor, prior: torch.Tensor,
            scale: float, causal: bool, window: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out (G, C, D), lse (G, C))`` for ``a (G, C, K)``, ``b (G, P, K)``, ``u (G, P, D)`` of
    one float dtype and ``prior (G, 3)``: each row's (μ, s, β), in float32 (float64 for float64
    inputs). Child i sits at position i among the parents (d = i − j); ``window`` ``(G,)``
    int32, with ``causal``: row g's children read i − window_g ≤ j ≤ i only."""
    G, C, K = a.shape
    P, D = b.shape[1], u.shape[2]
    out = u.new_empty(G, C, D)
    lse = a.new_empty(G, C, dtype=statistics(a.dtype))
    if C and G:
        common = _common(a.dtype, K, D, causal, window, device=a.device)
        prior = prior.to(statistics(a.dtype)).contiguous()
        _forward[(triton.cdiv(C, common["BM"]), G)](
            a, b, u, prior, out, lse, scalar(scale, a), _win(window, a), C, P, K, D,
            *a.stride(), *b.stride(), *u.stride(), prior.stride(0), *out.stride(),
            *lse.stride(), **common)
    return out, lse


@forward.register_fake
def _(a, b, u, prior, scale, causal, window=None):
    return (u.new_empty(a.shape[0], a.shape[1], u.shape[2]),
            a.new_empty(a.shape[:2], dtype=statistics(a.dtype)))


@torch.library.custom_op("structattn_triton::generalised_gaussian_backward", mutates_args=())
def backward(dout: torch.Tensor, a: torch.Tensor, b: torch.Tensor, u: torch.Tensor,
             prior: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, scale: float,
             causal: bool, window: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(da, db, du, dprior)`` of ``forward``'s output against ``dout``; ``dprior (G, 3)``
    the gradients of (μ, s, β), in ``prior``'s dtype."""
    G, C, K = a.shape
    P, D = b.shape[1], u.shape[2]
    dout = dout.contiguous()
    stat = statistics(a.dtype)
    delta = (dout.to(stat) * out.to(stat)).sum(-1).contiguous()  # Δ_i, laid out as lse
    lse = lse.contiguous()
    params = prior.to(stat).contiguous()
    da, db, du = torch.zeros_like(a), torch.zeros_like(b), torch.zeros_like(u)
    parts = torch.zeros(3, G, P, dtype=stat, device=a.device)  # per parent: Σ_i ds·(…)
    if C and G and P:
        strides = (*a.stride(), *b.stride(), *u.stride(), params.stride(0), *dout.stride(),
                   *lse.stride())
        children = _common(a.dtype, K, D, causal, window, 64, 64, "children", a.device)
        parents = _common(a.dtype, K, D, causal, window, 64, 64, "parents", a.device)
        scale, win = scalar(scale, a), _win(window, a)
        _children_backward[(triton.cdiv(C, children["BM"]), G)](
            a, b, u, params, dout, lse, delta, da, scale, win, C, P, K, D, *strides,
            **children)
        _parents_backward[(triton.cdiv(P, parents["BN"]), G)](
            a, b, u, params, dout, lse, delta, db, du, parts, scale, win, C, P, K, D, *strides,
            *parts.stride(), **parents)
    dmu, dy, dylog2 = parts.sum(-1)  # (G,) each
    beta = params[:, 2]
    ln2 = 0.6931471805599453
    dprior = torch.stack([beta * dmu, -beta * dy, -ln2 * dylog2], -1)  # ∂/∂μ, ∂/∂s, ∂/∂β
    return da, db, du, dprior.to(prior.dtype)


@backward.register_fake
def _(dout, a, b, u, prior, out, lse, scale, causal, window=None):
    return (torch.empty_like(a), torch.empty_like(b), torch.empty_like(u),
            torch.empty_like(prior))


def _setup(ctx, inputs, output):
    a, b, u, prior, scale, causal, window = inputs
    out, lse = output
    ctx.save_for_backward(a, b, u, prior, out, lse, window)
    ctx.scale, ctx.causal = scale, causal
    ctx.mark_non_differentiable(lse)


def _backward_rule(ctx, dout, _):
    a, b, u, prior, out, lse, window = ctx.saved_tensors
    da, db, du, dprior = backward(dout, a, b, u, prior, out, lse, ctx.scale, ctx.causal, window)
    return da, db, du, dprior, None, None, None


forward.register_autograd(_backward_rule, setup_context=_setup)
