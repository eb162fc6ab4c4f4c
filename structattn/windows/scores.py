"""The scores of a band of parents, and what every mean-field round computes from them.

``BandScores`` holds ψ on the band of one family at one width (``structattn.operators.band``): each
child's parents at distances 1 … reach, in blocks ``(G, B, L)``; a round reads its
posterior over a window, the mass beyond the window, and the evidence on the window's
outer half from it. The scores are computed once per band width (the band widens by
doubling), so a round costs O(N·W), with no feature dimension.
"""

from __future__ import annotations

import torch

from ..certificates.beta import log_beta
from ..certificates.ceilings import running_ceilings
from ..operators import band


class BandScores:
    """The band of one family at one width: its scores ψ, flattened to blocks ``(G, B, L)``
    (G = batch · heads · blocks), and what every step reuses."""

    def __init__(self, a, b, scale, n, reach, block, work):
        self.layout = lay = band.BandLayout.for_window(n, max(reach, 1), block)
        s = band.scores(a, b, scale, lay).to(work)  # (*batch, H, nb, B, L)
        self.shape = s.shape
        self.dist = lay.distance(a.device).to(work)  # (B, L): child − parent
        # the band's own slots at distance < 1 (the child itself and later) never count
        self.scores = s.reshape(-1, lay.block, lay.width).masked_fill(self.dist < 1,
                                                                      float("-inf"))  # (G, B, L)
        # Σ_l p_l·dist_l = (mB + r)·Σ_l p_l − Σ_l p_l·l: one matrix-vector product per step
        self.offset = (lay.reach + torch.arange(lay.block, device=a.device)).to(work)  # (B,)
        self.slot = torch.arange(lay.width, device=a.device).to(work)  # (L,)
        self._factors = (a, b, scale)
        self._runs = None

    def _window(self, rows, win):
        """The scores of blocks ``rows`` (None: all) and the mask of slots beyond each child's
        window, d > max(W_i, 1), ``(k, B, L)``."""
        beyond = self.dist > win.clamp(min=1)[..., None].to(self.dist.dtype)
        return (self.scores if rows is None else self.scores[rows]), beyond

    def posterior(self, rows, win, e_ln_q):
        """For the blocks ``rows`` ``(k,)`` (None: all) with windows ``win`` ``(k, B)`` and E[ln q]
        ``(k, B)``: p(φ_i = d) ∝ exp(ψ_{i,i−d} + (d − 1) E[ln q_i]) on 1 ≤ d ≤ W_i (the
        E[ln(1 − q_i)] term is constant in d), ``(k, B, L)``, and E[φ_i] ``(k, B)``. A row
        without parents (W_i = 0) is computed at W = 1 to stay finite: the caller zeroes its
        posterior and never reads its E[φ]."""
        scores, beyond = self._window(rows, win)
        logits = torch.addcmul(scores, self.dist, e_ln_q[..., None]).masked_fill_(
            beyond, float("-inf"))
        p = torch.softmax(logits, -1)
        return p, self.offset - p @ self.slot

    def beyond_mass(self, rows, win, e_ln_q, caps):
        """The posterior mass beyond each child's window, the unseen parents W_i < d ≤ C_i
        (``caps``: the child's past, or ``max_window``) given the window's typical likelihood
        (E[e^ψ] under a Gaussian fit to the scores on 1 ≤ d ≤ W_i without the best match; the
        best match itself when W_i = 1), ``(k, B)``: see the module docstring."""
        scores, beyond = self._window(rows, win)
        s = scores.masked_fill(beyond, float("-inf"))  # ψ on 1 ≤ d ≤ W_i
        log_in = torch.logsumexp(torch.addcmul(s, self.dist, e_ln_q[..., None]), -1)
        top = s.argmax(-1, keepdim=True)
        rest = s.scatter(-1, top, float("-inf"))  # the window without its best match
        # log E[e^ψ] of a Gaussian fit to the other scores, μ + σ²/2: the sample mean of e^ψ
        # over a few heavy-tailed draws falls far below it when the scores spread widely
        seen = torch.isfinite(rest)
        count = seen.sum(-1).to(s.dtype)
        x = torch.where(seen, rest, 0.0)
        mu = x.sum(-1) / count.clamp(min=1)
        var = torch.where(seen, (x - mu[..., None]) ** 2, 0.0).sum(-1) / (count - 1).clamp(min=1)
        typical = torch.where(count > 0, mu + var / 2, s.gather(-1, top)[..., 0])
        return _beyond(log_in, win, e_ln_q, caps, typical)

    def _bounds(self):
        """Blocked ``(G, B)`` float64, once per band: |scale|·‖a_i‖ and the window scores'
        rounding slack (``ceilings.score_ceiling``'s), and the keys' running maximum length
        max_{j' ≤ j} ‖b_j'‖ ``(G_lead, N)``."""
        if self._runs is None:
            lay = self.layout
            a, b, _ = self._factors
            lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
            n = a.shape[-2]
            reach, slack, run = running_ceilings(*self._factors)
            self._runs = tuple(lay.children(t.expand(*lead, n)[..., None])[..., 0]
                               .reshape(-1, lay.block) for t in (reach, slack)) \
                + (run.expand(*lead, n).reshape(-1, n),)
        return self._runs

    def tail_ceiling(self, rows, win):
        """``(k, B)``: an upper bound on every score a child can have with a parent farther
        back than its window W_i, |scale|·‖a_i‖·max_{j ≤ i − W_i − 1} ‖b_j‖ (Cauchy–Schwarz
        with the longest key beyond the window: a running max, so a long key nearby does not
        weigh on the tail), plus the rounding slack — in float64, then the band's dtype, as
        the compiled kernel computes it."""
        lay = self.layout
        a_norm, slack, b_run = self._bounds()
        r = torch.arange(a_norm.shape[0], device=a_norm.device) if rows is None else rows
        nb = lay.num_blocks
        pos = lay.child_positions(a_norm.device)[r % nb]  # (k, B)
        far = (pos - win - 1).clamp(0, b_run.shape[-1] - 1)
        return (a_norm[r] * b_run[(r // nb)[:, None], far] + slack[r]).to(self.scores.dtype)

    def certified_mass(self, rows, win, e_ln_q, past):
        """A certified upper bound on the mean-field posterior's mass beyond each child's
        window among all of its ``past`` parents, ``(k, B)``: the φ-update at the current
        E[ln q] puts p(φ_i = d) ∝ exp(ψ_{i,i−d} + d·E[ln q_i]), and every unseen ψ is at most
        the ceiling beyond the window (``tail_ceiling``), so the unseen mass is at most
        e^{S_i(W)}·Σ_{W<d≤past} e^{d·E[ln q_i]} against the window's (computed, less the
        rounding slack) — ``beyond_mass`` with the ceiling for the typical likelihood."""
        scores, beyond = self._window(rows, win)
        s = scores.masked_fill(beyond, float("-inf"))
        slack = self._bounds()[1]
        slack = (slack if rows is None else slack[rows]).to(s.dtype)
        log_in = torch.logsumexp(torch.addcmul(s, self.dist, e_ln_q[..., None]), -1) - slack
        return _beyond(log_in, win, e_ln_q, past, self.tail_ceiling(rows, win))

    def outer_evidence(self, rows, win):
        """The evidence alone — softmax of ψ over 1 ≤ d ≤ W_i, the prior left out — on the
        window's outer half d > W_i/2, ``(k, B)``: whether the scores still point further
        back than the window's middle."""
        scores, beyond = self._window(rows, win)
        lik = torch.softmax(scores.masked_fill(beyond, float("-inf")), -1)
        return (lik * (self.dist > (win // 2)[..., None].to(self.dist.dtype))).sum(-1)


def _beyond(log_in, win, e_ln_q, caps, log_lik):
    """σ(log O − log I): the posterior mass of the unseen parents W_i < d ≤ C_i, each at
    likelihood ``log_lik``, against the window's log mass ``log_in``, ``(k, B)``."""
    w = win.clamp(min=1).to(log_in.dtype)
    # Σ_{W<d≤C} e^{d·e} = e^{(W+1)e} (1 − e^{(C−W)e}) / (1 − e^e) (the posterior's d·e
    # convention); C = W: nothing unseen, mass 0
    unseen = (caps.to(log_in.dtype) - w).clamp(min=0)
    log_out = ((w + 1) * e_ln_q + torch.log(-torch.expm1(unseen * e_ln_q))
               - torch.log(-torch.expm1(e_ln_q)) + log_lik)
    return torch.sigmoid(log_out - log_in)


def tail(alpha, beta, window, kind):
    """P(φ > W) under q's current Beta(α, β): the predictive (digamma) or plug-in geometric."""
    w = window.to(alpha.dtype)
    if kind == "digamma":
        return (log_beta(alpha + w, beta) - log_beta(alpha, beta)).exp()
    return (alpha / (alpha + beta)) ** w

