"""Expanding attention's mean field on the GPU in Triton: each child's fixed point, and the
output at it with its gradient.

``solve``: child i of a block iterates its own Beta(α_i, β_i) and window W_i as
``csrc/mean_field_windows.cpp`` does, step for step (the same equations: ``structattn/
windows/``), scoring its parents again at each step over the block's widest window:

    e_i = E[ln q_i],   p_i(d) ∝ exp(ψ_{i,i−d} + d·e_i) on 1 ≤ d ≤ W_i,   m_i = Σ_d d·p_i(d),
    α_i ← a + m_i − 1 (conjugate; accumulate: α_i + m_i − 1),   β_i ← b + 1 (β_i + 1),

and W_i ← min(2 W_i, C_i) while its rule's mass beyond the window exceeds tol: the certified
bound (every unseen parent of the whole past at its score ceiling; the rule by default) or the
evidence on the window's outer half (``edge``). A child stops once E[φ_i] moves by at most
converge_tol·max(1, E[φ_i]) with its window unchanged, or after max_iters steps. The other
rules (``predictive``, ``evidence``) read log-Beta functions or the window's typical score:
they stay with the loop.

``attend_forward`` (``band_per_child``): the output at the fixed point, a band per child with
a slope per child, forward and backward.

Never the N×W table: one program per block of children holds BM×BN scores at a time. Float
arguments travel as one-element tensors in the statistics' dtype (a kernel reads a Python
float as float32), and the constants of ψ are ratios of integers (exact in any dtype).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..certificates.ceilings import running_ceilings
from . import interpreted
from ._tiles import load_tile, online_softmax, scalar, settings, statistics, width
from .band_per_child import _scores, _span, attend_backward, attend_forward

#: the window rules this kernel runs, by their number in ``structattn.windows.rules``
RULES = {1: "edge", 3: "certified"}

#: ``solve``'s launch settings on a GPU, over ``settings``'s: a block's children iterate until
#: its slowest settles, over its widest window, so few children per block waste least. The
#: fastest of ``benchmarks/profile_expanding.py``'s candidates on an H200 (float32, N = 16,384:
#: 1.8 ms against 3.6 ms with 64 children and four warps; ``results/profile_expanding.json``).
#: No fused multiply-adds outside the products (``enable_fp_fusion``): the CPU kernel is built
#: with ``-ffp-contract=off`` (``kernels._FLAGS``), so that a child's stopping and doubling
#: tests, thresholds of sums, round as the CPU kernel's do
SOLVE: dict = dict(BM=16, BN=32, num_warps=2, num_stages=2, enable_fp_fusion=False)


@triton.jit
def _digamma(x):
    """ψ(x), x > 0: the recurrence ψ(x) = ψ(x + 1) − 1/x up to x ≥ 10, then the asymptotic
    series to x⁻¹⁰ (its next term is below 3·10⁻¹⁴ there)."""
    shift = tl.zeros_like(x)
    for _ in tl.static_range(10):
        small = x < 10.0
        shift = shift - tl.where(small, 1.0 / x, 0.0)
        x = tl.where(small, x + 1.0, x)
    r = 1.0 / (x * x)
    series = r / 12.0 - r * r / 120.0 + r * r * r / 252.0 - r * r * r * r / 240.0 \
        + r * r * r * r * r / 132.0
    return shift + tl.log(x) - 0.5 / x - series


@triton.jit
def _e_ln_q(alpha, beta, DIGAMMA: tl.constexpr):
    """E[ln q] under Beta(α, β): digamma, or ln E[q] plugged in."""
    if DIGAMMA:
        return _digamma(alpha) - _digamma(alpha + beta)
    else:
        return tl.log(alpha) - tl.log(alpha + beta)


@triton.jit
def _neg_expm1(x):
    """1 − eˣ to a few ulps for x ≤ 0: Kahan's (1 − u)·x / ln u with u = eˣ near 0, where
    1 − u cancels; 1 − u itself below −½ (where u may underflow to 0)."""
    u = tl.exp(x)
    odd = (u == 1.0) | (u == 0.0)  # (lanes another branch serves: no log of 0 or 1)
    near = tl.where(u == 1.0, -x, (1.0 - u) * x / tl.log(tl.where(odd, 0.5, u)))
    return tl.where(x < -0.5, 1.0 - u, near)


@triton.jit
def _sigmoid_of_minus(x):
    """1 / (1 + eˣ) without overflow."""
    z = tl.exp(-tl.abs(x))
    return tl.where(x > 0, z / (1.0 + z), 1.0 / (1.0 + z))


@triton.jit
def _posterior_pass(a, B, g, sbg, sbp, sbk, ks, P, K, pos, w, live, e, scale,
                    RULE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, ACC: tl.constexpr,
                    PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """One step's posterior over each live child's window, by the online softmax over the
    block's parents: log Σ_d e^{ψ + d·e} (``log_z``), E[φ] (``mean``) and, for the ``edge``
    rule, the evidence's mass on the window's outer half (else 0)."""
    top = tl.full([BM], -float("inf"), dtype=ACC)
    z = tl.zeros([BM], dtype=ACC)
    zd = tl.zeros([BM], dtype=ACC)
    ev_top = tl.full([BM], -float("inf"), dtype=ACC)  # the evidence alone ("edge")
    ev_z = tl.zeros([BM], dtype=ACC)
    ev_outer = tl.zeros([BM], dtype=ACC)
    lo, hi = _span(pos, w, live, BN)
    for start in range(lo, hi, BN):
        cols = start + tl.arange(0, BN)
        s, dist, on, b = _scores(a, B, g, sbg, sbp, sbk, cols, ks, P, K, pos, w, live, scale,
                                 PRECISION, UPCAST)
        d = dist.to(ACC)
        logit = tl.where(on, s + d * e[:, None], -float("inf"))
        p, shrink, new = online_softmax(logit, top)
        z = z * shrink + tl.sum(p, axis=1)
        zd = zd * shrink + tl.sum(p * d, axis=1)
        top = new
        if RULE == 1:
            raw = tl.where(on, s, -float("inf"))
            q, ev_shrink, ev_new = online_softmax(raw, ev_top)
            ev_z = ev_z * ev_shrink + tl.sum(q, axis=1)
            ev_outer = ev_outer * ev_shrink + tl.sum(
                tl.where(dist > (w // 2)[:, None], q, 0.0), axis=1)
            ev_top = ev_new
    z = tl.where(live, z, 1.0)
    log_z = tl.where(live, top, 0.0) + tl.log(z)
    return log_z, zd / z, ev_outer / tl.where(ev_z > 0, ev_z, 1.0)  # (not "edge": 0)


@triton.jit
def _certified_bound(RUN, g, P, pos, w, e, log_z, head, slack, rmask, ACC: tl.constexpr):
    """The certified bound on each child's posterior mass beyond its window: every unseen
    parent of the whole past at its score ceiling (the longest key farther back than the
    window, ``head``·``RUN`` + ``slack``), against the window's mass less the rounding
    slack."""
    far = tl.minimum(tl.maximum(pos - w - 1, 0), P - 1)
    run = tl.load(RUN + g * P + far, mask=rmask, other=0.0)
    high = (head * run + slack).to(ACC)
    unseen = tl.maximum(pos - w, 0)
    log_out = (w.to(ACC) + 1.0) * e + tl.log(_neg_expm1(tl.maximum(unseen, 1).to(ACC) * e)) \
        - tl.log(_neg_expm1(e)) + high
    return tl.where(unseen == 0, 0.0, _sigmoid_of_minus(log_z - slack.to(ACC) - log_out))


@triton.jit
def _solve(A, B, A0, B0, W0, HEAD, SLACK, RUN, SCALE, TOL, CTOL,
           WOUT, AOUT, BOUT, MOUT, SOUT, DONE, BOUND,
           N, P, K, offset, max_iters, cap_all, sag, san, sak, sbg, sbp, sbk,
           DIGAMMA: tl.constexpr, CONJUGATE: tl.constexpr, RULE: tl.constexpr,
           PER_ROW: tl.constexpr,
           BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ACC: tl.constexpr,
           PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    scale = tl.load(SCALE)
    tol = tl.load(TOL)
    ctol = tl.load(CTOL)
    m_ = tl.program_id(0)
    g = tl.program_id(1)
    rows = m_ * BM + tl.arange(0, BM)  # child rows c; positions i = offset + c
    rmask = rows < N
    pos = offset + rows
    ks = tl.arange(0, BK)
    a = load_tile(A, g, sag, rows, san, N, ks, sak, K)
    pa = tl.load(A0 + g).to(ACC)
    pb = tl.load(B0 + g).to(ACC)
    cap = tl.where(rmask, tl.minimum(pos, cap_all), 0)  # the child's past, or the cap
    if PER_ROW:  # one first window for the row's children
        w = tl.zeros([BM], dtype=tl.int32) + tl.load(W0 + g).to(tl.int32)
    else:
        w = tl.load(W0 + g * N + rows, mask=rmask, other=0).to(tl.int32)
    w = tl.minimum(w, cap)
    head = tl.load(HEAD + g * N + rows, mask=rmask, other=0.0)  # |scale|·‖a_i‖, float64
    slack = tl.load(SLACK + g * N + rows, mask=rmask, other=0.0)  # float64
    alpha = tl.zeros([BM], dtype=ACC) + pa
    beta = tl.zeros([BM], dtype=ACC) + pb
    mean_out = tl.zeros([BM], dtype=ACC)
    m_prev = tl.full([BM], float("nan"), dtype=ACC)
    bound = tl.zeros([BM], dtype=ACC)
    steps = tl.zeros([BM], dtype=tl.int32)
    done = w < 1  # no past: nothing to iterate
    live = (w >= 1) & rmask
    t = 0
    while (t < max_iters) & (tl.max(live.to(tl.int32), axis=0) > 0):
        e = _e_ln_q(alpha, beta, DIGAMMA)
        log_z, mean, outer_ev = _posterior_pass(a, B, g, sbg, sbp, sbk, ks, P, K, pos, w, live,
                                                e, scale, RULE, BM, BN, ACC, PRECISION, UPCAST)
        bnd = _certified_bound(RUN, g, P, pos, w, e, log_z, head, slack, rmask, ACC)
        if CONJUGATE:
            new_alpha = pa + mean - 1.0
            new_beta = tl.zeros([BM], dtype=ACC) + pb + 1.0
        else:
            new_alpha = alpha + mean - 1.0
            new_beta = beta + 1.0
        outer = outer_ev if RULE == 1 else bnd
        new_w = tl.where((outer > tol) & (w < cap), tl.minimum(2 * w, cap), w)
        # (NaN before the first step: never settled at once)
        settled = (tl.abs(mean - m_prev) <= ctol * tl.maximum(tl.abs(mean), 1.0)) & (new_w == w)
        steps = tl.where(live, t + 1, steps)
        done = tl.where(live, settled, done)
        mean_out = tl.where(live, mean, mean_out)
        bound = tl.where(live, bnd, bound)
        moves = live & ~settled & (t + 1 < max_iters)  # else its state stays this step's
        alpha = tl.where(moves, new_alpha, alpha)
        beta = tl.where(moves, new_beta, beta)
        w = tl.where(moves, new_w, w)
        m_prev = tl.where(moves, mean, m_prev)
        live = moves
        t += 1
    out = g * N + rows
    tl.store(WOUT + out, w.to(tl.int64), mask=rmask)
    tl.store(AOUT + out, alpha, mask=rmask)
    tl.store(BOUT + out, beta, mask=rmask)
    tl.store(MOUT + out, mean_out, mask=rmask)
    tl.store(SOUT + out, steps.to(tl.int64), mask=rmask)
    tl.store(DONE + out, done.to(tl.int8), mask=rmask)
    tl.store(BOUND + out, bound, mask=rmask)


@torch.library.custom_op("structattn_triton::mean_field_solve", mutates_args=())
def solve(a: torch.Tensor, b: torch.Tensor, offset: int, scale: float, a0: torch.Tensor,
          b0: torch.Tensor, win0: torch.Tensor, tol: float,
          converge_tol: float, max_iters: int, cap: int, digamma: bool, conjugate: bool,
          rule: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                              torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each child's fixed point ``(window (G, N) long, α, β, E[φ], steps (long), settled
    (bool), bound)`` for ``a (G, N, k)``, ``b (G, P, k)`` (child row q at position i = offset
    + q, reading at most C_i = min(i, cap) parents) and the prior's ``a0, b0 (G,)`` —
    ``csrc/mean_field_windows.cpp``'s ``solve`` without a history, for the rules in
    ``RULES``; α, β, E[φ] and the bound in ``statistics(a.dtype)``. The first windows
    ``win0``: ``(G, N)`` per child, or ``(G,)`` one per row (the prior's quantile); each is
    taken at most C_i."""
    if rule not in RULES:
        raise ValueError(f"mean_field_solve: rule must be one of {sorted(RULES)} "
                         f"({', '.join(RULES.values())}); got {rule}")
    G, N, K = a.shape
    P = b.shape[1]
    stat = statistics(a.dtype)
    lopt = dict(dtype=torch.long, device=a.device)
    win, steps = torch.empty(G, N, **lopt), torch.empty(G, N, **lopt)
    alpha, beta, m, bound = (torch.empty(G, N, dtype=stat, device=a.device) for _ in range(4))
    done = torch.empty(G, N, dtype=torch.int8, device=a.device)
    if G and N:
        a, b = a.contiguous(), b.contiguous()
        # (the scores are computed in ``stat``, whatever the factors' dtype)
        head, slack, run = (t.contiguous() for t in running_ceilings(a, b, scale, stat))
        common = dict(settings(a.dtype, width(K), 32, 32), BK=width(K))
        if not interpreted():
            common.update(SOLVE)
        _solve[(triton.cdiv(N, common["BM"]), G)](
            a, b, a0.to(stat).contiguous(), b0.to(stat).contiguous(), win0.contiguous(), head,
            slack, run, scalar(scale, a), scalar(tol, a), scalar(converge_tol, a), win, alpha,
            beta, m, steps, done, bound, N, P, K, offset, max_iters, cap, *a.stride(),
            *b.stride(), DIGAMMA=digamma, CONJUGATE=conjugate, RULE=rule,
            PER_ROW=win0.dim() == 1, **common)
    return win, alpha, beta, m, steps, done.bool(), bound


@solve.register_fake
def _(a, b, offset, scale, a0, b0, win0, tol, converge_tol, max_iters, cap, digamma,
      conjugate, rule):
    G, N = a.shape[:2]
    stat = statistics(a.dtype)
    long_, real = a.new_empty(G, N, dtype=torch.long), a.new_empty(G, N, dtype=stat)
    return (long_, real, torch.empty_like(real), torch.empty_like(real),
            torch.empty_like(long_), a.new_empty(G, N, dtype=torch.bool), torch.empty_like(real))


__all__ = ["RULES", "SOLVE", "attend_backward", "attend_forward", "solve"]
