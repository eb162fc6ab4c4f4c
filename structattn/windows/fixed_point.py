"""What the compiled readings of the mean-field windows (the CPU kernel's, ``kernel.py``, and
Triton's, ``on_triton.py``) share once each child's fixed point (W_i, α_i, β_i) is found:
``grad="last"``'s Beta parameters and slopes, and the posterior at the fixed point on a band
(read only where a posterior is asked for)."""

from __future__ import annotations

import torch

from ..certificates.beta import log_q_expectations
from .scores import BandScores


def step_from(alpha, beta, a0, b0, lead, expectation: str):
    """``grad="last"``'s one differentiable step from the detached fixed point ``alpha``,
    ``beta`` ``(G, N)``: the same values, with the prior's a, b gradient (∂α/∂a = ∂β/∂b = 1
    in both updates, as the loop's last step takes it), and each child's slope E[ln q_i];
    → ``(α, β, e)`` ``(G, N)`` in the fixed point's dtype. ``a0``, ``b0``: ``(H|1,)``,
    ``lead``: ``(*batch, H)``."""
    G, n = alpha.shape

    def through(fixed, prior):
        p = prior[:, None].expand(*lead, n).reshape(G, n).to(fixed.dtype)
        return fixed + (p - p.detach())
    alpha, beta = through(alpha, a0), through(beta, b0)
    return alpha, beta, log_q_expectations(alpha, beta, expectation)[0]


def posterior(a, b, scale, off: int, block: int, work, expectation: str, window, alpha, beta,
              dtype):
    """The posterior at a fixed point ``(window, α, β)`` (each ``(G, N)``, G = batch · heads)
    on a band over all P tokens (the first P − N, not children, at window 0), with grad where
    ``a (*lead, N, k)``, ``b (*lead, P, k)``, α and β carry it; → (band, layout)."""
    front = torch.nn.functional.pad
    lead, n, n_all = a.shape[:-2], a.shape[-2], b.shape[-2]
    reach = max(1, int(window.max()) if window.numel() else 1)
    scores = BandScores(front(a, (0, 0, off, 0)), b, scale, n_all, reach, block, work)
    lay = scores.layout

    def blocked(t):  # (*lead, N) → (G', B), the front and padding slots at 0
        return lay.children(front(t, (off, 0))[..., None])[..., 0].reshape(-1, lay.block)

    win_b = blocked(window.reshape(*lead, n))
    # padding slots at Beta(1, 1): finite digammas, no NaN in the backward
    e = log_q_expectations(blocked(alpha.reshape(*lead, n) - 1) + 1,
                           blocked(beta.reshape(*lead, n) - 1) + 1, expectation)[0]
    p, _ = scores.posterior(None, win_b, e)
    p = (p * (win_b >= 1)[..., None]).reshape(scores.shape).to(dtype)
    return p, lay
