"""The mean-field windows on the GPU: the fixed point from the Triton ``solve``, the output
from the Triton band per child (``structattn/triton_kernels/expanding.py``).

The same reading as the compiled CPU kernel (``kernel.py``): each child's fixed point
(W_i, α_i, β_i), then one posterior at it — without grad the kernel's ``attend``; under
``grad="last"`` the same op with its autograd rule, E[ln q_i] taken from α, β by torch (so the
prior's a, b get their gradient through it, as the loop's last step gives it). No host
synchronisation: the windows stay on the device.
"""

from __future__ import annotations

import torch

from .. import triton_kernels
from ..beta import log_beta, log_q_expectations, plug_in_quantile


def applies(a, b, scheme, record: bool, unrolled: bool) -> bool:
    """Whether the Triton reading serves these factors: Triton serves them (a CUDA device, or
    the interpreter inside ``triton_kernels.on_cpu()``), kernels are on, and the scheme asks
    for nothing it lacks (a per-round history, the unrolled derivative, a rule it does not
    run)."""
    from .. import kernels

    if record or unrolled or not kernels._enabled() or not triton_kernels.serves(a, b):
        return False
    from ..triton_kernels.expanding import RULES
    return scheme.window_rule.code in RULES


def first_windows(a0, b0, scheme, cap: int) -> torch.Tensor:
    """Each head's first window ``(H|1,)`` long, as ``MeanFieldWindows.initial_windows`` gives
    it (before the children's caps): the given ``initial_window``, or the prior's tail quantile
    at the rule's start — the predictive's as the smallest W in [1, cap] with P(φ > W) below
    it, read from every W at once (a dozen operations where ``beta_quantile``'s bisection
    takes ~180; the same values of the same function, so the same W)."""
    with torch.no_grad():
        if scheme.initial_window is not None:
            return torch.full(a0.shape, min(scheme.initial_window, cap), dtype=torch.long,
                              device=a0.device)
        start = scheme.window_rule.start_tail or scheme.tol
        if scheme.expectation != "digamma":
            return plug_in_quantile(a0, b0, start, cap)
        a0, b0 = a0.detach(), b0.detach()
        w = torch.arange(1, cap + 1, device=a0.device).to(a0.dtype)  # (cap,)
        log_tol = torch.log(torch.tensor(start, dtype=a0.dtype, device=a0.device))
        below = (log_beta(a0[:, None] + w, b0[:, None]) - log_beta(a0, b0)[:, None]) < log_tol
        return torch.where(below.any(-1), below.to(torch.uint8).argmax(-1) + 1, cap)


def mean_field_triton(family, factors, scheme, grad: str, fixed_point_posterior):
    """``(attend, dense_posterior, None)`` for ``family`` (see ``kernel.mean_field_compiled``);
    ``fixed_point_posterior``: the band posterior at a fixed point (the dense reading, read
    only where a posterior is asked for)."""
    from ..triton_kernels import expanding

    prior = family.prior  # a BetaGeometric
    xc = family.children.states
    a, b, scale = factors  # (*batch, H, N, k), (*batch, H, P, k)
    a0, b0 = prior.params(a.device, xc.dtype)  # (H|1,)
    n, n_all = family.children.size, family.parents.size
    off = n_all - n  # the children are the last n of the n_all tokens
    cap = scheme.cap(family)
    lead = a.shape[:-2]  # (*batch, H)
    # the first windows: one per row (the given one, or the prior's quantile per head)
    win0 = first_windows(a0, b0, scheme, cap).expand(*lead).reshape(-1)
    a_rows = a.reshape(-1, n, a.shape[-1])  # (G, N, k)
    b_rows = b.reshape(-1, n_all, b.shape[-1])  # (G, P, k)
    G = a_rows.shape[0]
    with torch.no_grad():
        window, alpha, beta = expanding.solve(
            a_rows.detach(), b_rows.detach(), off, float(scale),
            a0.detach().expand(*lead).reshape(G), b0.detach().expand(*lead).reshape(G),
            win0, float(scheme.tol), float(scheme.converge_tol),
            scheme.max_iters, cap, scheme.expectation == "digamma",
            scheme.update == "conjugate", scheme.window_rule.code)[:3]
    stat = alpha.dtype
    if grad == "last" and torch.is_grad_enabled():
        # one differentiable step from the detached fixed point: ∂α/∂a = ∂β/∂b = 1 (as the
        # loop's last step)
        a_prior = a0[:, None].expand(*lead, n).reshape(G, n).to(stat)
        b_prior = b0[:, None].expand(*lead, n).reshape(G, n).to(stat)
        alpha = alpha + (a_prior - a_prior.detach())
        beta = beta + (b_prior - b_prior.detach())
    e = log_q_expectations(alpha, beta, scheme.expectation)[0]  # (G, N)
    e = torch.where(window >= 1, e, torch.zeros((), dtype=stat, device=e.device))

    def attend(u):  # u: (*batch, H, P, d_v)
        u_rows = u.reshape(G, n_all, u.shape[-1])
        out, _ = expanding.attend_forward(a_rows, b_rows, u_rows, e, window, off, float(scale))
        return out.reshape(*lead, n, u.shape[-1]).to(u.dtype)

    def dense_posterior():
        p, lay = fixed_point_posterior(a, b, scale, off, prior.block_size, a0.dtype,
                                       scheme.expectation, window, alpha.to(a0.dtype),
                                       beta.to(a0.dtype), xc.dtype)
        return lay.to_dense(p)[..., off:, :]
    return attend, dense_posterior, None
