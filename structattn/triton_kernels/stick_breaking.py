"""Stick-breaking attention (Tan et al., ICLR 2025) in Triton, forward and backward.

Child i scans its parents back from i − 1 and breaks at parent l with probability
β_il = σ(s_il), s_il = scale·⟨a_i, b_l⟩, unless it broke nearer:

    log p_ij = log σ(s_ij) + Σ_{j<l<i} log σ(−s_il),    leftover_i = Π_{l<i} σ(−s_il).

One program per (row g, block of BM children) reads the parents in blocks of BN from the
diagonal back: a block's scores come from one ``tl.dot``; the sum over the parents nearer than
j inside the block is a reverse cumulative sum, and ``carried`` (the log stick each child has
left) holds the blocks already read. Never more than BM×BN scores at once: O(N·d) memory.
The scan stops once every child's stick is below ``stop`` (a mass below the dtype's rounding,
or the prior's ``tol``); ``nread`` records how many blocks each program read, so the backward
reads the same ones.

Backward, with u_ij = (dout_i·v_j) p_ij and D_i = dout_i·out_i + dleftover_i·leftover_i:

    ds_il = u_il − σ(s_il)·(D_i − Σ_{j>l} u_ij),

scanned back from the diagonal like the forward (the suffix Σ_{j>l} u_ij carried across
blocks); da accumulates in the program, db and dv are added atomically per parent block.

Half precision: the factors enter the products in their dtype (the tensor cores'), scores and
sums are float32. An error δ in D_i reaches every ds_il as σ(s_il)·δ — a sum over the parents
that no softmax normalises — so D_i must agree with the backward's own Σ_j u_ij: the forward
returns ``out`` in float32, to float32's precision (p read as hi + lo, two products in the
factors' dtype), and D_i takes dout rounded to that dtype, as the backward's products do.
Then the gradients are closer to float64's than PyTorch's own dense reading in that dtype.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._tiles import add_tile, dot, load_row, load_tile, scalar, settings, statistics, store_tile, width


@triton.jit
def _logsigmoid(x):
    return tl.minimum(x, 0.0) - tl.log(1.0 + tl.exp(-tl.abs(x)))


@triton.jit
def _block(a, B, g, cols, ks, sbg, sbp, sbk, rows, C, P, K, scale, carried,
           PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """A block of parents read by the forward and the backward alike: its break logits
    ``(BM, BN)``, where each pair is allowed (j < i), its parents' factors, log σ(−s) (zero
    off the support) and the posterior p_ij, from the log stick ``carried`` past the blocks
    nearer the diagonal and the reverse cumulative sum over the nearer parents in the block."""
    b = load_tile(B, g, sbg, cols, sbp, P, ks, sbk, K)
    s = dot(a, tl.trans(b), PRECISION, UPCAST) * scale
    allowed = (cols[None, :] < rows[:, None]) & (cols[None, :] < P) & (rows[:, None] < C)
    neg = tl.where(allowed, _logsigmoid(-s), 0.0)
    after = tl.cumsum(neg, axis=1, reverse=True) - neg
    p = tl.where(allowed, tl.exp(_logsigmoid(s) + after + carried[:, None]), 0.0)
    return s, allowed, b, neg, p


@triton.jit
def _forward(A, B, V, O, L, N, SCALE, log_stop, C, P, K, D,
             sag, sac, sak, sbg, sbp, sbk, svg, svp, svd, sog, soc, sod, slg, slc,
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr,
             ACC: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
             SPLIT: tl.constexpr):
    scale = tl.load(SCALE)  # in the accumulators' dtype (a float argument is float32)
    m = tl.program_id(0)
    g = tl.program_id(1)
    rows = m * BM + tl.arange(0, BM)
    ks = tl.arange(0, BK)
    ds = tl.arange(0, BD)
    rmask = rows < C
    a = load_tile(A, g, sag, rows, sac, C, ks, sak, K)
    acc = tl.zeros([BM, BD], dtype=ACC)
    carried = tl.zeros([BM], dtype=ACC)
    blocks = tl.cdiv(tl.minimum(m * BM + BM - 1, P), BN)  # parents j < i ≤ m·BM + BM − 1
    t = 0
    alive = blocks > 0
    while alive:
        cols = (blocks - 1 - t) * BN + tl.arange(0, BN)
        s, allowed, b, neg, p = _block(a, B, g, cols, ks, sbg, sbp, sbk, rows, C, P, K, scale,
                                       carried, PRECISION, UPCAST)
        v = load_tile(V, g, svg, cols, svp, P, ds, svd, D)
        if SPLIT:  # p = hi + lo in the factors' dtype: out to float32's precision, which D_i
            # in the backward needs (its error reaches every ds_il times σ(s_il))
            hi = p.to(v.dtype)
            acc += dot(hi, v, PRECISION, UPCAST)
            acc += dot((p - hi.to(p.dtype)).to(v.dtype), v, PRECISION, UPCAST)
        else:
            acc += dot(p, v, PRECISION, UPCAST)
        carried += tl.sum(neg, axis=1)
        t += 1
        stick = tl.max(tl.where(rmask, carried, -float("inf")), axis=0)
        alive = (t < blocks) & (stick > log_stop)
    store_tile(O, acc, g, sog, rows, soc, C, ds, sod, D)
    tl.store(L + g * slg + rows * slc, tl.exp(carried), mask=rmask)
    tl.store(N + g * tl.num_programs(0) + m, t)


@triton.jit
def _backward(A, B, V, DO, BASE, N, DA, DB, DV, SCALE, C, P, K, D,
              sag, sac, sak, sbg, sbp, sbk, svg, svp, svd, sdg, sdc, sdd, swg, swc,
              sdbg, sdbp, sdbk, sdvg, sdvp, sdvd,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr,
              ACC: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
              SPLIT: tl.constexpr):
    scale = tl.load(SCALE)  # in the accumulators' dtype (a float argument is float32)
    m = tl.program_id(0)
    g = tl.program_id(1)
    rows = m * BM + tl.arange(0, BM)
    ks = tl.arange(0, BK)
    ds = tl.arange(0, BD)
    a = load_tile(A, g, sag, rows, sac, C, ks, sak, K)
    do = load_tile(DO, g, sdg, rows, sdc, C, ds, sdd, D)
    base = load_row(BASE, g, swg, rows, swc, C)
    da = tl.zeros([BM, BK], dtype=ACC)
    carried = tl.zeros([BM], dtype=ACC)
    suffix = tl.zeros([BM], dtype=ACC)
    blocks = tl.cdiv(tl.minimum(m * BM + BM - 1, P), BN)
    read = tl.load(N + g * tl.num_programs(0) + m)
    for t in range(0, read):
        cols = (blocks - 1 - t) * BN + tl.arange(0, BN)
        s, allowed, b, neg, p = _block(a, B, g, cols, ks, sbg, sbp, sbk, rows, C, P, K, scale,
                                       carried, PRECISION, UPCAST)
        v = load_tile(V, g, svg, cols, svp, P, ds, svd, D)
        u = dot(do, tl.trans(v), PRECISION, UPCAST) * p
        u_after = tl.cumsum(u, axis=1, reverse=True) - u + suffix[:, None]  # Σ_{j>l} u_ij
        dsc = tl.where(allowed, u - tl.sigmoid(s) * (base[:, None] - u_after), 0.0) * scale
        da += dot(dsc.to(b.dtype), b, PRECISION, UPCAST)
        add_tile(DB, dot(tl.trans(dsc.to(a.dtype)), a, PRECISION, UPCAST), g, sdbg, cols, sdbp,
                 P, ks, sdbk, K)
        add_tile(DV, dot(tl.trans(p.to(do.dtype)), do, PRECISION, UPCAST), g, sdvg, cols, sdvp,
                 P, ds, sdvd, D)
        carried += tl.sum(neg, axis=1)
        suffix += tl.sum(u, axis=1)
    store_tile(DA, da, g, sag, rows, sac, C, ks, sak, K)




def _common(dtype: torch.dtype, K: int, D: int) -> dict:
    """The forward's and the backward's launch settings: the same blocks, since the backward
    reads the blocks of parents the forward counted (``nread``); square blocks of 64 in half
    precision, where the backward's program holds da and three products per block."""
    BK, BD = width(K), width(D)
    return dict(settings(dtype, max(BK, BD), 64, 64), BK=BK, BD=BD,
                SPLIT=dtype in (torch.float16, torch.bfloat16))


