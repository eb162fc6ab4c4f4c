"""Mean-field windows: the geometric–Beta prior's own inference scheme (expanding attention).

(The exact beta-geometric posterior over a window is a support kind, ``structattn.kinds.window``.)

``MeanFieldOperator``: the paper's mean-field scheme q(φ_i) q(q_i), each child with its
  own window W_i. Iterate to a fixed point (SPEC.md, "Geometric–Beta prior"):

    1. E[ln q_i], E[ln(1 − q_i)] under Beta(α_i, β_i) (digamma; or ln E[q] plugged in);
    2. p_t(φ_i = d) ∝ exp(ψ_{i,i−d} + (d − 1) E[ln q_i] + E[ln(1 − q_i)]), 1 ≤ d ≤ W_i;
    3. α_i ← a + E_{p_t}[φ_i] − 1, β_i ← b + 1 (conjugate; or accumulate: α_i ← α_i +
       E[φ_i] − 1, β_i ← β_i + 1, the authors' code);
    4. W_i ← max(W_i, smallest W with predictive tail P(φ_i > W) < tol), capped by i and
       ``max_window``: a window grows only while the posterior predicts mass beyond it
       (``window_rule="predictive"``); or ``window_rule="edge"``: W_i ← 2 W_i while the
       evidence (softmax of ψ over the window, the prior left out) puts more than tol on the
       window's outer half, d > W_i/2 — a token keeps looking further back until its best
       match sits confidently in the inner half; or ``window_rule="evidence"``: W_i ← 2 W_i
       while the posterior mass beyond the window exceeds tol, the unseen parents
       W_i < d ≤ C_i (C_i: the child's past, or ``max_window``) given the window's typical
       likelihood L̄_i = E[e^ψ] under a Gaussian fit to the window's scores without its best
       match, log L̄_i = mean + variance/2 (the best match alone when it is the only one):

           P(φ_i > W_i) ≈ L̄_i Σ_{W_i<d≤C_i} e^{(d−1)E[ln q_i]} / (L̄_i Σ_{W_i<d≤C_i} … +
           Σ_{d≤W_i} e^{ψ_{i,i−d} + (d−1)E[ln q_i]}),

       so a token stops as soon as a match stands out of its window's noise, and keeps
       looking, as far as its prior expects parents, while none does.

  The scores are computed once per band width (the band widens by doubling), each
  iteration costs O(N·W) (no feature dimension), the value read O(N·W·d_v): the cost
  follows the inferred context length, not N.

  Two implementations of the same equations: ``mean_field``, a loop of tensor operations
  over the band (any device; the graph for ``grad="unroll"``), and ``mean_field_compiled``,
  which on the CPU, wherever no graph through the iteration is needed, runs each child's
  whole iteration in one call of the compiled kernel (``structattn.kernels``,
  ``csrc/mean_field_windows.cpp``), scoring its parents lazily as its window grows.

The children may be the last C of the P parent tokens (``layer(x, last=C)``): child i sits
at position P − C + i, and only those C windows are computed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from . import band
from .beta import beta_quantile, log_beta, log_q_expectations, plug_in_quantile
from .kinds.base import Operator
from .kinds.window import keep_from_position


@dataclass
class WindowTrace:
    """What the mean-field iteration did, per round t: ``windows`` ``(T, *batch, H, N)`` long,
    ``alpha`` / ``beta`` ``(T, *batch, H, N)`` (q's Beta parameters the posterior of round t
    used) and ``expected_distance`` ``(T, *batch, H, N)`` (E_{p_t}[φ_i]) — a child that has
    settled keeps its final values; ``iterations`` T (rounds: the slowest child's
    iterations); ``child_iterations`` ``(*batch, H, N)``: each child's own; ``converged``:
    every child settled within ``max_iters``; ``discarded``: the final predictive tail mass
    beyond each window; ``offset``: the first child's position (children are the last N of
    offset + N tokens, ``last=``). A child at position 0 (no past) has window 0 and no
    iterations. ``band``: the Python loop's band reach per round; the compiled kernel builds
    no band and reports the widest window it scored that round."""

    windows: torch.Tensor
    alpha: torch.Tensor
    beta: torch.Tensor
    expected_distance: torch.Tensor
    band: list = field(default_factory=list)
    iterations: int = 0
    converged: bool = False
    discarded: torch.Tensor | None = None
    child_iterations: torch.Tensor | None = None
    offset: int = 0

    @property
    def mean_window(self) -> float:
        """The final windows' mean over children that have a past (0 when nothing iterated)."""
        if self.windows.shape[0] == 0 or self.windows.numel() == 0:
            return 0.0
        w = self.windows[-1].to(torch.float64)
        w = w[..., 1:] if self.offset == 0 else w  # the child at position 0 has no past
        return float(w.mean()) if w.shape[-1] else 0.0

    def relative_operations(self, d: int) -> float:
        """The authors' counted-operations metric against full attention, averaged over
        children: mean_i W_i · (d + iterations_i + 1) / (n · d), n the tokens each child
        would read under full attention (all of them, also with ``last=``)."""
        n = self.offset + self.windows.shape[-1]
        if self.windows.shape[0] == 0 or self.windows.numel() == 0:
            return 0.0
        w = self.windows[-1].to(torch.float64)
        its = (self.child_iterations if self.child_iterations is not None
               else torch.full_like(w, self.iterations)).to(torch.float64)
        return float((w * (d + its + 1)).mean()) / (n * d)


