"""Window supports: lowering rules for the geometric–Beta prior (expanding attention).

Two support kinds, registered with ``lowering.register_support_kind``:

- ``ExactWindow``: the exact beta-geometric posterior over a window of the past,
  ``p(φ_i = d | x) ∝ exp(ψ(x_{i−d}, x_i)) B(a + d − 1, b + 1)`` for 1 ≤ d ≤ W; one
  banded ``scaled_dot_product_attention`` call (``structattn.band``), O(N·W) — or
  FlexAttention with a block mask on CUDA;
- ``MeanFieldWindows``: the paper's mean-field scheme q(φ_i) q(q_i), each child with its
  own window W_i. Iterate to a fixed point (SPEC.md, "Geometric–Beta prior"):

    1. E[ln q_i], E[ln(1 − q_i)] under Beta(α_i, β_i) (digamma; or ln E[q] plugged in);
    2. p_t(φ_i = d) ∝ exp(ψ_{i,i−d} + (d − 1) E[ln q_i] + E[ln(1 − q_i)]), 1 ≤ d ≤ W_i;
    3. α_i ← a + E_{p_t}[φ_i] − 1, β_i ← b + 1 (conjugate; or accumulate: α_i ← α_i +
       E[φ_i] − 1, β_i ← β_i + 1, the authors' code);
    4. W_i ← max(W_i, smallest W with predictive tail P(φ_i > W) < tol), capped by i and
       ``max_window``: a window grows only while the posterior predicts mass beyond it.

  The scores are computed once per band width (the band widens by doubling), each
  iteration costs O(N·W) (no feature dimension), the value read O(N·W·d_v): the cost
  follows the inferred context length, not N.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import band
from .lowering import SupportKind, can_use_fast_path, register_support_kind, score_factors
from .priors.beta_geometric import BetaGeometric, log_beta


def beta_quantile(alpha: torch.Tensor, beta: torch.Tensor, tol: float, cap: int) -> torch.Tensor:
    """Smallest integer W in [1, cap] with P(φ > W) = B(α + W, β)/B(α, β) < tol, elementwise
    (``cap`` where even cap is not enough). Bisection: O(log cap) vectorised steps, no grad."""
    alpha, beta = torch.broadcast_tensors(alpha.detach(), beta.detach())
    log_tol = torch.log(torch.tensor(tol, dtype=alpha.dtype, device=alpha.device))
    base = log_beta(alpha, beta)
    lo = torch.zeros_like(alpha, dtype=torch.long)  # invariant: tail(lo) ≥ tol (tail(0) = 1)
    hi = torch.full_like(lo, cap)  # tail(hi) < tol, or hi = cap
    for _ in range(int(cap).bit_length() + 1):
        mid = (lo + hi) // 2
        below = (log_beta(alpha + mid.to(alpha.dtype), beta) - base) < log_tol
        hi, lo = torch.where(below, mid, hi), torch.where(below, lo, mid)
    return hi.clamp(min=1)


def plug_in_quantile(alpha, beta, tol: float, cap: int) -> torch.Tensor:
    """Smallest W in [1, cap] with q̄^W < tol, q̄ = α/(α + β) (the plug-in geometric)."""
    log_q = torch.log(alpha.detach() / (alpha.detach() + beta.detach()))
    w = torch.floor(torch.log(torch.tensor(tol, dtype=log_q.dtype)) / log_q) + 1
    return w.clamp(1, cap).to(torch.long)


def _log_q_expectations(alpha, beta, kind):
    """``(E[ln q], E[ln(1 − q)])`` under Beta(α, β): digamma, or ln E[q] plugged in."""
    if kind == "digamma":
        total = torch.digamma(alpha + beta)
        return torch.digamma(alpha) - total, torch.digamma(beta) - total
    total = torch.log(alpha + beta)
    return torch.log(alpha) - total, torch.log(beta) - total


@dataclass
class WindowTrace:
    """What the mean-field iteration did, per iteration t (recorded before each posterior):
    ``windows`` ``(T, *batch, H, N)`` long, ``alpha`` / ``beta`` ``(T, *batch, H, N)`` (q's
    Beta parameters the posterior of step t used), ``expected_distance`` ``(T, *batch, H, N)``
    (E_{p_t}[φ_i]), ``band``: the band width scored at each step; ``iterations`` T;
    ``converged``; ``discarded``: the final predictive tail mass beyond each window. Child 0
    (no past) has window 0."""

    windows: torch.Tensor
    alpha: torch.Tensor
    beta: torch.Tensor
    expected_distance: torch.Tensor
    band: list = field(default_factory=list)
    iterations: int = 0
    converged: bool = False
    discarded: torch.Tensor | None = None

    @property
    def mean_window(self) -> float:
        """The final windows' mean over children that have a past."""
        w = self.windows[-1].to(torch.float64)
        return float(w[..., 1:].mean()) if w.shape[-1] > 1 else 0.0

    def relative_operations(self, d: int) -> float:
        """The authors' counted-operations metric against full attention:
        mean window · (d + iterations + 1) / (N · d)."""
        n = self.windows.shape[-1]
        return self.mean_window * (d + self.iterations + 1) / (n * d)