@torch.library.custom_op("structattn_triton::stick_breaking_forward", mutates_args=())
def forward(a: torch.Tensor, b: torch.Tensor, v: torch.Tensor, scale: float,
            stop: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out (G, C, D), leftover (G, C), nread (G, blocks))`` for factors ``a (G, C, K)``,
    ``b (G, P, K)``, values ``v (G, P, D)`` of one float dtype (half precision, float32 or
    float64), C ≤ P. ``out`` and the leftover are float32 (float64 for float64 inputs): the
    backward's D_i = dout_i·out_i reaches every ds_il times σ(s_il), a sum that is not
    normalised as a softmax's is, so a rounded ``out`` would cost bfloat16 gradients an order
    of magnitude. A scan stops once every child's stick is ≤ ``stop``."""
    G, C, K = a.shape
    P, D = b.shape[1], v.shape[2]
    common = _common(a.dtype, K, D)
    out = v.new_empty(G, C, D, dtype=statistics(a.dtype))
    left = a.new_empty(G, C, dtype=statistics(a.dtype))
    grid = (triton.cdiv(C, common["BM"]), G)
    nread = torch.empty(G, grid[0], dtype=torch.int32, device=a.device)
    if C and G:
        log_stop = math.log(stop) if stop > 0 else -math.inf
        _forward[grid](a, b, v, out, left, nread, scalar(scale, a), log_stop, C, P, K, D,
                       *a.stride(), *b.stride(), *v.stride(), *out.stride(), *left.stride(),
                       **common)
    return out, left, nread


