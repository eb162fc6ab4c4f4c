"""The mean-field window iteration as a loop of tensor operations (any device; the graph
for ``grad="unroll"``): the reference implementation of the scheme, equal to the compiled
kernel (``kernel.py``) to rounding.

Children are independent given the scores (each has its own q_i), so each iterates until
its own fixed point and then stops: a round computes only the blocks of the band that
still hold a moving child, so the cost is Σ_i iterations_i · W, not max_i(iterations_i)·N·W,
and a sequence's result does not depend on the others in its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..certificates.beta import log_q_expectations
from ..operators._eager import eager
from .history import MeanFieldHistory
from .rules import Round
from .scores import BandScores, tail


@dataclass
class _Problem:
    """One family's iteration as the loop reads it: the score factors (``a`` padded to all N
    tokens), the prior's Beta (``a0``, ``b0``, ``(H|1,)``), the scheme, what ``grad`` asks
    (``track``: a graph through every round; ``one_step``: one differentiable step at the
    end) and the leading dims ``(*batch, H)``."""

    a: torch.Tensor
    b: torch.Tensor
    scale: object
    a0: torch.Tensor
    b0: torch.Tensor
    scheme: object
    block_size: int
    cap: int
    track: bool
    one_step: bool
    lead: tuple
    n: int

    @property
    def work(self):
        return self.a0.dtype


class _Children:
    """Every child's state on the blocks of the band, ``(G, B)`` each: its Beta (α, β and the
    prior's), window, cap, position, whether it still moves, its E[φ] now and the round
    before, and its steps; a round updates the blocks ``rows`` that hold a moving child."""

    def __init__(self, pb: _Problem, scores: BandScores, win0, caps):
        lay, lead, n, a = scores.layout, pb.lead, pb.n, pb.a
        self.lay = lay
        real = self.blocked(torch.ones(*lead, n, dtype=torch.bool, device=a.device))  # not padding
        with torch.set_grad_enabled(pb.track or pb.one_step):
            # q_i ~ Beta(a, b) to begin; padding slots get Beta(1, 1) (finite digammas, no NaN
            # in the backward of the rows they never contribute to)
            one = torch.ones((), dtype=pb.work, device=a.device)
            self.alpha = torch.where(real, self.blocked(pb.a0[:, None].expand(*lead, n)), one)
            self.beta = torch.where(real, self.blocked(pb.b0[:, None].expand(*lead, n)), one)
            self.alpha_prior, self.beta_prior = self.alpha, self.beta
        self.win = self.blocked(win0)
        self.caps = self.blocked(caps.expand(*lead, n))
        self.past = self.blocked(torch.arange(n, device=a.device).expand(*lead, n))
        self.active = self.win >= 1  # children with a past (padding has window 0)
        self.previous_m = torch.full_like(self.win, float("nan"), dtype=pb.work)  # E[φ] before
        self.expected = torch.zeros_like(self.win, dtype=pb.work)  # each child's latest E[φ]
        self.steps = torch.zeros_like(self.win)
        self.lead = lead

    def blocked(self, t):
        """``(*batch, H, N)`` → ``(G, B)``."""
        return self.lay.children(t[..., None])[..., 0].reshape(-1, self.lay.block)

    def unblocked(self, t, layout=None):
        """``(G, B)`` → ``(*batch, H, N)``."""
        lay = self.lay if layout is None else layout
        return lay.unblock(t.reshape(*self.lead, lay.num_blocks, lay.block, 1))[..., 0]


def _widened(pb: _Problem, scores: BandScores, reach: int, p_final):
    """The band at least ``reach`` wide (doubling, at most the cap), and the posterior kept so
    far padded on the left to it (a wider band's earlier slots are farther parents)."""
    if reach <= scores.layout.reach:
        return scores, p_final
    old = scores.layout
    scores = BandScores(pb.a, pb.b, pb.scale, pb.n, max(reach, min(2 * old.reach, pb.cap)),
                        pb.block_size, pb.work)  # (no graph under grad="last")
    if scores.layout.block != old.block:
        raise AssertionError("the band keeps its block size")
    if p_final is not None:
        p_final = torch.nn.functional.pad(p_final, (scores.layout.width - old.width, 0))
    return scores, p_final


def _round(pb: _Problem, st: _Children, scores: BandScores, rows, last_round: bool,
           rec: dict, record: bool):
    """One round over the blocks ``rows``: each moving child's posterior on its window, its
    next Beta and window, and which children took their last step; updates ``st`` (and
    ``rec``: the round's windows, Beta and E[φ]). Returns ``(p, ends)`` ``(k, B, L)``,
    ``(k, B)``."""
    scheme = pb.scheme
    w = st.win[rows]  # (k, B): this round's windows
    live, alpha_r, beta_r = st.active[rows], st.alpha[rows], st.beta[rows]
    sel = None if rows.numel() == st.active.shape[0] else rows  # all busy: no gather
    e_ln_q, _ = log_q_expectations(alpha_r, beta_r, scheme.expectation)
    p, m = scores.posterior(sel, w, e_ln_q)  # (k, B, L), (k, B)
    if scheme.update == "conjugate":
        new_alpha, new_beta = st.alpha_prior[rows] + m - 1, st.beta_prior[rows] + 1
    else:
        new_alpha, new_beta = alpha_r + m - 1, beta_r + 1
    with torch.no_grad():
        new_win = scheme.window_rule.grow(Round(scores, sel, w, e_ln_q, new_alpha, new_beta,
                                                st.caps[rows], scheme.tol, scheme.expectation,
                                                pb.cap, st.past[rows]))
        m_before = st.previous_m[rows]
        settled = ((m - m_before).abs() <= scheme.converge_tol * m.abs().clamp(min=1)) \
            & (new_win == w)  # NaN before the first round: never settled at once
        moving = live & ~settled
        ends = live & (live if last_round else ~moving)  # their last step
    st.expected = st.expected.index_put((rows,), torch.where(live, m.detach(), st.expected[rows]))
    st.steps = st.steps.index_put((rows,), st.steps[rows] + live)
    _record(rec, st, scores, record)
    # a child's state moves on unless this was its last step (settled, or max_iters): its Beta
    # and window stay those of its final posterior
    moves_on = moving & ~ends
    st.alpha = st.alpha.index_put((rows,), torch.where(moves_on, new_alpha, alpha_r))
    st.beta = st.beta.index_put((rows,), torch.where(moves_on, new_beta, beta_r))
    st.win = st.win.index_put((rows,), torch.where(moves_on, new_win, w))
    st.previous_m = st.previous_m.index_put((rows,), torch.where(moving, m.detach(), m_before))
    st.active = st.active.index_put((rows,), moving)
    return p, ends


def _record(rec: dict, st: _Children, scores: BandScores, record: bool) -> None:
    """The round's windows, Beta (before its update) and E[φ] per child (``record``), and
    the band's width."""
    if record:
        rec["windows"].append(st.unblocked(st.win, scores.layout))
        rec["alpha"].append(st.unblocked(st.alpha.detach(), scores.layout))
        rec["beta"].append(st.unblocked(st.beta.detach(), scores.layout))
        rec["m"].append(st.unblocked(st.expected, scores.layout))
    rec["band"].append(scores.layout.reach)


def _last_step(pb: _Problem, st: _Children, scores: BandScores):
    """``grad="last"``: one differentiable step from the detached fixed point: ∂α/∂a =
    ∂β/∂b = 1 in both updates (conjugate: α = a + E[φ] − 1; accumulate: α = a + Σ_t (E_t[φ]
    − 1)); children without a past get zero."""
    alpha_f = st.alpha.detach() + (st.alpha_prior - st.alpha_prior.detach())
    beta_f = st.beta.detach() + (st.beta_prior - st.beta_prior.detach())
    if not scores.scores.requires_grad:  # the band widened without a graph
        scores = BandScores(pb.a, pb.b, pb.scale, pb.n, scores.layout.reach, pb.block_size,
                            pb.work)
    win_f = st.win  # (each child's window at its last step; the blocking never changes)
    p, _ = scores.posterior(None, win_f, log_q_expectations(alpha_f, beta_f,
                                                            pb.scheme.expectation)[0])
    return p * (win_f >= 1)[..., None], scores


def _history(pb: _Problem, st: _Children, scores: BandScores, rec: dict, off: int, dtype):
    """The ``MeanFieldHistory`` of the rounds recorded, the children's from position ``off``."""
    scheme = pb.scheme
    with torch.no_grad():
        discarded = st.unblocked(tail(st.alpha, st.beta, st.win, scheme.expectation),
                                 scores.layout)
        e_final = log_q_expectations(st.alpha.detach(), st.beta.detach(), scheme.expectation)[0]
        bound = st.unblocked(scores.certified_mass(None, st.win, e_final, st.past),
                             scores.layout)
    empty = torch.zeros(0, *pb.lead, pb.n, device=pb.a.device, dtype=dtype)

    def stacked(key, like):
        return (torch.stack(rec[key]) if rec[key] else like)[..., off:]
    return MeanFieldHistory(
        windows=stacked("windows", empty.long()), alpha=stacked("alpha", empty),
        beta=stacked("beta", empty), expected_distance=stacked("m", empty),
        band=rec["band"], iterations=len(rec["band"]), converged=not bool(st.active.any()),
        discarded=discarded[..., off:].to(dtype), bound=bound[..., off:].to(dtype),
        child_iterations=st.unblocked(st.steps, scores.layout)[..., off:], offset=off)


@eager
def mean_field(family, factors, scheme, grad: str, record: bool):
    """Iterate the mean-field equations (``MeanFieldWindows``) for one family; returns the
    band posterior ``(*batch, H, nb, B, L)``, its layout and the ``MeanFieldHistory`` (None
    unless ``record``).

    A child settles once |ΔE[φ_i]| ≤ converge_tol·max(1, E[φ_i]) with its window no longer
    growing. ``grad="unroll"``: back-propagate through every round (the exact derivative of
    the computed map). ``grad="last"``: iterate without a graph, then take one
    differentiable step from the detached fixed point — scores and the Beta parameters'
    dependence on a, b — O(N·W) memory whatever the number of rounds.

    Its length and band widths depend on the data, so ``torch.compile`` leaves it to eager
    mode (the projections around it are compiled) rather than recompiling per round."""
    prior = family.prior  # a BetaGeometric
    xc = family.children.states
    n = family.parents.size
    off = n - family.children.size  # the children are the last C tokens: the loop runs over
    # all n, the first off at window 0 (never iterate); ``factors``: the ScoreFactors
    a, b, scale = factors
    a = torch.nn.functional.pad(a, (0, 0, off, 0))  # (*batch, H, N, k)
    a0, b0 = prior.params(a.device, xc.dtype)  # (H|1,)
    pb = _Problem(a, b, scale, a0, b0, scheme, prior.block_size, scheme.cap(family),
                  track=grad == "unroll" and torch.is_grad_enabled(),
                  one_step=grad == "last" and torch.is_grad_enabled(), lead=a.shape[:-2], n=n)
    caps, win0 = scheme.initial_windows(a0, b0, pb.lead, n, pb.cap)
    win0[..., :off] = 0
    # built with the graph when one is wanted at all: "last" reuses it for its one step
    scores = BandScores(a, b, scale, n, int(win0.max()) if win0.numel() else 1,
                        prior.block_size, pb.work)
    st = _Children(pb, scores, win0, caps)
    pieces = []  # (blocks, posterior rows zeroed but for the children whose last step it is)
    in_place = not pb.track and not pb.one_step  # no graph at all: one buffer, not every step
    p_final = None
    rec = {"windows": [], "alpha": [], "beta": [], "m": [], "band": []}
    with torch.set_grad_enabled(pb.track):
        for t in range(scheme.max_iters):
            rows = st.active.any(-1).nonzero()[:, 0]  # blocks holding a moving child
            if rows.numel() == 0:
                break
            scores, p_final = _widened(pb, scores, int(st.win[rows].max()), p_final)
            p, ends = _round(pb, st, scores, rows, t + 1 == scheme.max_iters, rec, record)
            if in_place:
                if p_final is None:
                    p_final = torch.zeros(scores.scores.shape, dtype=pb.work, device=a.device)
                p_final[rows] = torch.where(ends[..., None], p, p_final[rows])
            elif not pb.one_step:  # (grad="last" recomputes every posterior in one step)
                pieces.append((rows, p * ends[..., None]))
    # each child's posterior from its last step: one scatter-add of every step's rows (a
    # narrower band's rows padded on the left: their slots are the nearer parents)
    if p_final is None:
        p_final = torch.zeros(scores.scores.shape, dtype=pb.work, device=a.device)
    if pieces:
        width = scores.layout.width
        p_final = p_final.index_add(0, torch.cat([r for r, _ in pieces]), torch.cat(
            [torch.nn.functional.pad(q, (width - q.shape[-1], 0)) for _, q in pieces]))
    if pb.one_step:
        p_final, scores = _last_step(pb, st, scores)
    history = _history(pb, st, scores, rec, off, xc.dtype) if record else None
    return p_final.reshape(scores.shape).to(xc.dtype), scores.layout, history
