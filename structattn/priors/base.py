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
    #: a child with no allowed parent: "error" (ValueError) or "zero" (zero value, zero posterior)
    empty: str = "error"
    #: the support as an edge list (2, E) — row 0 parents j, row 1 children i — or None (dense)
    edge_index: torch.Tensor | None = None

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
        if self.edge_index is not None:
            parts.append(f"graph, {self.edge_index.shape[1]} edges")
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
            if self.empty == "zero":  # rows without support: uniform here, zeroed by the caller
                table = torch.where(mask.any(-1, keepdim=True), table, torch.zeros_like(table))
        return table

    def empty_children(self, num_children, num_parents, device) -> torch.Tensor | None:
        """Boolean ``(…, C)``: children with no allowed parent, when ``empty == "zero"``."""
        if self.empty != "zero":
            return None
        if self.edge_index is not None and not self.causal:  # O(E): count incoming edges
            dst = self.edge_index[1].to(device)
            return torch.bincount(dst, minlength=num_children) == 0
        mask = self.full_mask(num_children, num_parents, device)
        return None if mask is None else ~mask.any(-1)

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
            mask = self.full_mask(num_children, num_parents, device)
            if self.empty == "zero":  # let empty rows attend anywhere; the caller zeroes them
                mask = mask | ~mask.any(-1, keepdim=True)
            return mask, False
        return self.log_weights(num_children, num_parents, device, dtype), False

    # -- checks ---------------------------------------------------------------
    def validate(self, family: str, num_children: int, num_parents: int, device) -> None:
        """Check shapes always and, while validating, that no child has an empty support."""
        if self.empty not in ("error", "zero"):
            raise ValueError(f"edge family {family!r}: prior empty= must be 'error' or 'zero'; "
                             f"got {self.empty!r}")
        if self.edge_index is not None:  # O(E) checks; never the dense C×P reading
            check_edge_index(family, self.edge_index, num_children, num_parents, self.empty)
            return
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
        if not is_validating() or torch.compiler.is_compiling() or self.empty == "zero":
            return
        if self.support_mask(num_children, num_parents, device) is None:
            return  # all parents, or j ≤ i alone: column 0 is always allowed, no row is empty
        mask = self.full_mask(num_children, num_parents, device)
        if mask is not None:
            empty = ~mask.any(-1)
            if bool(empty.any()):
                where = tuple(int(i) for i in empty.nonzero()[0])
                raise ValueError(
                    f"edge family {family!r}: child {where[-1]} (index {where}) has an empty "
                    f"support — no parent is allowed, so p(φ_i | x) does not exist. "
                    f"{int(empty.sum())} of {empty.numel()} children are affected. Allow at "
                    f"least one parent per child (e.g. a self-loop), or ask for a zero output "
                    f"with empty='zero'."
                )


def check_edge_index(family: str, edge_index: torch.Tensor, num_children: int, num_parents: int,
                     empty: str) -> None:
    """Shape and dtype always; index ranges and parentless children while validating."""
    if edge_index.dim() != 2 or edge_index.shape[0] != 2:
        raise ValueError(
            f"edge family {family!r}: edge_index must have shape (2, E) — row 0 parents, row 1 "
            f"children; got {shape_str(edge_index.shape)}"
        )
    if not is_validating() or torch.compiler.is_compiling():
        return
    src, dst = edge_index
    for what, idx, n in (("parent (row 0)", src, num_parents), ("child (row 1)", dst, num_children)):
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n):
            bad = int(idx[(idx < 0) | (idx >= n)][0])
            raise ValueError(
                f"edge family {family!r}: edge_index {what} indices must be in [0, {n}); got {bad}"
            )
    if empty == "error":
        counts = torch.bincount(dst, minlength=num_children)
        if bool((counts == 0).any()):
            first = int((counts == 0).nonzero()[0])
            raise ValueError(
                f"edge family {family!r}: child {first} has an empty support — no edge in "
                f"edge_index points to it ({int((counts == 0).sum())} of {num_children} children "
                f"are affected). Add edges (e.g. self-loops) or ask for a zero output with "
                f"empty='zero'."
            )