class MeanFieldOperator(Operator):
    """The mean-field geometric–Beta posterior with a window per child (module docstring):
    the prior's inference scheme (``BetaGeometric(inference="mean_field")``). The posterior
    it reads is the mean-field one, so it is not the exact softmax the dense twin would give:
    ``adjoint`` and ``mass`` read its own dense posterior, and it has no ``log_partition``
    (it cannot join the iteration of latent node sets)."""

    def __init__(self, family, cache=None):
        super().__init__(family, cache)
        self._solved = None

    def _solve(self):
        if self._solved is None:
            f = self.family
            if not self.is_fused():
                raise ValueError(f"edge family {f.name!r}: a beta-geometric prior "
                                 f"needs exactly one factorised potential (ψ = ⟨a_i, b_j⟩·scale, "
                                 f"e.g. Bilinear); got {[type(p).__name__ for p in f.potentials]}")
            factors = ScoreFactors(*self.fused_factors())
            solved = mean_field_compiled(f, factors)
            if solved is None:
                p, layout, trace = mean_field(f, factors)
                off = f.parents.size - f.children.size  # children: the last C tokens
                keep = keep_from_position(f.parents.size, p.device, p.dtype)[off:]

                def attend(u):
                    return band.apply(p, u, layout)[..., off:, :] * keep
                solved = (attend, lambda: layout.to_dense(p)[..., off:, :], trace)
            self._solved = solved
            f.trace = solved[2]
        return self._solved

    def attend(self, u):
        return self._solve()[0](u)

    def dense_posterior(self):
        return self._solve()[1]()

    def adjoint(self, u):
        return self.dense_posterior().transpose(-1, -2) @ u

    def mass(self):
        return self.dense_posterior().sum(-2).unsqueeze(-1)

    def log_partition(self):
        raise ValueError(f"edge family {self.family.name!r}: a mean-field prior has no "
                         f"log-partition to add to a free energy; use inference='exact'")


