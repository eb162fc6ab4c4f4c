"""Credible context lengths under the geometric–Beta prior: each token's posterior over q.

Under ``BetaGeometric(a, b)`` each token's q_i ~ Beta(a, b) and its parent's distance
φ_i | q_i ~ Geometric(q_i), p(d | q) = q^(d−1)(1 − q), d ≥ 1. Given the distance, q is
conjugate: q_i | φ_i = d ~ Beta(a + d − 1, b + 1), so

    p(q_i | x) = Σ_d p(φ_i = d | x) · Beta(q_i; a + d − 1, b + 1),

a mixture whose weights are the exact reading's posterior over distances. Under the
mean-field reading the q factor is Beta(α_i, β_i) itself (``MeanFieldHistory``'s last round).
A central interval of q at level ℓ gives the token's credible *context length*, the expected
distance E[d | q] = 1 / (1 − q), increasing in q. The first token has no past: its q is
the prior's.

The mixture's CDF is Σ_d w_d I_q(a + d − 1, b + 1) (``scipy.special.betainc``, the
regularised incomplete beta); its quantiles are found by bisection on logit q, 60 steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class CredibleContext:
    """Each token's central credible interval of q_i, and of its context length 1/(1 − q_i).

    Returned by ``credible_context``.

    Attributes:
        level (float): the intervals' probability, in (0, 1).
        q_low (torch.Tensor): each token's lower end for q, ``(*batch, H, N)``.
        q_high (torch.Tensor): each token's upper end for q, ``(*batch, H, N)``.
        length_low (torch.Tensor): 1/(1 − ``q_low``), the shortest credible context length.
        length_high (torch.Tensor): 1/(1 − ``q_high``), the longest credible context length.
    """

    level: float
    q_low: torch.Tensor
    q_high: torch.Tensor

    @property
    def length_low(self) -> torch.Tensor:
        return 1.0 / (1.0 - self.q_low)

    @property
    def length_high(self) -> torch.Tensor:
        return 1.0 / (1.0 - self.q_high)


def _check_level(level) -> float:
    if isinstance(level, bool) or not isinstance(level, (int, float)) or not 0 < level < 1:
        raise ValueError(f"credible_context: level must be a number in (0, 1), the interval's "
                         f"probability; got {level!r}")
    return float(level)


def mixture_quantiles(weights, alpha, beta, probs, steps: int = 60) -> np.ndarray:
    """Quantiles ``probs`` of Σ_k w_k Beta(α_k, β_k) per row: weights, alpha, beta ``(M, K)``
    (weights summing to one per row) → ``(len(probs), M)``. Bisection on logit q."""
    from scipy.special import betainc

    w, al, be = (np.asarray(t, dtype=np.float64) for t in (weights, alpha, beta))
    out = []
    for p in probs:
        lo, hi = np.full(w.shape[0], -40.0), np.full(w.shape[0], 40.0)
        for _ in range(steps):
            mid = 0.5 * (lo + hi)
            q = 1.0 / (1.0 + np.exp(-mid))
            cdf = (w * betainc(al, be, q[:, None])).sum(-1)
            below = cdf < p
            lo, hi = np.where(below, mid, lo), np.where(below, hi, mid)
        out.append(1.0 / (1.0 + np.exp(-0.5 * (lo + hi))))
    return np.stack(out)


def credible_from_posterior(posterior: torch.Tensor, a, b, level: float = 0.9) -> CredibleContext:
    """From the exact reading's posterior p(φ_i = j | x) ``(*batch, H, N, N)`` (children = the
    parents, j < i) and the prior's ``a``, ``b`` (floats, or one per head ``(H,)``)."""
    level = _check_level(level)
    post = posterior.detach().to(torch.float64).cpu()
    *lead, N, P = post.shape
    if N != P or len(lead) < 1:
        raise ValueError(f"credible_from_posterior: posterior must be (*batch, H, N, N) over a "
                         f"sequence's own past; got {tuple(post.shape)}")
    H = lead[-1]
    a_h, b_h = (torch.as_tensor(v, dtype=torch.float64).detach().cpu().reshape(-1)
                .expand(H) for v in (a, b))
    i = torch.arange(N)[:, None]
    d = torch.arange(N)[None, :]  # distance d = i − j; column d of row i is parent i − d
    j = (i - d).clamp(min=0)
    # weights (*lead, N, N): row i, column d = p(φ_i = d | x); distance 0 is no parent
    weights = post.gather(-1, j.expand(*lead, N, N)) * ((d <= i) & (d >= 1)).to(post.dtype)
    # components Beta(a + d − 1, b + 1); the clamp keeps the unused d = 0 column's a − 1 > 0
    # (betainc of a non-positive parameter is NaN, and NaN·0 is NaN)
    alpha = (a_h.reshape(H, 1, 1) + d.to(torch.float64) - 1).clamp(min=1e-12).expand(*lead, N, N)
    beta = (b_h.reshape(H, 1, 1) + 1).expand(*lead, N, N)
    # the first token has no past: its q is the prior's, one component Beta(a, b) at d = 0
    weights[..., 0, 0] = 1.0
    alpha, beta = alpha.clone(), beta.clone()
    alpha[..., 0, 0], beta[..., 0, 0] = a_h.reshape(H), b_h.reshape(H)
    tail = (1 - level) / 2
    q = mixture_quantiles(weights.reshape(-1, N), alpha.reshape(-1, N), beta.reshape(-1, N),
                          (tail, 1 - tail))
    q = torch.as_tensor(q).reshape(2, *lead, N)
    return CredibleContext(level, q[0], q[1])


