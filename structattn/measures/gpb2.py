"""One collapsed (GPB2) message-passing step of a switching linear-Gaussian model.

Messages about X given the switch A: component i has mean μ_i and covariance Σ_i
(``(M, d)``, ``(M, d, d)``), with prior π_i. The switch moves i → j with probability
T_ij, and X moves linearly, X' = W X + ε, ε ~ N(0, Q). GPB2 forms the M² components and
M-projects (matches the first two moments) each target j's mixture to one Gaussian:

    w_ij ∝ π_i T_ij (normalised over i),  m_j = Σ_i w_ij W μ_i,
    S_j = Σ_i w_ij (W Σ_i Wᵀ + Q + (W μ_i − m_j)(W μ_i − m_j)ᵀ).

With μ_i = H_i (hidden states), W = W_Vᵀ, uniform π and T_ij = the attention weights, m_j is
the attention output Σ_i A_ij H_i W_V (the GPB2 draft's Eq. 14).
"""

from __future__ import annotations

import torch


def gpb2_collapse(means, covariances, transition, W, noise=None, prior=None):
    """One GPB2 step: m_j = Σ_i w_ij W μ_i, S_j its moment-matched covariance, w_ij ∝ π_i T_ij.

    Leading batch dimensions are allowed on every argument.

    Args:
        means (torch.Tensor): the components' means μ_i, ``(M, d)``.
        covariances (torch.Tensor): their covariances Σ_i, ``(M, d, d)``.
        transition (torch.Tensor): T, ``(M, M')`` (rows i: from, columns j: to), finite and
            nonnegative.
        W (torch.Tensor): the linear move X' = W X + ε, ``(d', d)``.
        noise (torch.Tensor | None): Q, the covariance of ε, ``(d', d')``; None, the
            default: 0.
        prior (torch.Tensor | None): π, ``(M,)``; None, the default: uniform, 1/M.

    Returns:
        (tuple): the means m ``(M', d')``, the covariances S ``(M', d', d')`` and the weights
            w ``(M, M')`` (normalised over the source i, per target j).

    Raises:
        ValueError: a transition without M rows, covariances not ``(…, M, d, d)``, or a
            transition that is negative or not finite.
    """
    M = means.shape[-2]
    if transition.shape[-2] != M:
        raise ValueError(f"gpb2_collapse: transition must have {M} rows (one per source "
                         f"component); got shape {tuple(transition.shape)}")
    if covariances.shape[-3:] != (M, means.shape[-1], means.shape[-1]):
        raise ValueError(f"gpb2_collapse: covariances must have shape (…, {M}, d, d); got "
                         f"{tuple(covariances.shape)}")
    if bool((transition < 0).any()) or not bool(torch.isfinite(transition).all()):
        raise ValueError("gpb2_collapse: transition must be finite and nonnegative")
    prior = torch.full((M,), 1.0 / M, dtype=means.dtype, device=means.device) if prior is None \
        else prior
    joint = prior.unsqueeze(-1) * transition  # π_i T_ij
    w = joint / joint.sum(-2, keepdim=True)  # normalised over the source i, per target j
    moved = means @ W.T  # W μ_i: (M, d')
    m = w.transpose(-1, -2) @ moved  # (M', d')
    spread = W @ covariances @ W.T  # (M, d', d')
    if noise is not None:
        spread = spread + noise
    diff = moved.unsqueeze(-3) - m.unsqueeze(-2)  # d_ji = W μ_i − m_j: (M', M, d')
    S = (torch.einsum("...ij,...ikl->...jkl", w, spread)
         + torch.einsum("...ij,...jik,...jil->...jkl", w, diff, diff))
    return m, S, w