@forward.register_fake
def _(a, b, v, scale, stop):
    G, C = a.shape[0], a.shape[1]
    BM = _common(a.dtype, a.shape[2], v.shape[2])["BM"]
    stat = statistics(a.dtype)
    return (v.new_empty(G, C, v.shape[2], dtype=stat), a.new_empty(G, C, dtype=stat),
            a.new_empty(G, (C + BM - 1) // BM, dtype=torch.int32))


@torch.library.custom_op("structattn_triton::stick_breaking_backward", mutates_args=())
def backward(dout: torch.Tensor, dleft: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             v: torch.Tensor, scale: float, out: torch.Tensor, left: torch.Tensor,
             nread: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(da, db, dv)`` of ``forward``'s ``(out, leftover)`` against ``(dout, dleft)``."""
    G, C, K = a.shape
    P, D = b.shape[1], v.shape[2]
    stat = statistics(a.dtype)
    dout = dout.to(a.dtype).contiguous()  # the products' dtype, and D_i's
    base = (dout.to(stat) * out).sum(-1) + dleft.to(stat) * left  # D_i
    da = torch.zeros_like(a)
    # blocks of children add into one parent's rows: atomically, in float32 at least
    db = torch.zeros_like(b, dtype=torch.promote_types(b.dtype, stat))
    dv = torch.zeros_like(v, dtype=torch.promote_types(v.dtype, stat))
    if C and G:
        common = _common(a.dtype, K, D)
        _backward[(triton.cdiv(C, common["BM"]), G)](
            a, b, v, dout, base, nread, da, db, dv, scalar(scale, a), C, P, K, D, *a.stride(),
            *b.stride(), *v.stride(), *dout.stride(), *base.stride(), *db.stride(),
            *dv.stride(), **common)
    return da, db.to(b.dtype), dv.to(v.dtype)


@backward.register_fake
def _(dout, dleft, a, b, v, scale, out, left, nread):
    return torch.empty_like(a), torch.empty_like(b), torch.empty_like(v)


def _setup(ctx, inputs, output):
    a, b, v, scale, _ = inputs
    out, left, nread = output
    ctx.save_for_backward(a, b, v, out, left, nread)
    ctx.scale = scale
    ctx.mark_non_differentiable(nread)


def _backward_rule(ctx, dout, dleft, _):
    a, b, v, out, left, nread = ctx.saved_tensors
    dout = torch.zeros_like(out) if dout is None else dout
    dleft = torch.zeros_like(left) if dleft is None else dleft
    da, db, dv = backward(dout, dleft, a, b, v, ctx.scale, out, left, nread)
    return da, db, dv, None, None


forward.register_autograd(_backward_rule, setup_context=_setup)
