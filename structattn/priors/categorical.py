"""Categorical prior with explicit logits: p(φ_i = j) ∝ exp(b_ij) on the support."""

from __future__ import annotations

import torch

from ._registry import PriorEntry
from .base import Prior
from .uniform import _support_np, dense_support


class Categorical(Prior):
    r"""$p(φ_i = j) = \mathrm{softmax}_{j∈Φ_i}(b_{ij})$ with explicit logits $b$ on the support $Φ_i$.

    Lowered as an additive bias (the logits tensor itself is the dense log table). Paper
    Table 1 (relative positional encodings).

    Args:
        logits (torch.Tensor): the logits b, a floating-point tensor ``(…, C, P)``
            broadcasting against ``(*batch, heads, C, P)``: ``(C, P)``, ``(H, C, P)``,
            ``(*batch, H, C, P)``, or ``(1, P)`` for one row shared by every child. A −∞
            logit excludes a parent from the support.
        causal (bool): Φ_i ∩ {j ≤ i}. Default False.
        support (torch.Tensor | None): Φ_i ∩ {j : support[…, i, j]}, a boolean mask
            ``(…, C, P)`` (batch and heads dims broadcast). None (default): no mask.
        empty (str): a child with no allowed parent: ``"error"`` (default: refused with a
            ValueError while validating) or ``"zero"`` (a zero value and an all-zero
            posterior row).

    Raises:
        ValueError: ``logits`` not a floating-point tensor, ``support`` not a boolean tensor,
            or ``empty`` not ``"error"`` or ``"zero"``.
    """

    def __init__(self, logits: torch.Tensor, *, causal: bool = False,
                 support: torch.Tensor | None = None, empty: str = "error"):
        if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
            got = logits.dtype if isinstance(logits, torch.Tensor) else type(logits).__name__
            raise ValueError(
                f"Categorical prior: logits must be a floating-point tensor (…, children, "
                f"parents); got {got}"
            )
        if support is not None and (
            not isinstance(support, torch.Tensor) or support.dtype != torch.bool
        ):
            raise ValueError("Categorical prior: support must be a boolean tensor (…, C, P)")
        if empty not in ("error", "zero"):
            raise ValueError(f"Categorical prior: empty must be 'error' or 'zero'; got {empty!r}")
        self.empty = empty
        self.logits = logits
        self.causal = bool(causal)
        self.mask = support

    def support(self, num_children, num_parents):
        return dense_support(self.causal, self.mask)

    def log_weight(self, child, parent, sizes):
        i, j = torch.broadcast_tensors(child, parent)
        table = torch.broadcast_to(self.logits, (*self.logits.shape[:-2], *sizes))  # (1, P) too
        return table[..., i.to(table.device), j.to(table.device)]  # −∞: outside the support

    def log_table(self, num_children, num_parents, device, dtype):
        return self.logits if dtype is None else self.logits.to(dtype)  # the tensor itself

    def describe(self) -> str:
        return f"Categorical(logits {tuple(self.logits.shape)}, {self.short_support()})"


def _formula(prior, C, P):
    import numpy as np

    logits = np.broadcast_to(prior.logits.detach().numpy(), (*prior.logits.shape[:-2], C, P))
    on = _support_np(C, P, prior.causal, prior.mask)
    return np.where(on, logits, -np.inf).reshape(-1, C, P)


def _cases(C, P, g):
    f64 = torch.float64
    logits = torch.randn(2, C, P, generator=g, dtype=f64)
    mask = torch.rand(C, P, generator=g) < 0.6
    out = [Categorical(logits.masked_fill(~mask, float("-inf")), empty="zero"),
           Categorical(torch.randn(1, P, generator=g, dtype=f64))]
    return out + ([Categorical(logits, causal=True)] if C <= P else [])


def _parameters(g):
    return (torch.randn(5, 5, generator=g, dtype=torch.float64),), lambda t: Categorical(t)


ENTRY = PriorEntry(
    Categorical, _cases, _formula,
    bad={"logits must be a floating-point tensor": lambda: Categorical(torch.ones(2, 2).long()),
         "support must be a boolean tensor": lambda: Categorical(torch.zeros(2, 2),
                                                                 support=torch.ones(2, 2)),
         "empty must be 'error' or 'zero'": lambda: Categorical(torch.zeros(2, 2), empty="x")},
    parameters=_parameters)