def _check_self_family(family, what):
    if family.children.size != family.parents.size:
        raise ValueError(f"edge family {family.name!r}: a {what} is a distance back along one "
                         f"sequence, so children and parents must have the same length; got "
                         f"{family.children.size} children and {family.parents.size} parents")
    if not can_use_fast_path(family):
        raise ValueError(f"edge family {family.name!r}: a {what} needs exactly one factorised "
                         f"potential (ψ = ⟨a_i, b_j⟩·scale, e.g. Bilinear); got "
                         f"{[type(p).__name__ for p in family.potentials]}")


def _keep_from_position(n, device, dtype):
    """``(N, 1)``: 0 for child 0, which has no past (zero output), 1 elsewhere."""
    return (torch.arange(n, device=device) > 0).to(dtype)[:, None]


class ExactWindow(SupportKind):
    """Exact beta-geometric posterior over a window of the past (the prior's ``window``)."""

    name = "beta-geometric window"

    def matches(self, prior):
        return isinstance(prior, BetaGeometric) and prior.inference == "exact" \
            and (prior.tol is not None or prior.max_window is not None)

    def lower(self, family, want_posterior):
        prior = family.prior
        _check_self_family(family, "beta-geometric prior")
        xc = family.children.states
        n = family.children.size
        window = prior.window(n)
        a, b, scale = score_factors(family)  # (*batch, H, N, k)
        keep = _keep_from_position(n, a.device, xc.dtype)
        table = prior.log_by_distance(window, a.device, xc.dtype)  # (H|1, W + 1)
        if a.is_cuda and not want_posterior and _flex_available():
            H = table.shape[0]

            def log_prior(bi, h, i, d):
                return table[h if H > 1 else 0, d.clamp(0, window)]

            def attend(u):
                return band.flex_attend(a, b, u, scale, log_prior, window) * keep
            return attend, None
        layout = band.BandLayout.for_window(n, window, prior.block_size)
        dist = layout.distance(a.device)  # (B, L)
        pos = layout.child_positions(a.device)[:, :, None]  # (nb, B, 1)
        inside = (dist >= 1) & (dist <= window) & (dist <= pos)  # (nb, B, L)
        lp = table[:, dist.clamp(0, window)]  # (H|1, B, L)
        bias = torch.where(inside, lp[:, None], torch.tensor(float("-inf"), dtype=lp.dtype,
                                                             device=lp.device))
        # children without any parent in the band (child 0, padding) attend anywhere; zeroed
        bias = torch.where(inside.any(-1, keepdim=True), bias, torch.zeros_like(bias))
        if want_posterior:
            s = band.scores(a, b, scale, layout)  # (*batch, H, nb, B, L)
            p = torch.softmax(s + bias, -1) * inside.any(-1, keepdim=True)

            def attend(u):
                return band.apply(p, u, layout) * keep
            return attend, lambda: layout.to_dense(p)

        def attend(u):
            return band.attend(a, b, u, scale, bias, layout) * keep
        return attend, None


def _flex_available() -> bool:
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