def credible_from_mean_field(history, level: float = 0.9) -> CredibleContext:
    """From a mean-field reading's ``MeanFieldHistory``: q's factor Beta(α_i, β_i) at the last
    round, ``(*batch, H, N)``."""
    from scipy.special import betaincinv

    level = _check_level(level)
    tail = (1 - level) / 2
    al = history.alpha[-1].detach().to(torch.float64).cpu().numpy()
    be = history.beta[-1].detach().to(torch.float64).cpu().numpy()
    lo, hi = betaincinv(al, be, tail), betaincinv(al, be, 1 - tail)
    return CredibleContext(level, torch.as_tensor(lo), torch.as_tensor(hi))


def credible_context(layer, x: torch.Tensor, level: float = 0.9) -> CredibleContext:
    """Each token's central credible interval of q_i and of its context length 1/(1 − q_i).

    Read from the exact posterior over distances where the layer is an
    ``ExpandingAttention`` with ``inference=None``, otherwise from the mean-field q factor
    Beta(α_i, β_i) of its one geometric–Beta family; no gradient flows.

    Args:
        layer (CompiledModule): a compiled layer (``structattn.compile(expanding_attention(…))``).
        x (torch.Tensor): the layer's input, as its forward takes it.
        level (float): the intervals' probability, in (0, 1); default 0.9.

    Returns:
        CredibleContext: the intervals, ``(*batch, H, N)`` each.

    Raises:
        ValueError: ``level`` not a number in (0, 1), ``layer`` not a compiled layer, or a
            layer with neither an exact expanding attention nor a family read by mean field.
    """
    level = _check_level(level)
    model = getattr(layer, "declaration", None)
    if model is None:
        raise ValueError(f"credible_context: layer must be a compiled layer (structattn."
                         f"compile(model)); got {type(layer).__name__}")
    with torch.no_grad():
        # an expanding attention read exactly (its inference scheme None, its prior's a, b
        # on the model); the catalogue is not imported here (it imports this module)
        if getattr(model, "inference", "") is None and hasattr(model, "a"):
            _, post = layer(x, return_posterior=True)
            return credible_from_posterior(post, model.a, model.b, level)
        _, trace = layer(x, return_trace=True)
    if not trace.mean_field:
        raise ValueError(f"credible_context: {type(model).__name__} has no geometric–Beta "
                         f"family read by mean field nor an exact expanding attention "
                         f"(inference=None)")
    (history,) = trace.mean_field.values()
    return credible_from_mean_field(history, level)
