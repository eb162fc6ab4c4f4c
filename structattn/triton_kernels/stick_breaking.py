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
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._tiles import add_tile, load_row, load_tile, store_tile


@triton.jit
def _logsigmoid(x):
    return tl.minimum(x, 0.0) - tl.log(1.0 + tl.exp(-tl.abs(x)))


@triton.jit
def _block(a, B, g, cols, ks, sbg, sbp, sbk, rows, C, P, K, scale, carried):
    """A block of parents read by the forward and the backward alike: its break logits
    ``(BM, BN)``, where each pair is allowed (j < i), its parents' factors, log σ(−s) (zero
    off the support) and the posterior p_ij, from the log stick ``carried`` past the blocks
    nearer the diagonal and the reverse cumulative sum over the nearer parents in the block."""
    b = load_tile(B, g, sbg, cols, sbp, P, ks, sbk, K)
    s = tl.dot(a, tl.trans(b)) * scale
    allowed = (cols[None, :] < rows[:, None]) & (cols[None, :] < P) & (rows[:, None] < C)
    neg = tl.where(allowed, _logsigmoid(-s), 0.0)
    after = tl.cumsum(neg, axis=1, reverse=True) - neg
    p = tl.where(allowed, tl.exp(_logsigmoid(s) + after + carried[:, None]), 0.0)
    return s, allowed, b, neg, p


@triton.jit
def _forward(A, B, V, O, L, N, scale, log_stop, C, P, K, D,
             sag, sac, sak, sbg, sbp, sbk, svg, svp, svd, sog, soc, sod, slg, slc,
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr):
    m = tl.program_id(0)
    g = tl.program_id(1)
    rows = m * BM + tl.arange(0, BM)
    ks = tl.arange(0, BK)
    ds = tl.arange(0, BD)
    rmask = rows < C
    a = load_tile(A, g, sag, rows, sac, C, ks, sak, K)
    acc = tl.zeros([BM, BD], dtype=a.dtype)
    carried = tl.zeros([BM], dtype=a.dtype)
    blocks = tl.cdiv(tl.minimum(m * BM + BM - 1, P), BN)  # parents j < i ≤ m·BM + BM − 1
    t = 0
    alive = blocks > 0
    while alive:
        cols = (blocks - 1 - t) * BN + tl.arange(0, BN)
        s, allowed, b, neg, p = _block(a, B, g, cols, ks, sbg, sbp, sbk, rows, C, P, K, scale,
                                       carried)
        acc += tl.dot(p, load_tile(V, g, svg, cols, svp, P, ds, svd, D))
        carried += tl.sum(neg, axis=1)
        t += 1
        stick = tl.max(tl.where(rmask, carried, -float("inf")), axis=0)
        alive = (t < blocks) & (stick > log_stop)
    store_tile(O, acc, g, sog, rows, soc, C, ds, sod, D)
    tl.store(L + g * slg + rows * slc, tl.exp(carried), mask=rmask)
    tl.store(N + g * tl.num_programs(0) + m, t)