class MeanFieldWindows(SupportKind):
    """The mean-field geometric–Beta posterior with a window per child (module docstring)."""

    name = "mean-field windows"

    def matches(self, prior):
        return isinstance(prior, BetaGeometric) and prior.inference == "mean_field"

    def lower(self, family, want_posterior):
        _check_self_family(family, "beta-geometric prior")
        p, layout, trace = mean_field(family)
        family.trace = trace
        keep = _keep_from_position(family.children.size, p.device, p.dtype)

        def attend(u):
            return band.apply(p, u, layout) * keep
        return attend, (lambda: layout.to_dense(p))

    def posterior(self, family):
        return self.lower(family, True)[1]()


class _Band:
    """The band of one family at one width: its scores ψ and what every step reuses."""

    def __init__(self, a, b, scale, n, reach, block, work):
        self.layout = band.BandLayout.for_window(n, max(reach, 1), block)
        lay = self.layout
        self.scores = band.scores(a, b, scale, lay).to(work)  # (*batch, H, nb, B, L)
        self.dist = lay.distance(a.device).to(work)  # (B, L): child − parent
        # Σ_l p_l·dist_l = (mB + r)·Σ_l p_l − Σ_l p_l·l: one matrix-vector product per step
        self.offset = (lay.reach + torch.arange(lay.block, device=a.device)).to(work)  # (B,)
        self.slot = torch.arange(lay.width, device=a.device).to(work)  # (L,)
        self.windows = None

    def set_windows(self, win):
        """The support: 1 ≤ d ≤ W_i (W_i ≤ i keeps it inside the sequence); −∞ outside, and
        rows without any parent left at 0 (their posterior row is zeroed)."""
        wb = self.layout.children(win[..., None])[..., 0]  # (*batch, H, nb, B)
        inside = (self.dist >= 1) & (self.dist <= wb[..., None].to(self.dist.dtype))
        self.has_parent = (wb >= 1)[..., None]  # (*batch, H, nb, B, 1)
        mask = torch.zeros_like(self.scores).masked_fill_(~inside & self.has_parent,
                                                          float("-inf"))
        self.base = self.scores + mask
        self.windows = win

    def posterior(self, e_ln_q):
        """p(φ_i = d) ∝ exp(ψ_{i,i−d} + (d − 1) E[ln q_i]) on the support (the E[ln(1 − q_i)]
        term is constant in d), and E[φ_i] ``(*batch, H, N)``."""
        e = self.layout.children(e_ln_q[..., None])  # (*batch, H, nb, B, 1)
        p = torch.softmax(torch.addcmul(self.base, self.dist, e), -1)
        p = p * self.has_parent
        m = self.offset * self.has_parent[..., 0] - p @ self.slot  # (*batch, H, nb, B)
        return p, self.layout.unblock(m[..., None])[..., 0]


