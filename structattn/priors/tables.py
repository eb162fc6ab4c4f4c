"""What the compiled reading derives from a prior for one edge family in one forward pass.

``PriorTables(prior, C, P, device)`` reads the prior's statement — its ``support(C, P)``
(a ``structattn.kinds`` ``Support``), its dense ``log_table`` and ``empty`` — and builds
the tables the operators need: the dense support mask, the additive bias, the normalised
log prior, the per-edge log weights of an edge list, the inputs of
``scaled_dot_product_attention``, a stationary prior's table over the offsets i − j
(``Offsets``, O(C + P)), a support's non-empty tiles (``kinds.blocks``) — each at most once,
on demand; ``validate`` checks them (``table_checks``). (Pyro's reading does not
use these tables: it evaluates the prior's ``contains`` and ``log_weight`` itself.)

It is a cache with the lifetime of one family: whoever reads a family holds it for
that pass and drops it with the family. Nothing is stored on the prior, so a prior
whose parameters change between calls gives fresh tables, and no tensor (nor the
autograd graph behind it) of an earlier pass stays reachable from the prior.

Shapes: every table broadcasts against ``(*batch, heads, C, P)`` (dense) or
``(*batch, heads, E)`` (per edge of an edge list).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checking._validation import (
    checks_on,
    is_exporting,
    may_hold,
)
from ..kinds import blocks as support_blocks
from ..kinds.dense import AllParents, Causal, Mask
from ..kinds.window import Window
from .table_checks import (
    _check_log_weights,
    _check_no_empty_child,
    _check_no_empty_edge_child,
    _check_offsets,
    _check_shape,
    _check_table,
    _check_terms,
    _edge_counts,
    check_edge_index,
)


@dataclass(frozen=True)
class Offsets:
    """A prior's log weight as a function of the offset d = i − j and the band a support
    reads: ``table[…, d − lowest]`` for ``lo`` ≤ d ≤ ``hi`` (and 0 ≤ j < P), the table
    ``(heads or 1, n)`` over d = ``lowest`` … ``lowest`` + n − 1."""

    table: torch.Tensor
    lowest: int
    lo: int
    hi: int

    def empty(self, num_children: int, num_parents: int) -> torch.Tensor:
        """``(C,)`` bool: the children whose every offset read, max(lo, i − (P − 1)) … min(hi,
        i), weighs −∞ (or that read none), in any head: from the running count of finite
        entries, O(C + n)."""
        seen = torch.nn.functional.pad((~torch.isneginf(self.table)).cumsum(-1), (1, 0))
        i = torch.arange(num_children, device=self.table.device)
        first = (i - (num_parents - 1)).clamp(min=self.lo) - self.lowest
        last = i.clamp(max=self.hi) - self.lowest + 1
        n = seen.shape[-1] - 1
        count = seen[:, last.clamp(0, n)] - seen[:, first.clamp(0, n)]
        return ((count <= 0) | (last <= first)).any(0)


class PriorTables:
    """The tables of ``prior`` for ``num_children`` × ``num_parents`` nodes on ``device``."""

    def __init__(self, prior, num_children: int, num_parents: int, device):
        self.prior = prior
        self.num_children, self.num_parents = num_children, num_parents
        self.device = device
        self.support = prior.support(num_children, num_parents)
        self._built: dict = {}
        self._family = "?"  # the family's name, for the messages of checks made later

    def _once(self, key, build):
        if key not in self._built:
            self._built[key] = build()
        return self._built[key]

    @property
    def is_edge_list(self) -> bool:
        return hasattr(self.support, "edges")

    # -- the prior's own statements -----------------------------------------------------
    def table(self, dtype=None) -> torch.Tensor | None:
        """``log_table``: unnormalised log weights ``(…, C, P)`` in ``dtype`` (None: its own)."""
        own = self._once("table", lambda: self.prior.log_table(
            self.num_children, self.num_parents, self.device, None))
        if own is None or dtype is None or own.dtype == dtype:
            return own
        return self._once(("table", dtype), lambda: own.to(dtype))

    def support_dense(self) -> torch.Tensor | None:
        """The support's own dense mask ``(…, C, P)``, None for every parent (an edge list
        builds it here: small graphs only, the edge-list operator never asks)."""
        return self._once("dense", lambda: self.support.dense(
            self.num_children, self.num_parents, self.device))

    # -- dense readings ----------------------------------------------------------------
    def bias(self, dtype=None) -> torch.Tensor | None:
        """The finite part of ``log_table`` (−∞ entries set to 0; they are masked anyway)."""
        table = self.table(dtype)
        if table is None:
            return None
        return self._once(("bias", table.dtype),
                          lambda: table.masked_fill(torch.isneginf(table), 0.0))

    def full_mask(self) -> torch.Tensor | None:
        """Boolean ``(…, C, P)``: the support ∩ the finite entries of ``log_table``, or None
        for 'every parent' (built from tensor ops only, so it traces)."""
        def build():
            mask, table = self.support_dense(), self.table()
            if table is not None:
                finite = ~torch.isneginf(table)
                mask = finite if mask is None else mask & finite
            return mask
        return self._once("full", build)

    def log_weights(self, dtype) -> torch.Tensor:
        """Unnormalised log prior ``(…, C, P)`` with −∞ outside the support (materialised)."""
        def build():
            table = self.table(dtype)  # its −∞ entries are outside full_mask: no bias copy
            table = (torch.zeros(self.num_children, self.num_parents, device=self.device, dtype=dtype)
                     if table is None else table)
            mask = self.full_mask()
            if mask is not None:
                table = table.masked_fill(~mask, float("-inf"))
                if self.prior.empty == "zero":  # rows without support: uniform, zeroed by the caller
                    table = torch.where(mask.any(-1, keepdim=True), table, torch.zeros_like(table))
            return table
        return self._once(("log_weights", dtype), build)

    def log_prob_table(self, dtype) -> torch.Tensor:
        """Normalised log prior ``(…, C, P)``: rows are log p(φ_i = ·)."""
        return self._once(("log_prob", dtype),
                          lambda: torch.log_softmax(self.log_weights(dtype), -1))

    def parent_terms(self, dtype) -> torch.Tensor | None:
        """The prior's per-parent term ``h (…, P)`` when it separates (``Prior.terms``) over
        every parent or j ≤ i — the supports SDPA takes without a mask — and no row can be
        empty; None otherwise (the table is the bias). In ``dtype``, float32 at least: h grows
        along the sequence (m·j, a cumulative sum), and a logit read as ``scale·⟨a_i, b_j⟩ +
        h_j`` carries h_j's rounding, eps·|h_j| — 6e-8·|h_j| in float32, but 4e-3·|h_j| in
        bfloat16. The key-bias kernels take it so; a reading that would fold it into
        half-precision factors (``kinds.key_bias.folds_terms``) reads the table instead."""
        terms = self.separable()
        dtype = torch.promote_types(dtype, torch.float32)
        return None if terms is None else self._once(("parent_terms", dtype),
                                                     lambda: terms[1].to(dtype))

    def separable(self):
        """The prior's ``(g, h)`` (``Prior.terms``) when it states them over every parent or
        j ≤ i — the supports SDPA takes without a mask — and no row may be empty; else None."""
        def build():
            if self.prior.empty != "error" or (self.support.dense(1, 1, self.device) is not None
                                               and not self.support.is_causal()):
                return None
            return self.prior.terms(self.num_children, self.num_parents, self.device)
        return self._once("separable", build)

    def offsets(self):
        """The prior's table over the offsets d = i − j (``Prior.log_at_offsets``) and the
        band the support reads, an ``Offsets``, when the support is every parent, exactly
        j ≤ i, or a window of its children's own positions (``first`` ≤ d ≤ ``width``); else
        None. The distance-table kernel reads it, and ``validate`` and ``empty_children``
        check it in O(C + P) instead of the C×P table."""
        def build():
            support = self.support
            if type(support) is AllParents:
                lo, hi = 1 - self.num_parents, self.num_children - 1
            elif type(support) is Causal:
                lo, hi = 0, self.num_children - 1
            elif type(support) is Window and support.offset == 0 and (
                    support.width is None or type(support.width) is int):
                lo = support.first
                hi = self.num_children - 1 if support.width is None else support.width
            else:
                return None
            stated = self.prior.log_at_offsets(self.num_children, self.num_parents, self.device,
                                               lo >= 0)
            return None if stated is None else Offsets(*stated, lo, hi)
        return self._once("offsets", build)

    def blocks(self):
        """The support's tiles (``kinds.blocks.SupportBlocks``) when the dense operator reads
        it by blocks: a uniform prior on a support other than every parent, j ≤ i, a window or
        an edge list, whose attributes are plain values (``support_key``: not a ``Mask``, whose
        C×P tensor the caller holds already and which would be classified every call), of
        ``kinds.blocks.BLOCKS_FROM`` tokens or more, listing at most ``MOST_LISTED`` of the
        tiles, not in an exported program (which reads the dense mask); else None. Classified
        once per support and sizes (``classify_once``), in chunks: never a C×P boolean."""
        def build():
            support, C, P = self.support, self.num_children, self.num_parents
            if max(C, P) < support_blocks.BLOCKS_FROM or self.is_edge_list \
                    or is_exporting() or torch.compiler.is_exporting() \
                    or type(support) in (AllParents, Causal, Mask) \
                    or support_blocks.support_key(support) is None \
                    or self.offsets() is not None or self._weighted():
                return None
            blocks = support_blocks.classify_once(support, C, P, self.device)
            return blocks if blocks.fraction <= support_blocks.MOST_LISTED else None
        return self._once("blocks", build)

    def _weighted(self) -> bool:
        """Whether the prior has log weights (not uniform), told without its C×P table: it
        states a table of its own (``log_table`` overridden) or ``log_weight`` at one pair."""
        if not self.prior.weights_from_log_weight():
            return self.table() is not None  # its own tensor: no new C×P table
        one = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        return self.prior.log_weight(one, one, (self.num_children, self.num_parents)) is not None

    def by_rows(self) -> bool:
        """Whether the prior states only ``log_weight`` — its table is ``log_weight`` on the
        grid (``Prior.log_table`` not overridden), not uniform, with no per-token terms and no
        table over the offsets — on a grid of ``kinds.blocks.BLOCKS_FROM`` tokens or more
        (not an edge list): the dense operator then reads it a block of children at a time
        (``kinds.row_chunks``), and ``validate`` and ``empty_children`` check it so, never the
        C×P table."""
        def build():
            prior, C, P = self.prior, self.num_children, self.num_parents
            if max(C, P) < support_blocks.BLOCKS_FROM or self.is_edge_list \
                    or not prior.weights_from_log_weight() \
                    or self.offsets() is not None or self.separable() is not None:
                return False
            return self._weighted()
        return self._once("by_rows", build)

    def rows_empty(self) -> torch.Tensor:
        """``(C,)`` bool: children whose every parent weighs −∞ or lies outside the support, in
        any head, checked block by block (``by_rows``); NaN and +∞ refused on the way."""
        def build():
            from ..kinds import row_chunks

            C, empty = self.num_children, []
            for i0 in range(0, C, row_chunks.ROWS):
                lw = row_chunks.block_weights(self, i0, min(C, i0 + row_chunks.ROWS), None)
                if checks_on():
                    _check_log_weights(self._family, lw, f"at index (rows {i0}…)")
                gone = torch.isneginf(lw).all(-1)  # (…, n)
                empty.append(gone.reshape(-1, gone.shape[-1]).any(0))
            return torch.cat(empty) if empty else torch.zeros(0, dtype=torch.bool)
        return self._once("rows_empty", build)

    def sdpa_inputs(self, dtype):
        """``(attn_mask, is_causal)`` for ``scaled_dot_product_attention``.

        j ≤ i alone lowers to the fused ``is_causal`` path; a support mask alone to a
        boolean mask; a log table to an additive float mask with −∞ outside the support.
        """
        table, support = self.table(dtype), self.support
        if table is None and support.is_causal():
            return None, True
        explicit = self.support_dense()
        if table is None and explicit is None:
            return None, False
        if table is not None and explicit is None and self.prior.empty == "error":
            return table, False  # the table itself is the additive mask (−∞ = outside)
        if table is None:
            mask = self.full_mask()
            if self.prior.empty == "zero":  # let empty rows attend anywhere; the caller zeroes them
                mask = mask | ~mask.any(-1, keepdim=True)
            return mask, False
        return self.log_weights(dtype), False

    # -- edge-list readings (all O(E): never the dense C×P support) ----------------------
    def edges(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(src, dst)``, each ``(E,)``: the edges of an edge-list support (j ≤ i only when
        causal); every per-edge table is aligned with them."""
        return self._once("edges", lambda: self.support.edges(self.device))

    def edge_bias(self, dtype=None) -> torch.Tensor | None:
        """Per-edge log weights ``(…, E)`` (``log_table`` at each edge; −∞: the edge is
        outside the support), or None when the prior has no log table. Costs the prior's
        own dense table, if it has one, and a gather."""
        table = self.table(dtype)
        if table is None:
            return None
        src, dst = self.edges()
        C, P = self.num_children, self.num_parents
        return self._once(("edge_bias", table.dtype),  # broadcast_to: a view, e.g. of a (1, P) table
                          lambda: torch.broadcast_to(table, (*table.shape[:-2], C, P))[..., dst, src])

    def empty_children(self) -> torch.Tensor | None:
        """Boolean ``(…, C)``: children with no allowed parent, when ``empty == "zero"``;
        None when no row can be empty (every parent: never C×P work)."""
        if self.prior.empty != "zero":
            return None
        if self.is_edge_list:  # O(E): count incoming edges of finite weight
            return self._once("empty", lambda: _edge_counts(self) == 0)
        if self.offsets() is not None:  # O(C + P): the table over the offsets
            return self._once("empty", lambda: self.offsets().empty(self.num_children,
                                                                    self.num_parents))
        if self.blocks() is not None:  # each child's count of parents
            return self.blocks().empty
        if self.by_rows():  # block by block
            return self.rows_empty()
        if self.full_mask() is None:
            return None
        return self._once("empty", lambda: ~self.full_mask().any(-1))

    # -- checks ---------------------------------------------------------------------------
    def validate(self, family: str, *, batch_shape=(), heads: int = 1) -> None:
        """Shapes always (each table must broadcast to ``(*batch, heads, C, P)``); values
        (NaN/+∞ log weights, children with an empty support) while validating. An edge
        list is checked here once per pass, in O(E); the lowering does not check it again."""
        prior, C, P = self.prior, self.num_children, self.num_parents
        if prior.empty not in ("error", "zero"):
            raise ValueError(f"edge family {family!r}: prior empty= must be 'error' or 'zero'; "
                             f"got {prior.empty!r}")
        target = (*batch_shape, heads, C, P)
        if self.is_edge_list:
            check_edge_index(family, self.support.edge_index, C, P)
            table = self.table()
            if table is not None:
                _check_table(family, "log weights", table, target, self.device)
            if not checks_on():
                return
            if table is not None:
                _check_log_weights(family, self.edge_bias(), "at edge")
            if prior.empty == "error":
                _check_no_empty_edge_child(family, self, _edge_counts(self))
            return
        terms = self.separable()
        if terms is not None:  # checked as they are lowered: O(C + P), never the C×P table
            _check_terms(family, terms, batch_shape, heads, C, P)
            return
        if self.offsets() is not None:  # O(C + P), never the C×P table
            return _check_offsets(family, self, heads)
        if self.blocks() is not None:  # the tiles' counts: never the C×P mask
            if checks_on() and prior.empty == "error":
                _check_no_empty_child(family, self.blocks().empty)
            return
        if self.by_rows():  # block by block: never the C×P table
            from ..kinds.row_chunks import block_weights

            self._family = family
            first = block_weights(self, 0, min(C, 1), None)  # (…, 1, P): its leading dims
            _check_shape(family, "log weights", (*first.shape[:-2], C, P), target)
            if checks_on():
                empty = self.rows_empty()
                if prior.empty == "error":
                    _check_no_empty_child(family, empty)
            return
        table, explicit = self.table(), self.support_dense()
        for what, t in (("support mask", explicit), ("log weights", table)):
            if t is not None:
                _check_table(family, what, t, target, self.device)
        if not checks_on():
            return
        if table is not None:  # −∞ excludes a parent; NaN and +∞ are errors
            _check_log_weights(family, table, "at index")
        if prior.empty == "zero":
            return
        if self.support.is_causal() and self.num_parents and (
                table is None or not may_hold(torch.isneginf(table).any())):
            return  # j ≤ i alone: column 0 is always allowed, no row is empty
        if explicit is None and (table is None or not may_hold(torch.isneginf(table).any())):
            return  # every parent
        _check_no_empty_child(family, ~self.full_mask().any(-1))
