"""A band per child in Triton, forward and backward: expanding attention's output at its
fixed point (``structattn.triton_kernels.expanding``), with a slope per child.

    out_i = Σ_{1 ≤ d ≤ W_i} softmax_d(scale·⟨a_i, b_{i−d}⟩ + d·e_i) u_{i−d},

FlashAttention's scheme with Δ_i = dout_i·out_i and ds_ij = p_ij (dout_i·u_j − Δ_i):

    da_i = scale Σ_j ds_ij b_j,   de_i = Σ_j ds_ij (i − j),
    db_j = scale Σ_i ds_ij a_i,   du_j = Σ_i p_ij dout_i.

Never the N×W table: one program per block of children holds BM×BN scores at a time, over
the parents from its first window start to its last child; in the backward, one program per
block of parents (db, du) reads the blocks of children after it while some child reaches
back to it — per block of children, the earliest parent it reads and that minimum over every
later block, found once per call — with no atomics: a window as wide as the whole past costs
what causal attention's backward does, not an atomic add per block of children and parent.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._tiles import (
    add_tile,
    dot,
    load_tile,
    online_softmax,
    scalar,
    settings,
    statistics,
    store_tile,
    width,
)


@triton.jit
def _span(pos, w, live, BN: tl.constexpr):
    """The parent blocks ``[lo, hi)`` the live children of a block read: from the first
    block holding some i − W_i to the last child's i − 1."""
    lo = tl.min(tl.where(live, pos - w, 2147483647), axis=0)
    hi = tl.max(tl.where(live, pos, 0), axis=0)
    lo = tl.maximum(lo, 0) // BN * BN
    return lo, hi


