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
from ..certificates.beta import log_q_expectations
from . import fixed_point


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


def mean_field_triton(family, factors, scheme, grad: str):
    """``(attend, dense_posterior, None)`` for ``family`` (see ``kernel.mean_field_compiled``)."""
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
    win0 = scheme.first_windows(a0, b0, cap).expand(*lead).reshape(-1)
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
    if grad == "last" and torch.is_grad_enabled():
        alpha, beta, e = fixed_point.step_from(alpha, beta, a0, b0, lead, scheme.expectation)
    else:  # (children without a past: their slope is never read)
        e = log_q_expectations(alpha, beta, scheme.expectation)[0]  # (G, N)

    def attend(u):  # u: (*batch, H, P, d_v)
        u_rows = u.reshape(G, n_all, u.shape[-1])
        out, _ = expanding.attend_forward(a_rows, b_rows, u_rows, e, window, off, float(scale))
        return out.reshape(*lead, n, u.shape[-1]).to(u.dtype)

    def dense_posterior():
        p, lay = fixed_point.posterior(a, b, scale, off, prior.block_size, a0.dtype,
                                       scheme.expectation, window, alpha.to(a0.dtype),
                                       beta.to(a0.dtype), xc.dtype)
        return lay.to_dense(p)[..., off:, :]
    return attend, dense_posterior, None