class _Band:
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
        w = win.clamp(min=1).to(s.dtype)
        # log E[e^ψ] of a Gaussian fit to the other scores, μ + σ²/2: the sample mean of e^ψ
        # over a few heavy-tailed draws falls far below it when the scores spread widely
        seen = torch.isfinite(rest)
        count = seen.sum(-1).to(s.dtype)
        x = torch.where(seen, rest, 0.0)
        mu = x.sum(-1) / count.clamp(min=1)
        var = torch.where(seen, (x - mu[..., None]) ** 2, 0.0).sum(-1) / (count - 1).clamp(min=1)
        typical = torch.where(count > 0, mu + var / 2, s.gather(-1, top)[..., 0])
        # Σ_{W<d≤C} e^{d·e} = e^{(W+1)e} (1 − e^{(C−W)e}) / (1 − e^e) (the posterior's d·e
        # convention); C = W: nothing unseen, mass 0
        unseen = (caps.to(s.dtype) - w).clamp(min=0)
        log_out = ((w + 1) * e_ln_q + torch.log(-torch.expm1(unseen * e_ln_q))
                   - torch.log(-torch.expm1(e_ln_q)) + typical)
        return torch.sigmoid(log_out - log_in)

    def outer_evidence(self, rows, win):
        """The evidence alone — softmax of ψ over 1 ≤ d ≤ W_i, the prior left out — on the
        window's outer half d > W_i/2, ``(k, B)``: whether the scores still point further
        back than the window's middle."""
        scores, beyond = self._window(rows, win)
        lik = torch.softmax(scores.masked_fill(beyond, float("-inf")), -1)
        return (lik * (self.dist > (win // 2)[..., None].to(self.dist.dtype))).sum(-1)


def _kernel_trace(prior, lead, n, offset, win0, a0g, b0g, win, alpha, beta, steps, settled,
                  h_win, h_alpha, h_beta, h_m, dtype):
    """The ``WindowTrace`` from the kernel's per-child histories ``(max_iters, G, N)``: round
    t holds each child's step min(t, steps − 1) (a settled child keeps its last); ``band``:
    the widest window scored at each round."""
    G = win.shape[0]
    with torch.no_grad():
        rounds = int(steps.max()) if steps.numel() else 0
        t = torch.arange(rounds, device=win.device)[:, None, None]
        at = torch.minimum(t, (steps - 1).clamp(min=0)).expand(rounds, G, n)
        none = steps == 0  # no past: window 0, the prior's Beta, E[φ] 0

        def history(h, first):
            got = h.gather(0, at) if rounds else h[:0]
            return torch.where(none, first, got).reshape(rounds, *lead, n)
        h_win = history(h_win, win0.reshape(G, n))
        live = (t < steps).reshape(rounds, G * n)  # who scored at round t
        band_w = [int(h_win.reshape(rounds, G * n)[r][live[r]].max()) for r in range(rounds)]
        return WindowTrace(
            windows=h_win, alpha=history(h_alpha, a0g[:, None].expand(G, n)),
            beta=history(h_beta, b0g[:, None].expand(G, n)),
            expected_distance=history(h_m, torch.zeros((), dtype=h_m.dtype, device=h_m.device)),
            band=band_w, iterations=rounds, converged=bool(settled.all()),
            discarded=_tail(alpha, beta, win, prior.expectation).reshape(*lead, n).to(dtype),
            child_iterations=steps.reshape(*lead, n), offset=offset)


def _initial_windows(prior, a0, b0, lead, n, cap, offset=0):
    """``caps`` ``(offset + N,)`` (the child at position i sees at most min(i, cap) parents)
    and the first windows of the N children at positions offset … offset + N − 1
    ``(*lead, N)``: the prior's tail quantile at tol, or ``initial_window``; no grad."""
    quantile = beta_quantile if prior.expectation == "digamma" else plug_in_quantile
    with torch.no_grad():
        caps = torch.arange(offset + n, device=a0.device).clamp(max=cap)
        if prior.initial_window is not None:
            win0 = torch.full((*lead, n), prior.initial_window, dtype=torch.long,
                              device=a0.device).clamp(max=cap)
        else:
            win0 = quantile(a0[:, None].expand(*lead, n), b0[:, None].expand(*lead, n),
                            prior.tol, cap)
        win0 = torch.minimum(win0, caps[offset:])
    return caps, win0


_RULES = {"predictive": 0, "edge": 1, "evidence": 2}


class ScoreFactors(NamedTuple):
    """ψ_ij = scale·⟨a_i, b_j⟩: ``a`` ``(*batch, H, C, k)``, ``b`` ``(*batch, H, P, k)``."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float


@torch.compiler.disable
def mean_field_compiled(family, factors):
    """The same iteration as ``mean_field``, each child's whole iteration in the compiled CPU
    kernel (``structattn.kernels``); returns ``(attend, posterior, trace)``, or None (then
    ``mean_field`` runs) where it does not apply — not on the CPU, no kernel,
    or ``grad="unroll"`` with a gradient to carry (the derivative through every iteration
    needs the Python loop's graph).

    The kernel returns each child's fixed point (window, α, β); the output is then one more
    posterior at that fixed point — the kernel's ``attend`` without grad, or under
    ``grad="last"`` the differentiable step on the band, exactly as ``mean_field`` takes it.
    The trace (None when no reader asked for it: then no history is kept) has as ``band``
    the widest window scored at each round (no band is built)."""
    from . import kernels

    prior = family.prior  # a BetaGeometric
    xc = family.children.states
    a, b, scale = factors  # (*batch, H, N, k), (*batch, H, P, k)
    a0, b0 = prior.params(a.device, xc.dtype)  # (H|1,)
    work = a0.dtype
    # the derivative through every iteration (grad="unroll") needs the loop's graph, when
    # anything the iteration reads carries a gradient
    unrolled = prior.grad == "unroll" and torch.is_grad_enabled() and any(
        t.requires_grad for t in (a, b, a0, b0))
    if xc.device.type != "cpu" or unrolled or work not in (torch.float32, torch.float64):
        return None
    ops = kernels.mean_field_windows()
    if ops is None:
        return None
    n, n_all = family.children.size, family.parents.size
    off = n_all - n  # the children are the last n of the n_all tokens
    cap = max(1, n_all - 1 if prior.max_window is None else min(n_all - 1, prior.max_window))
    lead = a.shape[:-2]  # (*batch, H)
    caps, win0 = _initial_windows(prior, a0, b0, lead, n, cap, off)
    record = getattr(family, "record_trace", True)
    with torch.no_grad():
        af = a.detach().to(work).reshape(-1, n, a.shape[-1])  # (G, N, k)
        bf = b.detach().to(work).reshape(-1, n_all, b.shape[-1])  # (G, P, k)
        G = af.shape[0]
        a0g = a0.detach().expand(*lead).reshape(G)  # each row's head
        b0g = b0.detach().expand(*lead).reshape(G)
        win, alpha, beta, m, steps, settled, h_win, h_alpha, h_beta, h_m = ops.solve(
            af, bf, off, float(scale), a0g, b0g, win0.reshape(G, n), caps, float(prior.tol),
            float(prior.converge_tol), prior.max_iters, cap, prior.expectation == "digamma",
            prior.update == "conjugate", _RULES[prior.window_rule], record)
    trace = _kernel_trace(prior, lead, n, off, win0, a0g, b0g, win, alpha, beta, steps,
                          settled, h_win, h_alpha, h_beta, h_m, xc.dtype) if record else None
    win_l = win.reshape(*lead, n)

    def band_posterior(alpha_f, beta_f):
        """The posterior at the fixed point on a band over all P tokens (the first P − C,
        not children, at window 0), with grad where a, b carry it; → band, layout."""
        front = torch.nn.functional.pad
        reach = max(1, int(win.max()) if win.numel() else 1)
        bnd = _Band(front(a, (0, 0, off, 0)), b, scale, n_all, reach, prior.block_size, work)
        lay = bnd.layout

        def blocked(t):  # (*lead, N) → (G', B), the front and padding slots at 0
            return lay.children(front(t, (off, 0))[..., None])[..., 0].reshape(-1, lay.block)

        win_b = blocked(win_l)
        # padding slots at Beta(1, 1): finite digammas, no NaN in the backward
        e = log_q_expectations(blocked(alpha_f - 1) + 1, blocked(beta_f - 1) + 1,
                                prior.expectation)[0]
        p, _ = bnd.posterior(None, win_b, e)
        p = (p * (win_b >= 1)[..., None]).reshape(bnd.shape).to(xc.dtype)
        return p, lay

    if prior.grad == "last" and torch.is_grad_enabled():
        # one differentiable step from the detached fixed point (as mean_field)
        a_prior = a0[:, None].expand(*lead, n)
        b_prior = b0[:, None].expand(*lead, n)
        alpha_f = alpha.reshape(*lead, n) + (a_prior - a_prior.detach())
        beta_f = beta.reshape(*lead, n) + (b_prior - b_prior.detach())
        p, lay = band_posterior(alpha_f, beta_f)
        return ((lambda u: band.apply(p, u, lay)[..., off:, :]),
                (lambda: lay.to_dense(p)[..., off:, :]), trace)

    e_final = log_q_expectations(alpha, beta, prior.expectation)[0]  # (G, N)

    @torch.compiler.disable  # an opaque C++ call: torch.compile runs it eagerly
    def attend(u):  # u: (*batch, H, N, d_v)
        out = ops.attend(af, bf, u.detach().to(work).reshape(G, n_all, u.shape[-1]), off,
                         float(scale), win, e_final)
        return out.reshape(*lead, n, u.shape[-1]).to(u.dtype)

    def posterior():
        p, lay = band_posterior(alpha.reshape(*lead, n), beta.reshape(*lead, n))
        return lay.to_dense(p)[..., off:, :]
    return attend, posterior, trace


@torch.compiler.disable
def mean_field(family, factors):
    """Iterate the mean-field equations for one family; returns the band posterior
    ``(*batch, H, nb, B, L)``, its layout and the ``WindowTrace``.

    Children are independent given the scores (each has its own q_i), so each iterates until
    its own fixed point — |ΔE[φ_i]| ≤ converge_tol·max(1, E[φ_i]) with its window no longer
    growing — and then stops: a step computes only the blocks that still hold a moving child,
    so the cost is Σ_i (iterations_i)·W, not max_i(iterations_i)·N·W, and a sequence's result
    does not depend on the others in its batch.

    ``grad="unroll"``: back-propagate through every iteration (the exact derivative of the
    computed map). ``grad="last"``: iterate without a graph, then take one differentiable step
    from the detached fixed point — scores and the Beta parameters' dependence on a, b —
    O(N·W) memory whatever the number of iterations.

    Its length and band widths depend on the data, so ``torch.compile`` leaves it to eager
    mode (the projections around it are compiled) rather than recompiling per iteration."""
    prior = family.prior  # a BetaGeometric
    xc = family.children.states
    n = family.parents.size
    off = n - family.children.size  # the children are the last C tokens: the loop runs over
    # all n, the first off at window 0 (never iterate); ``factors``: the ScoreFactors
    a, b, scale = factors
    a = torch.nn.functional.pad(a, (0, 0, off, 0))  # (*batch, H, N, k)
    a0, b0 = prior.params(a.device, xc.dtype)  # (H|1,)
    work = a0.dtype
    cap = max(1, n - 1 if prior.max_window is None else min(n - 1, prior.max_window))
    quantile = beta_quantile if prior.expectation == "digamma" else plug_in_quantile
    track = prior.grad == "unroll" and torch.is_grad_enabled()
    one_step = prior.grad == "last" and torch.is_grad_enabled()  # then: a final step with grad
    lead = a.shape[:-2]  # (*batch, H)

    def blocked(t, layout):
        """``(*batch, H, N)`` → ``(G, B)``."""
        return layout.children(t[..., None])[..., 0].reshape(-1, layout.block)

    def unblocked(t, layout):
        """``(G, B)`` → ``(*batch, H, N)``."""
        return layout.unblock(t.reshape(*lead, layout.num_blocks, layout.block, 1))[..., 0]

    def grown(win, alpha, beta, caps):
        """Windows grown where the predictive tail beyond them is still ≥ tol (never shrunk)."""
        need = (_tail(alpha, beta, win, prior.expectation) >= prior.tol) & (win < caps)
        if not bool(need.any()):
            return win
        idx = need.nonzero(as_tuple=True)
        out = win.clone()
        out[idx] = torch.minimum(quantile(alpha[idx], beta[idx], prior.tol, cap), caps[idx])
        return out

    # per-child state on the blocks of the first band: (G, B)
    caps, win0 = _initial_windows(prior, a0, b0, lead, n, cap)
    win0[..., :off] = 0
    # built with the graph when one is wanted at all: "last" reuses it for its one step
    current = _Band(a, b, scale, n, int(win0.max()) if win0.numel() else 1, prior.block_size,
                    work)
    lay = current.layout
    real = blocked(torch.ones(*lead, n, dtype=torch.bool, device=a.device), lay)  # not padding
    with torch.set_grad_enabled(track or one_step):
        # q_i ~ Beta(a, b) to begin; padding slots get Beta(1, 1) (finite digammas, no NaN in
        # the backward of the rows they never contribute to)
        one = torch.ones((), dtype=work, device=a.device)
        alpha = torch.where(real, blocked(a0[:, None].expand(*lead, n), lay), one)
        beta = torch.where(real, blocked(b0[:, None].expand(*lead, n), lay), one)
        a_prior, b_prior = alpha, beta
    win = blocked(win0, lay)
    caps_b = blocked(caps.expand(*lead, n), lay)
    active = win >= 1  # children with a past (padding has window 0)
    m_prev = torch.full_like(win, float("nan"), dtype=work)
    m_all = torch.zeros_like(win, dtype=work)
    steps = torch.zeros_like(win)
    pieces = []  # (blocks, posterior rows zeroed but for the children whose last step it is)
    in_place = not track and not one_step  # no graph at all: keep one buffer, not every step
    p_final = None
    rec = {"windows": [], "alpha": [], "beta": [], "m": [], "band": []}
    with torch.set_grad_enabled(track):
        for t in range(prior.max_iters):
            busy = active.any(-1)
            rows = busy.nonzero()[:, 0]  # blocks holding a moving child
            if rows.numel() == 0:
                break
            w = win[rows]  # (k, B): this step's windows
            reach = int(w.max())
            if reach > current.layout.reach:  # widen the band (doubling) and carry the state
                old = current.layout
                current = _Band(a, b, scale, n, max(reach, min(2 * old.reach, cap)),
                                prior.block_size, work)  # (without a graph under grad="last")
                if current.layout.block != old.block:
                    raise AssertionError("the band keeps its block size")
                if p_final is not None:  # earlier slots of a wider band: farther parents
                    p_final = torch.nn.functional.pad(p_final, (current.layout.width
                                                                - old.width, 0))
            act, al, be, cp = active[rows], alpha[rows], beta[rows], caps_b[rows]  # (k, B)
            sel = None if rows.numel() == busy.numel() else rows  # all busy: no gather
            e_ln_q, _ = log_q_expectations(al, be, prior.expectation)
            p, m = current.posterior(sel, w, e_ln_q)  # (k, B, L), (k, B)
            if prior.update == "conjugate":
                new_alpha, new_beta = a_prior[rows] + m - 1, b_prior[rows] + 1
            else:
                new_alpha, new_beta = al + m - 1, be + 1
            with torch.no_grad():
                if prior.window_rule in ("edge", "evidence"):  # double while it points on
                    outer = (current.outer_evidence(sel, w) if prior.window_rule == "edge"
                             else current.beyond_mass(sel, w, e_ln_q, cp))
                    new_win = torch.where((outer > prior.tol) & (w < cp),
                                          torch.minimum(2 * w, cp), w)
                else:
                    new_win = grown(w, new_alpha, new_beta, cp)
                mp = m_prev[rows]
                settled = ((m - mp).abs() <= prior.converge_tol * m.abs().clamp(min=1)) \
                    & (new_win == w)  # NaN m_prev: never settled at the first step
                moving = act & ~settled
                ends = act & (~moving if t + 1 < prior.max_iters else act)  # their last step
            if in_place:
                if p_final is None:
                    p_final = torch.zeros(current.scores.shape, dtype=work, device=a.device)
                p_final[rows] = torch.where(ends[..., None], p, p_final[rows])
            elif not one_step:  # (grad="last" recomputes every posterior in one step at the end)
                pieces.append((rows, p * ends[..., None]))
            m_all = m_all.index_put((rows,), torch.where(act, m.detach(), m_all[rows]))
            steps = steps.index_put((rows,), steps[rows] + act)
            rec["windows"].append(unblocked(win, current.layout))
            rec["alpha"].append(unblocked(alpha.detach(), current.layout))
            rec["beta"].append(unblocked(beta.detach(), current.layout))
            rec["m"].append(unblocked(m_all, current.layout))
            rec["band"].append(current.layout.reach)
            # a child's state moves on unless this was its last step (settled, or max_iters):
            # its Beta and window stay those of its final posterior
            upd = moving & ~ends
            alpha = alpha.index_put((rows,), torch.where(upd, new_alpha, al))
            beta = beta.index_put((rows,), torch.where(upd, new_beta, be))
            win = win.index_put((rows,), torch.where(upd, new_win, w))
            m_prev = m_prev.index_put((rows,), torch.where(moving, m.detach(), mp))
            active = active.index_put((rows,), moving)
    converged = not bool(active.any())
    final_win = rec["windows"][-1] if rec["windows"] else unblocked(win, current.layout)
    # each child's posterior from its last step: one scatter-add of every step's rows (a
    # narrower band's rows padded on the left: their slots are the nearer parents)
    width = current.layout.width
    if p_final is None:
        p_final = torch.zeros(current.scores.shape, dtype=work, device=a.device)
    if pieces:
        p_final = p_final.index_add(0, torch.cat([r for r, _ in pieces]), torch.cat(
            [torch.nn.functional.pad(q, (width - q.shape[-1], 0)) for _, q in pieces]))
    if one_step:
        # one differentiable step from the detached fixed point: ∂α/∂a = ∂β/∂b = 1 in both
        # updates (conjugate: α = a + E[φ] − 1; accumulate: α = a + Σ_t (E_t[φ] − 1))
        alpha_f = alpha.detach() + (a_prior - a_prior.detach())
        beta_f = beta.detach() + (b_prior - b_prior.detach())
        if not current.scores.requires_grad:  # the band widened without a graph
            current = _Band(a, b, scale, n, current.layout.reach, prior.block_size, work)
        win_f = blocked(final_win, current.layout)
        p_final, _ = current.posterior(None, win_f, log_q_expectations(alpha_f, beta_f,
                                                                        prior.expectation)[0])
        p_final = p_final * (win_f >= 1)[..., None]  # children without a past: zero
    with torch.no_grad():
        discarded = unblocked(_tail(alpha, beta, blocked(final_win, current.layout),
                                    prior.expectation), current.layout)
    empty = torch.zeros(0, *lead, n, device=a.device, dtype=xc.dtype)
    trace = WindowTrace(
        windows=(torch.stack(rec["windows"]) if rec["windows"] else empty.long())[..., off:],
        alpha=(torch.stack(rec["alpha"]) if rec["alpha"] else empty)[..., off:],
        beta=(torch.stack(rec["beta"]) if rec["beta"] else empty)[..., off:],
        expected_distance=(torch.stack(rec["m"]) if rec["m"] else empty)[..., off:],
        band=rec["band"], iterations=len(rec["band"]), converged=converged,
        discarded=discarded[..., off:].to(xc.dtype),
        child_iterations=unblocked(steps, current.layout)[..., off:], offset=off)
    p_final = p_final.reshape(current.shape)
    return p_final.to(xc.dtype), current.layout, trace


def _tail(alpha, beta, window, kind):
    """P(φ > W) under q's current Beta(α, β): the predictive (digamma) or plug-in geometric."""
    w = window.to(alpha.dtype)
    if kind == "digamma":
        return (log_beta(alpha + w, beta) - log_beta(alpha, beta)).exp()
    return (alpha / (alpha + beta)) ** w

