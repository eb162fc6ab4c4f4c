"""The prior as declared, read pointwise: what Pyro's reading (the oracle) and the drawings
of the declared structure use — never the compiled reading's tables."""

from __future__ import annotations

import torch

from ..kinds.base import grid


def declared_log_prior(family, leftover: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The prior as declared, read pointwise: ``(log p(φ_i = j), has_parent)`` with log p
    ``(…, C, P)`` normalised over the support (−∞ outside it; a row without any parent is
    all −∞) and ``has_parent`` ``(…, C)``. Built from the prior's ``support().contains`` and
    ``log_weight`` on the (child, parent) grid alone — Pyro's reading, never the compiled
    tables. ``leftover``: one more outcome, "no parent", last (``(…, C, P + 1)``), of
    unnormalised log weight 0 — every child has it."""
    C, P = family.children.size, family.parents.size
    xc = family.children.states
    i, j = grid(C, P, xc.device)
    allowed = family.support.contains(i, j)
    w = family.prior.log_weight(i, j, (C, P))
    w = torch.zeros((), dtype=xc.dtype, device=xc.device) if w is None else w.to(xc.dtype)
    w = torch.where(allowed, w, torch.tensor(float("-inf"), dtype=xc.dtype, device=xc.device))
    if leftover:
        w = torch.cat([w, w.new_zeros(()).expand(*w.shape[:-1], 1)], -1)
    has_parent = ~torch.isneginf(w).all(-1)
    norm = torch.logsumexp(w, -1, keepdim=True)
    return torch.where(has_parent[..., None], w - norm, w), has_parent
