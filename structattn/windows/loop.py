"""The mean-field window iteration as a loop of tensor operations (any device; the graph
for ``grad="unroll"``): the reference implementation of the scheme, equal to the compiled
kernel (``kernel.py``) to rounding.

Children are independent given the scores (each has its own q_i), so each iterates until
its own fixed point and then stops: a round computes only the blocks of the band that
still hold a moving child, so the cost is Σ_i iterations_i · W, not max_i(iterations_i)·N·W,
and a sequence's result does not depend on the others in its batch.
"""

from __future__ import annotations

import torch

from .._eager import eager
from ..beta import log_q_expectations
from .history import MeanFieldHistory
from .rules import Round
from .scores import BandScores, tail


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
    work = a0.dtype
    cap = scheme.cap(family)
    rule = scheme.window_rule
    track = grad == "unroll" and torch.is_grad_enabled()
    one_step = grad == "last" and torch.is_grad_enabled()  # then: a final step with grad
    lead = a.shape[:-2]  # (*batch, H)

    def blocked(t, layout):
        """``(*batch, H, N)`` → ``(G, B)``."""
        return layout.children(t[..., None])[..., 0].reshape(-1, layout.block)

    def unblocked(t, layout):
        """``(G, B)`` → ``(*batch, H, N)``."""
        return layout.unblock(t.reshape(*lead, layout.num_blocks, layout.block, 1))[..., 0]

    # per-child state on the blocks of the first band: (G, B)
    caps, win0 = scheme.initial_windows(a0, b0, lead, n, cap)
    win0[..., :off] = 0
    # built with the graph when one is wanted at all: "last" reuses it for its one step
    scores = BandScores(a, b, scale, n, int(win0.max()) if win0.numel() else 1,
                        prior.block_size, work)
    lay = scores.layout
    real = blocked(torch.ones(*lead, n, dtype=torch.bool, device=a.device), lay)  # not padding
    with torch.set_grad_enabled(track or one_step):
        # q_i ~ Beta(a, b) to begin; padding slots get Beta(1, 1) (finite digammas, no NaN in
        # the backward of the rows they never contribute to)
        one = torch.ones((), dtype=work, device=a.device)
        alpha = torch.where(real, blocked(a0[:, None].expand(*lead, n), lay), one)
        beta = torch.where(real, blocked(b0[:, None].expand(*lead, n), lay), one)
        alpha_prior, beta_prior = alpha, beta
    win = blocked(win0, lay)
    caps_b = blocked(caps.expand(*lead, n), lay)
    past_b = blocked(torch.arange(n, device=a.device).expand(*lead, n), lay)  # (G, B)
    active = win >= 1  # children with a past (padding has window 0)
    previous_m = torch.full_like(win, float("nan"), dtype=work)  # E[φ] of the round before
    expected = torch.zeros_like(win, dtype=work)  # each child's latest E[φ]
    steps = torch.zeros_like(win)
    pieces = []  # (blocks, posterior rows zeroed but for the children whose last step it is)
    in_place = not track and not one_step  # no graph at all: keep one buffer, not every step
    p_final = None
    rec = {"windows": [], "alpha": [], "beta": [], "m": [], "band": []}
    with torch.set_grad_enabled(track):
        for t in range(scheme.max_iters):
            busy = active.any(-1)
            rows = busy.nonzero()[:, 0]  # blocks holding a moving child
            if rows.numel() == 0:
                break
            w = win[rows]  # (k, B): this round's windows
            reach = int(w.max())
            if reach > scores.layout.reach:  # widen the band (doubling) and carry the state
                old = scores.layout
                scores = BandScores(a, b, scale, n, max(reach, min(2 * old.reach, cap)),
                                    prior.block_size, work)  # (no graph under grad="last")
                if scores.layout.block != old.block:
                    raise AssertionError("the band keeps its block size")
                if p_final is not None:  # earlier slots of a wider band: farther parents
                    p_final = torch.nn.functional.pad(p_final, (scores.layout.width
                                                                - old.width, 0))
            # the blocks' children this round, (k, B) each
            live, alpha_r, beta_r, caps_r = active[rows], alpha[rows], beta[rows], caps_b[rows]
            sel = None if rows.numel() == busy.numel() else rows  # all busy: no gather
            e_ln_q, _ = log_q_expectations(alpha_r, beta_r, scheme.expectation)
            p, m = scores.posterior(sel, w, e_ln_q)  # (k, B, L), (k, B)
            if scheme.update == "conjugate":
                new_alpha, new_beta = alpha_prior[rows] + m - 1, beta_prior[rows] + 1
            else:
                new_alpha, new_beta = alpha_r + m - 1, beta_r + 1
            with torch.no_grad():
                new_win = rule.grow(Round(scores, sel, w, e_ln_q, new_alpha, new_beta, caps_r,
                                          scheme.tol, scheme.expectation, cap, past_b[rows]))
                m_before = previous_m[rows]
                settled = ((m - m_before).abs() <= scheme.converge_tol * m.abs().clamp(min=1)) \
                    & (new_win == w)  # NaN before the first round: never settled at once
                moving = live & ~settled
                last_round = t + 1 == scheme.max_iters
                ends = live & (live if last_round else ~moving)  # their last step
            if in_place:
                if p_final is None:
                    p_final = torch.zeros(scores.scores.shape, dtype=work, device=a.device)
                p_final[rows] = torch.where(ends[..., None], p, p_final[rows])
            elif not one_step:  # (grad="last" recomputes every posterior in one step at the end)
                pieces.append((rows, p * ends[..., None]))
            expected = expected.index_put((rows,), torch.where(live, m.detach(), expected[rows]))
            steps = steps.index_put((rows,), steps[rows] + live)
            if record:
                rec["windows"].append(unblocked(win, scores.layout))
                rec["alpha"].append(unblocked(alpha.detach(), scores.layout))
                rec["beta"].append(unblocked(beta.detach(), scores.layout))
                rec["m"].append(unblocked(expected, scores.layout))
            rec["band"].append(scores.layout.reach)
            # a child's state moves on unless this was its last step (settled, or max_iters):
            # its Beta and window stay those of its final posterior
            moves_on = moving & ~ends
            alpha = alpha.index_put((rows,), torch.where(moves_on, new_alpha, alpha_r))
            beta = beta.index_put((rows,), torch.where(moves_on, new_beta, beta_r))
            win = win.index_put((rows,), torch.where(moves_on, new_win, w))
            previous_m = previous_m.index_put((rows,), torch.where(moving, m.detach(), m_before))
            active = active.index_put((rows,), moving)
    converged = not bool(active.any())
    # each child's posterior from its last step: one scatter-add of every step's rows (a
    # narrower band's rows padded on the left: their slots are the nearer parents)
    width = scores.layout.width
    if p_final is None:
        p_final = torch.zeros(scores.scores.shape, dtype=work, device=a.device)
    if pieces:
        p_final = p_final.index_add(0, torch.cat([r for r, _ in pieces]), torch.cat(
            [torch.nn.functional.pad(q, (width - q.shape[-1], 0)) for _, q in pieces]))
    if one_step:
        # one differentiable step from the detached fixed point: ∂α/∂a = ∂β/∂b = 1 in both
        # updates (conjugate: α = a + E[φ] − 1; accumulate: α = a + Σ_t (E_t[φ] − 1))
        alpha_f = alpha.detach() + (alpha_prior - alpha_prior.detach())
        beta_f = beta.detach() + (beta_prior - beta_prior.detach())
        if not scores.scores.requires_grad:  # the band widened without a graph
            scores = BandScores(a, b, scale, n, scores.layout.reach, prior.block_size, work)
        win_f = win  # (each child's window at its last step; the blocking never changes)
        p_final, _ = scores.posterior(None, win_f, log_q_expectations(alpha_f, beta_f,
                                                                      scheme.expectation)[0])
        p_final = p_final * (win_f >= 1)[..., None]  # children without a past: zero
    history = None
    if record:
        with torch.no_grad():
            discarded = unblocked(tail(alpha, beta, win, scheme.expectation), scores.layout)
            e_final = log_q_expectations(alpha.detach(), beta.detach(), scheme.expectation)[0]
            bound = unblocked(scores.certified_mass(None, win, e_final, past_b), scores.layout)
        empty = torch.zeros(0, *lead, n, device=a.device, dtype=xc.dtype)

        def stacked(key, like):
            return (torch.stack(rec[key]) if rec[key] else like)[..., off:]
        history = MeanFieldHistory(
            windows=stacked("windows", empty.long()), alpha=stacked("alpha", empty),
            beta=stacked("beta", empty), expected_distance=stacked("m", empty),
            band=rec["band"], iterations=len(rec["band"]), converged=converged,
            discarded=discarded[..., off:].to(xc.dtype), bound=bound[..., off:].to(xc.dtype),
            child_iterations=unblocked(steps, scores.layout)[..., off:], offset=off)
    p_final = p_final.reshape(scores.shape)
    return p_final.to(xc.dtype), scores.layout, history

