"""The prior over one edge family: p(φ_i = j) for each child i over parents j.

A prior is data, not code in the compiler. A subclass states up to three things and
the compiler, the Pyro reading and the drawings derive everything else here:

- ``causal``: the support is restricted to j ≤ i;
- ``explicit_support(C, P)``: a boolean ``(…, C, P)`` restriction (a mask, or the
  dense reading of an edge list ``edge_index``);
- ``log_table(C, P)``: unnormalised log prior weights ``(…, C, P)``; −∞ marks a
  parent outside the support.

Everything broadcasts against ``(*batch, heads, C, P)``. The log prior is
``log p(φ_i = j) = b_ij − logsumexp_{j'∈Φ_i} b_ij'`` on the support Φ_i and −∞
outside; the normaliser is constant in j, so attention needs only the finite part of
``b`` as an additive score term (``bias``) and the support as a mask.
"""

from __future__ import annotations

import torch

from .._validation import first_true, is_validating, same_device, shape_str


class Prior:
    """Base class of edge priors (see module docstring for the contract)."""

    causal: bool = False
    #: a child with no allowed parent: "error" (ValueError) or "zero" (zero value, zero posterior)
    empty: str = "error"
    #: the support as an edge list (2, E) — row 0 parents j, row 1 children i — or None (dense)
    edge_index: torch.Tensor | None = None

    # -- what a subclass states -------------------------------------------------
    def explicit_support(self, num_children: int, num_parents: int, device) -> torch.Tensor | None:
        return None

    def log_table(self, num_children: int, num_parents: int, device, dtype) -> torch.Tensor | None:
        """``(…, C, P)`` log weights in ``dtype`` (None: the parameters' own), or None."""
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

    # -- what is derived from it ---------------------------------------------------
    def reset(self) -> None:
        """Forget tables built for an earlier edge family. Each family (one forward pass)
        starts afresh, so a (C, P) table is built once per pass however many readings use
        it, and never outlives the parameters or the autograd graph it came from."""
        self.__dict__["_tables"] = {}

    def _memo(self, what, fn, *key):
        tables = self.__dict__.setdefault("_tables", {})
        key = (what, *(str(k) if isinstance(k, torch.device) else k for k in key))
        if key not in tables:
            tables[key] = fn()
        return tables[key]

    def table(self, num_children, num_parents, device, dtype) -> torch.Tensor | None:
        """``log_table`` in ``dtype`` (None: its own), built once per family."""
        t = self._memo("table", lambda: self.log_table(num_children, num_parents, device, None),
                       num_children, num_parents, device)
        return t if t is None or dtype is None else t.to(dtype)

    def bias(self, num_children, num_parents, device, dtype) -> torch.Tensor | None:
        """The finite part of ``log_table`` (−∞ entries set to 0; they are masked anyway)."""
        table = self.table(num_children, num_parents, device, dtype)
        if table is None:
            return None
        return table.masked_fill(torch.isneginf(table), 0.0)

    def support_mask(self, num_children, num_parents, device) -> torch.Tensor | None:
        """Boolean ``(…, C, P)``: the explicit support ∩ the finite entries of ``log_table``,
        or None when neither restricts (built from tensor ops only, so it traces)."""
        def build():
            mask = self.explicit_support(num_children, num_parents, device)
            table = self.table(num_children, num_parents, device, None)
            if table is not None:
                finite = ~torch.isneginf(table)
                mask = finite if mask is None else mask & finite
            return mask
        return self._memo("support", build, num_children, num_parents, device)

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

    def edges(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(src, dst)`` of an edge-list support on ``device``: parents and children, only
        the edges j ≤ i when causal."""
        src, dst = self.edge_index.to(device)
        if self.causal:
            keep = src <= dst
            src, dst = src[keep], dst[keep]
        return src, dst

    def log_prob_table(self, num_children, num_parents, device, dtype) -> torch.Tensor:
        """Normalised log prior ``(…, C, P)``: rows are log p(φ_i = ·)."""
        return torch.log_softmax(self.log_weights(num_children, num_parents, device, dtype), -1)

    def empty_children(self, num_children, num_parents, device) -> torch.Tensor | None:
        """Boolean ``(…, C)``: children with no allowed parent, when ``empty == "zero"``;
        None when no row can be empty (all parents, or j ≤ i alone: never C×P work)."""
        if self.empty != "zero":
            return None
        if self.edge_index is not None and not self.causal:  # O(E): count incoming edges
            dst = self.edge_index[1].to(device)
            return torch.bincount(dst, minlength=num_children) == 0
        if self.support_mask(num_children, num_parents, device) is None:
            return None
        return ~self.full_mask(num_children, num_parents, device).any(-1)

    def sdpa_inputs(self, num_children, num_parents, device, dtype):
        """``(attn_mask, is_causal)`` for ``scaled_dot_product_attention``.

        Causality alone lowers to the fused ``is_causal`` path; a support mask
        alone to a boolean mask; a log table to an additive float mask with −∞
        outside the support.
        """
        table = self.table(num_children, num_parents, device, dtype)
        explicit = self.explicit_support(num_children, num_parents, device)
        if table is None and explicit is None:
            return None, self.causal
        if table is not None and explicit is None and self.empty == "error":
            # the table itself is the additive mask (−∞ = outside the support): no copies;
            # causality still takes SDPA's fused path only when nothing else restricts
            if not self.causal:
                return table, False
        if table is None:
            mask = self.full_mask(num_children, num_parents, device)
            if self.empty == "zero":  # let empty rows attend anywhere; the caller zeroes them
                mask = mask | ~mask.any(-1, keepdim=True)
            return mask, False
        return self.log_weights(num_children, num_parents, device, dtype), False

    # -- checks ---------------------------------------------------------------------
    def validate(self, family: str, num_children: int, num_parents: int, device, *,
                 batch_shape=(), heads: int = 1) -> None:
        """Shapes always (each table must broadcast to ``(*batch, heads, C, P)``); values
        (NaN/+∞ log weights, children with an empty support) while validating."""
        if self.empty not in ("error", "zero"):
            raise ValueError(f"edge family {family!r}: prior empty= must be 'error' or 'zero'; "
                             f"got {self.empty!r}")
        if self.edge_index is not None:  # O(E) checks; never the dense C×P reading
            check_edge_index(family, self.edge_index, num_children, num_parents, self.empty,
                             self.causal)
            return
        target = (*batch_shape, heads, num_children, num_parents)
        table = self.table(num_children, num_parents, device, None)
        for what, t in (("support mask", self.explicit_support(num_children, num_parents, device)),
                        ("log weights", table)):
            if t is None:
                continue
            try:
                ok = tuple(torch.broadcast_shapes(t.shape, target)) == target
            except RuntimeError:
                ok = False
            if not ok:
                raise ValueError(
                    f"edge family {family!r}: prior {what} must broadcast to (*batch, heads, "
                    f"children, parents)={shape_str(target)}; got {shape_str(t.shape)}"
                )
            if what == "log weights" and not same_device(t.device, device):
                raise ValueError(
                    f"edge family {family!r}: prior {what} are on {t.device} but the node states "
                    f"are on {device}; move the declaration with .to({str(device)!r})"
                )
        if not is_validating() or torch.compiler.is_compiling():
            return
        explicit = self.explicit_support(num_children, num_parents, device)
        if table is not None:  # −∞ excludes a parent; NaN and +∞ are errors
            first = first_true(table.isnan() | table.isposinf())
            if first is not None:
                raise ValueError(
                    f"edge family {family!r}: prior log weights contain non-finite values (NaN "
                    f"or +inf) at index {first}; only −inf (a parent outside the support) is "
                    f"allowed"
                )
        if self.empty == "zero":
            return
        if explicit is None and (table is None or not bool(torch.isneginf(table).any())):
            return  # all parents, or j ≤ i alone: column 0 is always allowed, no row is empty
        mask = self.full_mask(num_children, num_parents, device)
        empty = ~mask.any(-1)
        where = first_true(empty)
        if where is not None:
            raise ValueError(
                f"edge family {family!r}: child {where[-1]} (index {where}) has an empty "
                f"support — no parent is allowed, so p(φ_i | x) does not exist. "
                f"{int(empty.sum())} of {empty.numel()} children are affected. Allow at "
                f"least one parent per child (e.g. a self-loop), or ask for a zero output "
                f"with empty='zero'."
            )


def check_edge_index(family: str, edge_index: torch.Tensor, num_children: int, num_parents: int,
                     empty: str, causal: bool = False) -> None:
    """Shape always; index ranges, duplicate edges and parentless children while validating
    (all O(E); with ``causal`` only edges j ≤ i count)."""
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
    # a support is a set: an edge listed twice would count twice in a softmax over edges
    keys = dst * num_parents + src
    unique, counts = torch.unique(keys, return_counts=True)
    if bool((counts > 1).any()):
        k = int(unique[counts > 1][0])
        raise ValueError(
            f"edge family {family!r}: edge_index lists the edge {k % num_parents} → "
            f"{k // num_parents} (parent → child) {int(counts[counts > 1][0])} times; an edge is "
            f"in the support or not — remove duplicates (e.g. torch.unique(edge_index, dim=1))"
        )
    if empty == "error":
        kept = dst[src <= dst] if causal else dst
        counts = torch.bincount(kept, minlength=num_children)
        if bool((counts == 0).any()):
            first = int((counts == 0).nonzero()[0])
            raise ValueError(
                f"edge family {family!r}: child {first} has an empty support — no edge in "
                f"edge_index{' from j ≤ i' if causal else ''} points to it "
                f"({int((counts == 0).sum())} of {num_children} children are affected). Add "
                f"edges (e.g. self-loops) or ask for a zero output with empty='zero'."
            )
