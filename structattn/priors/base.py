"""The prior over one edge family: p(φ_i = j) for each child i over parents j.

A prior is data, not code in the compiler. It states three things, each
optional, and the compiler and the Pyro reading both derive everything
from them:

- ``causal``: the support is restricted to j ≤ i;
- ``support_mask(C, P)``: a boolean ``(…, C, P)`` restriction of the support;
- ``bias(C, P)``: unnormalised log prior weights ``(…, C, P)`` (finite).

The log prior is ``log p(φ_i = j) = bias_ij − logsumexp_{j'∈Φ_i} bias_ij'`` on the
support Φ_i and −∞ outside. The normaliser is constant in j, so attention
only needs ``bias`` as an additive score term and the support as a mask.
"""

from __future__ import annotations

import torch

from .._validation import is_validating, same_device, shape_str


class Prior:
    """Base class of edge priors (see module docstring for the contract)."""

    causal: bool = False

    # -- what a prior states -------------------------------------------------
    def support_mask(self, num_children: int, num_parents: int, device) -> torch.Tensor | None:
        return None

    def bias(self, num_children: int, num_parents: int, device, dtype) -> torch.Tensor | None:
        return None

    def describe(self) -> str:
        return type(self).__name__

    def short_support(self) -> str:
        parts = []
        if self.causal:
            parts.append("j ≤ i")
        if getattr(self, "support", None) is not None:
            parts.append("mask")
        return " ∧ ".join(parts) if parts else "all parents"

    # -- what is derived from it -------------------------------------------
    def full_mask(self, num_children, num_parents, device) -> torch.Tensor | None:
        """Boolean support ``(…, C, P)`` including causality, or None for 'all parents'."""
        mask = self.support_mask(num_children, num_parents, device)
        if self.causal:
            tril = torch.ones(num_children, num_parents, dtype=torch.bool, device=device).tril()
            mask = tril if mask is None else mask & tril
        return mask

    def log_weights(self, num_children, num_parents, device, dtype) -> torch.Tensor:
        """Unnormalised log prior ``(…, C, P)`` with −∞ outside the support (materialised)."""
        bias = self.bias(num_children, num_parents, device, dtype)
        table = (
            torch.zeros(num_children, num_parents, device=device, dtype=dtype)
            if bias is None
            else bias.to(dtype)
        )
        mask = self.full_mask(num_children, num_parents, device)
        if mask is not None:
            table = table.masked_fill(~mask, float("-inf"))
        return table

    def log_prob_table(self, num_children, num_parents, device, dtype) -> torch.Tensor:
        """Normalised log prior ``(…, C, P)``: rows are log p(φ_i = ·)."""
        return torch.log_softmax(self.log_weights(num_children, num_parents, device, dtype), -1)

    def sdpa_inputs(self, num_children, num_parents, device, dtype):
        """``(attn_mask, is_causal)`` for ``scaled_dot_product_attention``.

        Causality alone lowers to the fused ``is_causal`` path; a support mask
        alone to a boolean mask; a bias to an additive float mask with −∞
        outside the support.
        """
        bias = self.bias(num_children, num_parents, device, dtype)
        mask = self.support_mask(num_children, num_parents, device)
        if bias is None and mask is None:
            return None, self.causal
        if bias is None:
            return self.full_mask(num_children, num_parents, device), False
        return self.log_weights(num_children, num_parents, device, dtype), False

    # -- checks ---------------------------------------------------------------
    def validate(self, family: str, num_children: int, num_parents: int, device) -> None:
        """Check shapes always and, while validating, that no child has an empty support."""
        for what, t in (
            ("support mask", self.support_mask(num_children, num_parents, device)),
            ("bias", self.bias(num_children, num_parents, device, torch.float32)),
        ):
            if t is None:
                continue
            if t.dim() < 2 or tuple(t.shape[-2:]) != (num_children, num_parents):
                raise ValueError(
                    f"edge family {family!r}: prior {what} must have shape (…, children, parents)"
                    f"=(…, {num_children}, {num_parents}); got {shape_str(t.shape)}"
                )
            if what == "bias" and not same_device(t.device, device):
                raise ValueError(
                    f"edge family {family!r}: prior {what} is on {t.device} but the node states "
                    f"are on {device}; move the declaration with .to({str(device)!r})"
                )
        if not is_validating() or torch.compiler.is_compiling():
            return
        mask = self.full_mask(num_children, num_parents, device)
        if mask is not None:
            empty = ~mask.any(-1)
            if bool(empty.any()):
                where = tuple(int(i) for i in empty.nonzero()[0])
                raise ValueError(
                    f"edge family {family!r}: child {where[-1]} (index {where}) has an empty "
                    f"support — no parent is allowed, so p(φ_i | x) does not exist. "
                    f"{int(empty.sum())} of {empty.numel()} children are affected. Allow at "
                    f"least one parent per child (e.g. a self-loop)."
                )
