"""The prior over one edge family: p(φ_i = j) for each child i over parents j.

A prior is data, not code in the compiler. A subclass states up to four things and
the compiler, the Pyro reading and the drawings derive everything else
(``PriorTables``, priors/tables.py, built per family and pass):

- ``causal``: the support is restricted to j ≤ i;
- ``edge_index``: the support is a graph, an edge list ``(2, E)`` (lowered in O(E));
- ``explicit_support(C, P)``: a boolean ``(…, C, P)`` restriction (a mask);
- ``log_table(C, P)``: unnormalised log prior weights ``(…, C, P)``; −∞ marks a
  parent outside the support. With an edge list only its entries at the edges count.

Everything broadcasts against ``(*batch, heads, C, P)``. The log prior is
``log p(φ_i = j) = b_ij − logsumexp_{j'∈Φ_i} b_ij'`` on the support Φ_i and −∞
outside; the normaliser is constant in j, so attention needs only the finite part of
``b`` as an additive score term (``bias``) and the support as a mask.
"""

from __future__ import annotations

import torch

from .tables import PriorTables
from .tables import check_edge_index as check_edge_index


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

    def check_nodes(self, family: str, children, parents) -> None:
        """Raise a ``ValueError`` naming ``family`` where this prior cannot relate these node
        sets (called when the family is declared); by default any two will do."""

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

    # -- what is derived from it (priors/tables.py) ----------------------------------
    def tables(self, num_children: int, num_parents: int, device) -> PriorTables:
        """This prior's tables for one edge family in one pass, each built at most once.
        The caller holds them for the pass; nothing is stored on the prior."""
        return PriorTables(self, num_children, num_parents, device)

    def reset(self) -> None:
        """Nothing to forget: tables live in a ``PriorTables`` of one family, never on the
        prior (kept so that callers from before that change keep working)."""

    def edges(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(src, dst)`` of an edge-list support on ``device``: parents and children, only
        the edges j ≤ i when causal."""
        src, dst = self.edge_index.to(device)
        if self.causal:
            keep = src <= dst
            src, dst = src[keep], dst[keep]
        return src, dst

    # One-off readings: each builds a fresh ``PriorTables`` (nothing is shared between
    # calls); a reader that needs several tables of one family should hold ``tables(...)``.
    def table(self, num_children, num_parents, device, dtype) -> torch.Tensor | None:
        """``log_table`` in ``dtype`` (None: its own)."""
        return self.tables(num_children, num_parents, device).table(dtype)

    def bias(self, num_children, num_parents, device, dtype) -> torch.Tensor | None:
        """The finite part of ``log_table`` (−∞ entries set to 0; they are masked anyway)."""
        return self.tables(num_children, num_parents, device).bias(dtype)

    def support_mask(self, num_children, num_parents, device) -> torch.Tensor | None:
        """Boolean ``(…, C, P)``: the explicit support (and edge list) ∩ the finite entries
        of ``log_table``, or None when neither restricts."""
        return self.tables(num_children, num_parents, device).support_mask()

    def full_mask(self, num_children, num_parents, device) -> torch.Tensor | None:
        """Boolean support ``(…, C, P)`` including causality, or None for 'all parents'."""
        return self.tables(num_children, num_parents, device).full_mask()

    def log_weights(self, num_children, num_parents, device, dtype) -> torch.Tensor:
        """Unnormalised log prior ``(…, C, P)`` with −∞ outside the support (materialised)."""
        return self.tables(num_children, num_parents, device).log_weights(dtype)

    def log_prob_table(self, num_children, num_parents, device, dtype) -> torch.Tensor:
        """Normalised log prior ``(…, C, P)``: rows are log p(φ_i = ·)."""
        return self.tables(num_children, num_parents, device).log_prob_table(dtype)

    def empty_children(self, num_children, num_parents, device) -> torch.Tensor | None:
        """Boolean ``(…, C)``: children with no allowed parent, when ``empty == "zero"``;
        None when no row can be empty."""
        return self.tables(num_children, num_parents, device).empty_children()

    def sdpa_inputs(self, num_children, num_parents, device, dtype):
        """``(attn_mask, is_causal)`` for ``scaled_dot_product_attention``."""
        return self.tables(num_children, num_parents, device).sdpa_inputs(dtype)

    def validate(self, family: str, num_children: int, num_parents: int, device, *,
                 batch_shape=(), heads: int = 1) -> None:
        """Shapes always; values (NaN/+∞ log weights, children with an empty support) while
        validating. See ``PriorTables.validate``."""
        self.tables(num_children, num_parents, device).validate(
            family, batch_shape=batch_shape, heads=heads)