@triton.jit
def _backward(A, B, V, DO, BASE, N, DA, DB, DV, scale, C, P, K, D,
              sag, sac, sak, sbg, sbp, sbk, svg, svp, svd, sdg, sdc, sdd, swg, swc,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr):
    m = tl.program_id(0)
    g = tl.program_id(1)
    rows = m * BM + tl.arange(0, BM)
    ks = tl.arange(0, BK)
    ds = tl.arange(0, BD)
    a = load_tile(A, g, sag, rows, sac, C, ks, sak, K)
    do = load_tile(DO, g, sdg, rows, sdc, C, ds, sdd, D)
    base = load_row(BASE, g, swg, rows, swc, C)
    da = tl.zeros([BM, BK], dtype=a.dtype)
    carried = tl.zeros([BM], dtype=a.dtype)
    suffix = tl.zeros([BM], dtype=a.dtype)
    blocks = tl.cdiv(tl.minimum(m * BM + BM - 1, P), BN)
    read = tl.load(N + g * tl.num_programs(0) + m)
    for t in range(0, read):
        cols = (blocks - 1 - t) * BN + tl.arange(0, BN)
        s, allowed, b, neg, p = _block(a, B, g, cols, ks, sbg, sbp, sbk, rows, C, P, K, scale,
                                       carried)
        u = tl.dot(do, tl.trans(load_tile(V, g, svg, cols, svp, P, ds, svd, D))) * p
        u_after = tl.cumsum(u, axis=1, reverse=True) - u + suffix[:, None]  # Σ_{j>l} u_ij
        dsc = tl.where(allowed, u - tl.sigmoid(s) * (base[:, None] - u_after), 0.0) * scale
        da += tl.dot(dsc, b)
        add_tile(DB, tl.dot(tl.trans(dsc), a), g, sbg, cols, sbp, P, ks, sbk, K)
        add_tile(DV, tl.dot(tl.trans(p), do), g, svg, cols, svp, P, ds, svd, D)
        carried += tl.sum(neg, axis=1)
        suffix += tl.sum(u, axis=1)
    store_tile(DA, da, g, sag, rows, sac, C, ks, sak, K)


#: children and parents per block; the widths are padded to a power of two ≥ 16 (tl.dot's least)
BM, BN = 32, 32


def _width(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


@torch.library.custom_op("structattn_triton::stick_breaking_forward", mutates_args=())
def forward(a: torch.Tensor, b: torch.Tensor, v: torch.Tensor, scale: float,
            stop: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out (G, C, D), leftover (G, C), nread (G, blocks))`` for factors ``a (G, C, K)``,
    ``b (G, P, K)``, values ``v (G, P, D)``, one float dtype (float32 or float64), C ≤ P;
    a scan stops once every child's stick is ≤ ``stop``."""
    G, C, K = a.shape
    P, D = b.shape[1], v.shape[2]
    out = v.new_empty(G, C, D)
    left = a.new_empty(G, C)
    grid = (triton.cdiv(C, BM), G)
    nread = torch.empty(G, grid[0], dtype=torch.int32, device=a.device)
    if C and G:
        _forward[grid](a, b, v, out, left, nread, scale, math.log(stop) if stop > 0 else -math.inf,
                       C, P, K, D, *a.stride(), *b.stride(), *v.stride(), *out.stride(),
                       *left.stride(), BM=BM, BN=BN, BK=_width(K), BD=_width(D))
    return out, left, nread


@forward.register_fake
def _(a, b, v, scale, stop):
    G, C = a.shape[0], a.shape[1]
    return (v.new_empty(G, C, v.shape[2]), a.new_empty(G, C),
            a.new_empty(G, (C + BM - 1) // BM, dtype=torch.int32))


@torch.library.custom_op("structattn_triton::stick_breaking_backward", mutates_args=())
def backward(dout: torch.Tensor, dleft: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             v: torch.Tensor, scale: float, out: torch.Tensor, left: torch.Tensor,
             nread: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(da, db, dv)`` of ``forward``'s ``(out, leftover)`` against ``(dout, dleft)``."""
    G, C, K = a.shape
    P, D = b.shape[1], v.shape[2]
    base = (dout * out).sum(-1) + dleft * left  # D_i
    dout = dout.contiguous()
    da = torch.zeros_like(a)
    db = torch.zeros_like(b)
    dv = torch.zeros_like(v)
    if C and G:
        _backward[(triton.cdiv(C, BM), G)](
            a, b, v, dout, base, nread, da, db, dv, scale, C, P, K, D, *a.stride(),
            *b.stride(), *v.stride(), *dout.stride(), *base.stride(),
            BM=BM, BN=BN, BK=_width(K), BD=_width(D))
    return da, db, dv


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