@torch.compiler.disable
def mean_field(family):
    """Iterate the mean-field equations for one family; returns the band posterior
    ``(*batch, H, nb, B, L)``, its layout and the ``WindowTrace``.

    ``grad="unroll"``: back-propagate through every iteration (the exact derivative of the
    computed map; memory grows with the iterations). ``grad="last"``: iterate without a graph,
    then take one differentiable step from the detached fixed point — scores and the Beta
    parameters' dependence on a, b — O(N·W) memory whatever the number of iterations.

    Its length and band widths depend on the data, so ``torch.compile`` leaves it to eager
    mode (the projections around it are compiled) rather than recompiling per iteration."""
    prior: BetaGeometric = family.prior
    xc = family.children.states
    n = family.children.size
    a, b, scale = score_factors(family)  # (*batch, H, N, k)
    a0, b0 = prior.params(a.device, xc.dtype)  # (H|1,)
    work = a0.dtype
    a0, b0 = a0[:, None], b0[:, None]  # (H|1, 1): broadcast over children
    cap = max(1, n - 1 if prior.max_window is None else min(n - 1, prior.max_window))
    caps = torch.arange(n, device=a.device).clamp(max=cap)  # child i sees at most i parents
    quantile = beta_quantile if prior.expectation == "digamma" else plug_in_quantile
    track = prior.grad == "unroll" and torch.is_grad_enabled()

    def grown(win, alpha, beta):
        """Windows grown where the predictive tail beyond them is still ≥ tol (never shrunk)."""
        with torch.no_grad():
            need = (_tail(alpha, beta, win, prior.expectation) >= prior.tol) & (win < caps)
            if not bool(need.any()):
                return win
            idx = need.nonzero(as_tuple=True)
            w = quantile(alpha[idx], beta[idx], prior.tol, cap)
            out = win.clone()
            out[idx] = torch.maximum(win[idx], torch.minimum(w, caps[idx[-1]]))
            return out

    alpha = a0.expand(*a.shape[:-1])  # (*batch, H, N): q_i ~ Beta(a, b) before any evidence
    beta = b0.expand(*a.shape[:-1])
    with torch.no_grad():
        win = torch.minimum(quantile(alpha, beta, prior.tol, cap), caps)  # (*batch, H, N)
    has_past = caps > 0
    rec = {"windows": [], "alpha": [], "beta": [], "m": [], "band": []}
    converged, m_prev, current = False, None, None
    with torch.set_grad_enabled(track):
        for _ in range(prior.max_iters):
            reach = int(win.max()) if win.numel() else 1
            if current is None or reach > current.layout.reach:
                grow = reach if current is None else max(reach, 2 * current.layout.reach)
                current = _Band(a, b, scale, n, grow, prior.block_size, work)
            if current.windows is not win:
                current.set_windows(win)
            e_ln_q, _ = _log_q_expectations(alpha, beta, prior.expectation)
            p, m = current.posterior(e_ln_q)
            for key, val in (("windows", win), ("alpha", alpha), ("beta", beta), ("m", m)):
                rec[key].append(val.detach())
            rec["band"].append(current.layout.reach)
            if prior.update == "conjugate":
                new_alpha, new_beta = a0 + m - 1, (b0 + 1).expand_as(beta)
            else:
                new_alpha, new_beta = alpha + m - 1, beta + 1
            # child 0 has no past (m = 0): its Beta stays the prior's
            new_alpha = torch.where(has_past, new_alpha, alpha)
            new_beta = torch.where(has_past, new_beta, beta)
            new_win = grown(win, new_alpha, new_beta)
            moved = m_prev is None or bool(
                ((m - m_prev).abs() > prior.converge_tol * m.abs().clamp(min=1)).any())
            if not moved and new_win is win:
                converged = True
                break
            alpha, beta, win, m_prev = new_alpha, new_beta, new_win, m.detach()
    if not track and torch.is_grad_enabled():
        # one differentiable step from the detached fixed point: ∂α/∂a = ∂β/∂b = 1 in both
        # updates (conjugate: α = a + E[φ] − 1; accumulate: α = a + Σ_t (E_t[φ] − 1))
        alpha_f = alpha.detach() + (a0 - a0.detach())
        beta_f = beta.detach() + (b0 - b0.detach())
        alpha_f = torch.where(has_past, alpha_f, a0.expand_as(alpha_f))
        beta_f = torch.where(has_past, beta_f, b0.expand_as(beta_f))
        current = _Band(a, b, scale, n, current.layout.reach, prior.block_size, work)
        current.set_windows(win)
        p, _ = current.posterior(_log_q_expectations(alpha_f, beta_f, prior.expectation)[0])
    with torch.no_grad():
        discarded = _tail(alpha, beta, win, prior.expectation)
    trace = WindowTrace(windows=torch.stack(rec["windows"]), alpha=torch.stack(rec["alpha"]),
                        beta=torch.stack(rec["beta"]),
                        expected_distance=torch.stack(rec["m"]), band=rec["band"],
                        iterations=len(rec["band"]), converged=converged,
                        discarded=discarded.to(xc.dtype))
    return p.to(xc.dtype), current.layout, trace


def _tail(alpha, beta, window, kind):
    """P(φ > W) under q's current Beta(α, β): the predictive (digamma) or plug-in geometric."""
    w = window.to(alpha.dtype)
    if kind == "digamma":
        return (log_beta(alpha + w, beta) - log_beta(alpha, beta)).exp()
    return (alpha / (alpha + beta)) ** w


register_support_kind(ExactWindow())
register_support_kind(MeanFieldWindows())
