"""The checks ``PriorTables.validate`` makes of a prior's tables, each raising a ValueError that
names the edge family: shapes against ``(*batch, heads, C, P)``, log weights (NaN and +∞
refused, −∞ excludes a parent), children left without parents, an edge list's indices, and a
table over the offsets (``Offsets``) in O(C + P)."""

from __future__ import annotations

import torch

from ..checking._validation import (
    blame_parameters,
    checks_on,
    first_true,
    passes,
    same_device,
    shape_str,
)


def _check_no_empty_child(family, empty: torch.Tensor) -> None:
    """Raise naming the first child whose support is empty (``empty (…, C)`` bool)."""
    where = first_true(empty)
    if where is not None:
        raise ValueError(
            f"edge family {family!r}: child {where[-1]} (index {where}) has an empty "
            f"support — no parent is allowed, so p(φ_i | x) does not exist. "
            f"{int(empty.sum())} of {empty.numel()} children are affected. Allow at "
            f"least one parent per child (e.g. a self-loop), or ask for a zero output "
            f"with empty='zero'."
        )


def _check_offsets(family, tables, heads: int) -> None:
    """The checks of ``validate`` on the prior's table over the offsets (``offsets``): one row
    or one per head; no NaN or +∞; and, where that is an error, no child whose every offset
    weighs −∞ — O(C + P)."""
    off = tables.offsets()
    table, C, P = off.table, tables.num_children, tables.num_parents
    if table.dim() != 2 or table.shape[1] < C - off.lowest:
        raise ValueError(f"edge family {family!r}: {type(tables.prior).__name__}'s log weight "
                         f"over the offsets must be (1 or heads={heads}, {C - off.lowest}); got "
                         f"{shape_str(table.shape)}")
    # the dense table it stands for is (rows, C, P): its shape checked as the generic one is
    _check_shape(family, "log weights", (table.shape[0], C, P), (heads, C, P))
    _check_table(family, "log weights", table, table.shape, tables.device)
    if not checks_on():
        return
    _check_log_weights(family, table, "at offset index")
    if tables.prior.empty == "error":
        _check_no_empty_child(family, off.empty(C, P))


def _edge_counts(tables) -> torch.Tensor:
    """``(…, C)``: how many edges of finite log weight reach each child (O(E))."""
    src, dst = tables.edges()
    weights = tables.edge_bias()
    if weights is None:  # (``index_add_``, not ``bincount``: its size is the data's)
        ones = torch.ones_like(dst)
        return ones.new_zeros(tables.num_children).index_add_(0, dst, ones)
    finite = (~torch.isneginf(weights)).to(torch.long)
    counts = finite.new_zeros(*finite.shape[:-1], tables.num_children)
    return counts.index_add_(-1, dst, finite)


def _broadcasts_to(shape, target: tuple) -> bool:
    """Whether ``shape`` broadcasts to exactly ``target``."""
    try:
        return tuple(torch.broadcast_shapes(shape, target)) == target
    except RuntimeError:
        return False


def _check_table(family, what, t, target, device) -> None:
    _check_shape(family, what, t.shape, target)
    if what == "log weights" and not same_device(t.device, device):
        raise ValueError(
            f"edge family {family!r}: prior {what} are on {t.device} but the node states "
            f"are on {device}; move the declaration with .to({str(device)!r})"
        )


def _check_shape(family, what, shape, target) -> None:
    if not _broadcasts_to(shape, target):
        raise ValueError(
            f"edge family {family!r}: prior {what} must broadcast to (*batch, heads, "
            f"children, parents)={shape_str(target)}; got {shape_str(shape)}. A table with "
            f"batch dims needs the heads dim too: (*batch, 1 or heads, children, parents); a "
            f"model with several heads declares them on the family, "
            f"structattn.edges(..., heads=H), as on its potential and value"
        )


def _check_terms(family, terms, batch_shape, heads, C, P) -> None:
    """A separable prior's per-child and per-parent terms: shapes that broadcast to
    ``(*batch, heads, C)`` and ``(*batch, heads, P)``; finite values while validating (a
    −∞ term would make its difference NaN; j ≤ i leaves no row empty)."""
    for what, t, n in (("per-child", terms[0], C), ("per-parent", terms[1], P)):
        target = (*batch_shape, heads, n)
        if not _broadcasts_to(t.shape, target):
            raise ValueError(
                f"edge family {family!r}: the prior's {what} log-weight terms must broadcast to "
                f"(*batch, heads, {'children' if n == C else 'parents'})={shape_str(target)}; "
                f"got {shape_str(t.shape)}")
    if checks_on() and not passes(terms[0].isfinite().all() & terms[1].isfinite().all()):
        blame_parameters(f"edge family {family!r}: the prior log weights")
        raise ValueError(f"edge family {family!r}: prior log weights contain non-finite values "
                         f"(NaN or ±inf) in their per-token terms")


def _check_log_weights(family, table, where) -> None:
    first = first_true(table.isnan() | table.isposinf())
    if first is not None:
        blame_parameters(f"edge family {family!r}: the prior log weights")  # learned logits?
        raise ValueError(
            f"edge family {family!r}: prior log weights contain non-finite values (NaN "
            f"or +inf) {where} {first}; only −inf (a parent outside the support) is "
            f"allowed"
        )


def _check_no_empty_edge_child(family, tables, counts: torch.Tensor) -> None:
    empty = counts == 0
    where = first_true(empty)
    if where is None:
        return
    causal = " from j ≤ i" if tables.support.causal else ""
    finite = " of finite log weight" if tables.table() is not None else ""
    raise ValueError(
        f"edge family {family!r}: child {where[-1]} has an empty support — no edge{finite} in "
        f"edge_index{causal} points to it ({int(empty.sum())} of {empty.numel()} children are "
        f"affected). Add edges (e.g. self-loops) or ask for a zero output with empty='zero'."
    )


def check_edge_index(family: str, edge_index: torch.Tensor, num_children: int,
                     num_parents: int) -> None:
    """Shape always; index ranges and duplicate edges while validating (all O(E))."""
    if edge_index.dim() != 2 or edge_index.shape[0] != 2:
        raise ValueError(
            f"edge family {family!r}: edge_index must have shape (2, E) — row 0 parents, row 1 "
            f"children; got {shape_str(edge_index.shape)}"
        )
    if not checks_on():
        return
    src, dst = edge_index
    for what, idx, n in (("parent (row 0)", src, num_parents), ("child (row 1)", dst, num_children)):
        if idx.numel() and not passes(((idx >= 0) & (idx < n)).all()):
            bad = int(idx[(idx < 0) | (idx >= n)][0])
            raise ValueError(
                f"edge family {family!r}: edge_index {what} indices must be in [0, {n}); got {bad}"
            )
    # a support is a set: an edge listed twice would count twice in a softmax over edges
    keys = (dst * num_parents + src).sort().values
    if keys.numel() > 1 and not passes((keys[1:] != keys[:-1]).all()):
        unique, counts = torch.unique(keys, return_counts=True)
        k = int(unique[counts > 1][0])
        raise ValueError(
            f"edge family {family!r}: edge_index lists the edge {k % num_parents} → "
            f"{k // num_parents} (parent → child) {int(counts[counts > 1][0])} times; an edge is "
            f"in the support or not — remove duplicates (e.g. torch.unique(edge_index, dim=1))"
        )