@triton.jit
def _scores(a, B, g, sbg, sbp, sbk, cols, ks, P, K, pos, w, live, scale,
            PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """A block's scores ψ_ij ``(BM, BN)``, the distances i − j and which pairs are on the
    support 1 ≤ i − j ≤ W_i of a live child; the parents' b."""
    b = load_tile(B, g, sbg, cols, sbp, P, ks, sbk, K)
    s = dot(a, tl.trans(b), PRECISION, UPCAST) * scale
    dist = pos[:, None] - cols[None, :]
    on = (dist >= 1) & (dist <= w[:, None]) & live[:, None] & (cols[None, :] < P)
    return s, dist, on, b


@triton.jit
def _children(A, E, WIN, g, m_, N, offset, sag, san, sak, K, BM: tl.constexpr,
              BK: tl.constexpr, ACC: tl.constexpr):
    """Block ``m_`` of row ``g``'s children: their rows, which exist, their positions, the
    factor columns, a ``(BM, BK)``, the slopes e, the windows w and which have a past."""
    rows = m_ * BM + tl.arange(0, BM)
    rmask = rows < N
    ks = tl.arange(0, BK)
    a = load_tile(A, g, sag, rows, san, N, ks, sak, K)
    e = tl.load(E + g * N + rows, mask=rmask, other=0.0).to(ACC)
    w = tl.load(WIN + g * N + rows, mask=rmask, other=0)
    return rows, rmask, offset + rows, ks, a, e, w, (w >= 1) & rmask


@triton.jit
def _attend_forward(A, B, U, E, WIN, O, LSE, SCALE, N, P, K, D, offset,
                    sag, san, sak, sbg, sbp, sbk, sug, sup, sud, sog, son, sod,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr,
                    ACC: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    scale = tl.load(SCALE)
    g = tl.program_id(1)
    rows, rmask, pos, ks, a, e, w, live = _children(A, E, WIN, g, tl.program_id(0), N, offset,
                                                    sag, san, sak, K, BM, BK, ACC)
    ds = tl.arange(0, BD)
    top = tl.full([BM], -float("inf"), dtype=ACC)
    total = tl.zeros([BM], dtype=ACC)
    acc = tl.zeros([BM, BD], dtype=ACC)
    lo, hi = _span(pos, w, live, BN)
    for start in range(lo, hi, BN):
        cols = start + tl.arange(0, BN)
        s, dist, on, b = _scores(a, B, g, sbg, sbp, sbk, cols, ks, P, K, pos, w, live, scale,
                                 PRECISION, UPCAST)
        logit = tl.where(on, s + dist.to(ACC) * e[:, None], -float("inf"))
        p, shrink, new = online_softmax(logit, top)
        u = load_tile(U, g, sug, cols, sup, P, ds, sud, D)
        total = total * shrink + tl.sum(p, axis=1)
        acc = acc * shrink[:, None] + dot(p.to(u.dtype), u, PRECISION, UPCAST)
        top = new
    total = tl.where(live, total, 1.0)  # no past: a zero output
    store_tile(O, acc / total[:, None], g, sog, rows, son, N, ds, sod, D)
    tl.store(LSE + g * N + rows, tl.where(live, top, 0.0) + tl.log(total), mask=rmask)


@triton.jit
def _attend_backward(A, B, U, E, WIN, DO, LSE, DELTA, DA, DE, DB, DU, SCALE, N, P, K, D,
                     offset, sag, san, sak, sbg, sbp, sbk, sug, sup, sud, sdg, sdn, sdd,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr,
                     ACC: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                     ATOMIC: tl.constexpr):
    """da and de per block of children; with ``ATOMIC``, db and du too, added atomically
    into float buffers laid out as b and u (``BACKWARD``)."""
    scale = tl.load(SCALE)
    g = tl.program_id(1)
    rows, rmask, pos, ks, a, e, w, live = _children(A, E, WIN, g, tl.program_id(0), N, offset,
                                                    sag, san, sak, K, BM, BK, ACC)
    ds = tl.arange(0, BD)
    do = load_tile(DO, g, sdg, rows, sdn, N, ds, sdd, D)
    lse = tl.load(LSE + g * N + rows, mask=rmask, other=0.0)
    delta = tl.load(DELTA + g * N + rows, mask=rmask, other=0.0)
    da = tl.zeros([BM, BK], dtype=ACC)
    de = tl.zeros([BM], dtype=ACC)
    lo, hi = _span(pos, w, live, BN)
    for start in range(lo, hi, BN):
        cols = start + tl.arange(0, BN)
        s, dist, on, b = _scores(a, B, g, sbg, sbp, sbk, cols, ks, P, K, pos, w, live, scale,
                                 PRECISION, UPCAST)
        d = dist.to(ACC)
        p = tl.exp(tl.where(on, s + d * e[:, None] - lse[:, None], -float("inf")))
        u = load_tile(U, g, sug, cols, sup, P, ds, sud, D)
        dsc = p * (dot(do, tl.trans(u), PRECISION, UPCAST) - delta[:, None])
        da += dot(dsc.to(b.dtype), b, PRECISION, UPCAST)
        de += tl.sum(dsc * d, axis=1)
        if ATOMIC:
            add_tile(DB, dot(tl.trans(dsc.to(a.dtype)), a, PRECISION, UPCAST) * scale, g,
                     P * K, cols, K, P, ks, 1, K)
            add_tile(DU, dot(tl.trans(p.to(do.dtype)), do, PRECISION, UPCAST), g, P * D, cols,
                     D, P, ds, 1, D)
    store_tile(DA, da * scale, g, N * K, rows, K, N, ks, 1, K)
    tl.store(DE + g * N + rows, de, mask=rmask)


@triton.jit
def _parents_backward(A, B, U, E, WIN, DO, LSE, DELTA, DB, DU, FIRST, REACH, SCALE, N, P, K,
                      D, offset, nbm, sag, san, sak, sbg, sbp, sbk, sug, sup, sud, sdg, sdn,
                      sdd, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      BD: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr,
                      UPCAST: tl.constexpr):
    """db and du per block of parents, no atomics: the blocks of children after it, while
    some child of them or of a later block reaches back to it (``REACH`` (G, nbm): the
    earliest parent any child of block m or later reads, non-decreasing in m), each block
    read only where one of its own children does (``FIRST``: its own earliest parent)."""
    scale = tl.load(SCALE)
    n = tl.program_id(0)
    g = tl.program_id(1)
    cols = n * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    ds = tl.arange(0, BD)
    b = load_tile(B, g, sbg, cols, sbp, P, ks, sbk, K)
    u = load_tile(U, g, sug, cols, sup, P, ds, sud, D)
    db = tl.zeros([BN, BK], dtype=ACC)
    du = tl.zeros([BN, BD], dtype=ACC)
    end = n * BN + BN - 1  # the block's last parent
    m = tl.maximum(n * BN + 1 - offset, 0) // BM  # the first block with a child after it
    go = (m < nbm) & (tl.load(REACH + g * nbm + tl.minimum(m, nbm - 1)) <= end)
    while go:
        if tl.load(FIRST + g * nbm + m) <= end:
            rows, rmask, pos, _, a, e, w, live = _children(A, E, WIN, g, m, N, offset, sag,
                                                           san, sak, K, BM, BK, ACC)
            do = load_tile(DO, g, sdg, rows, sdn, N, ds, sdd, D)
            lse = tl.load(LSE + g * N + rows, mask=rmask, other=0.0)
            delta = tl.load(DELTA + g * N + rows, mask=rmask, other=0.0)
            s = dot(a, tl.trans(b), PRECISION, UPCAST) * scale
            dist = pos[:, None] - cols[None, :]
            on = (dist >= 1) & (dist <= w[:, None]) & live[:, None] & (cols[None, :] < P)
            p = tl.exp(tl.where(on, s + dist.to(ACC) * e[:, None] - lse[:, None],
                                -float("inf")))
            dsc = p * (dot(do, tl.trans(u), PRECISION, UPCAST) - delta[:, None])
            du += dot(tl.trans(p.to(do.dtype)), do, PRECISION, UPCAST)
            db += dot(tl.trans(dsc.to(a.dtype)), a, PRECISION, UPCAST)
        m += 1
        go = (m < nbm) & (tl.load(REACH + g * nbm + tl.minimum(m, nbm - 1)) <= end)
    store_tile(DB, db * scale, g, P * K, cols, K, P, ks, 1, K)
    store_tile(DU, du, g, P * D, cols, D, P, ds, 1, D)


def _reach(window: torch.Tensor, offset: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block of ``block`` children ``(G, nbm)`` int32: the earliest parent any of its
    children reads (i − W_i over those with a past; past every parent where none has one),
    and that minimum over it and every later block (non-decreasing)."""
    G, N = window.shape
    nbm = triton.cdiv(N, block)
    pos = offset + torch.arange(N, device=window.device)
    none = torch.iinfo(torch.int32).max
    start = torch.where(window >= 1, pos - window, none)
    start = torch.nn.functional.pad(start, (0, nbm * block - N), value=none)
    first = start.view(G, nbm, block).amin(-1)
    reach = first.flip(-1).cummin(-1).values.flip(-1)
    return first.to(torch.int32).contiguous(), reach.to(torch.int32).contiguous()


#: how the backward gives db and du: "parents" (default), a kernel per block of parents; or
#: "atomic", added per tile by the children's kernel (``benchmarks/profile_expanding.py``
#: times both: narrow windows touch each parent block from few tiles, where the atomics may
#: cost less than the parents' kernel's second scoring)
BACKWARD: dict = dict(db_du="parents")


def _launch(dtype, K, D) -> dict:
    common = dict(settings(dtype, max(width(K), width(D)), 64, 64), BK=width(K), BD=width(D))
    return common


@torch.library.custom_op("structattn_triton::mean_field_attend_forward", mutates_args=())
def attend_forward(a: torch.Tensor, b: torch.Tensor, u: torch.Tensor, e: torch.Tensor,
                   window: torch.Tensor, offset: int, scale: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out (G, N, D), lse (G, N))`` of the band per child: ``a (G, N, K)``, ``b (G, P,
    K)``, ``u (G, P, D)`` of one float dtype, ``e (G, N)`` each child's slope E[ln q_i] and
    ``window (G, N)`` its W_i (child row q at position offset + q; W_i = 0: a zero output).
    ``out`` and ``lse`` in ``statistics(a.dtype)``."""
    G, N, K = a.shape
    P, D = b.shape[1], u.shape[2]
    stat = statistics(a.dtype)
    out = torch.empty(G, N, D, dtype=stat, device=a.device)
    lse = torch.empty(G, N, dtype=stat, device=a.device)
    if G and N:
        common = _launch(a.dtype, K, D)
        _attend_forward[(triton.cdiv(N, common["BM"]), G)](
            a, b, u, e.to(stat).contiguous(), window.to(torch.int32).contiguous(), out, lse,
            scalar(scale, a), N, P, K, D, offset, *a.stride(), *b.stride(), *u.stride(),
            *out.stride(), **common)
    return out, lse


@attend_forward.register_fake
def _(a, b, u, e, window, offset, scale):
    stat = statistics(a.dtype)
    return (a.new_empty(a.shape[0], a.shape[1], u.shape[2], dtype=stat),
            a.new_empty(a.shape[:2], dtype=stat))


@torch.library.custom_op("structattn_triton::mean_field_attend_backward", mutates_args=())
def attend_backward(dout: torch.Tensor, a: torch.Tensor, b: torch.Tensor, u: torch.Tensor,
                    e: torch.Tensor, window: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                    offset: int, scale: float
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(da, db, du, de)`` of ``attend_forward``'s output against ``dout``."""
    G, N, K = a.shape
    P, D = b.shape[1], u.shape[2]
    stat = statistics(a.dtype)
    dout = dout.to(stat).contiguous()
    delta = (dout * out.to(stat)).sum(-1).contiguous()  # Δ_i
    a, b, u = a.contiguous(), b.contiguous(), u.contiguous()
    da = torch.zeros(G, N, K, dtype=stat, device=a.device)
    db = torch.zeros(G, P, K, dtype=stat, device=a.device)
    du = torch.zeros(G, P, D, dtype=stat, device=a.device)
    de = torch.zeros(G, N, dtype=stat, device=a.device)
    if G and N and P:
        common = _launch(a.dtype, K, D)
        do = dout.to(u.dtype) if a.dtype in (torch.float16, torch.bfloat16) else dout
        e, win, lse = e.to(stat).contiguous(), window.to(torch.int32).contiguous(), \
            lse.contiguous()
        scale_t = scalar(scale, a)
        strides = (*a.stride(), *b.stride(), *u.stride(), *do.stride())
        atomic = BACKWARD["db_du"] == "atomic"
        _attend_backward[(triton.cdiv(N, common["BM"]), G)](
            a, b, u, e, win, do, lse, delta, da, de, db, du, scale_t, N, P, K, D, offset,
            *strides, **common, ATOMIC=atomic)
        if not atomic:
            first, reach = _reach(window, offset, common["BM"])
            _parents_backward[(triton.cdiv(P, common["BN"]), G)](
                a, b, u, e, win, do, lse, delta, db, du, first, reach, scale_t, N, P, K, D,
                offset, first.shape[1], *strides, **common)
    return da.to(a.dtype), db.to(b.dtype), du.to(u.dtype), de.to(e.dtype)


@attend_backward.register_fake
def _(dout, a, b, u, e, window, out, lse, offset, scale):
    return torch.empty_like(a), torch.empty_like(b), torch.empty_like(u), torch.empty_like(e)


def _setup(ctx, inputs, output):
    a, b, u, e, window, offset, scale = inputs
    out, lse = output
    ctx.save_for_backward(a, b, u, e, window, out, lse)
    ctx.offset, ctx.scale = offset, scale
    ctx.mark_non_differentiable(lse)


def _backward_rule(ctx, dout, _):
    a, b, u, e, window, out, lse = ctx.saved_tensors
    da, db, du, de = attend_backward(dout, a, b, u, e, window, out, lse, ctx.offset, ctx.scale)
    return da, db, du, de, None, None, None


attend_forward.register_autograd(_backward_rule, setup_context=_setup)


__all__ = ["BACKWARD", "attend_backward", "attend_forward"]
