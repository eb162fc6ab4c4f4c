"""Dense supports — every parent, j ≤ i, a boolean mask, their intersections — and the dense
operator, which lowers any support through one ``scaled_dot_product_attention`` call
(``is_causal``, a boolean mask or an additive log-prior bias; a log prior g_i + h_j as one
more key dimension, or without gradients on the CPU as the fused kernel's mask over the
parents, ``key_bias``; a generalised Gaussian over the distance computed per block of scores
on CUDA, ``distance_kernel``; never the C×P posterior) or,
when the posterior is asked for or a potential has no factorised form, through the dense
posterior softmax(ψ + log prior) itself.

Cost: SDPA O(C·P·(d_k + d_v)) time, O((C + P)·d) memory; the dense posterior O(C·P).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..checking._validation import checks_on
from . import block_support, distance_kernel, distance_table, flex_reading, key_bias, row_chunks
from . import blocks as support_blocks
from .base import Intersection, Operator, Support, grid, keep_nonfinite_rows
from .lowered import Lowering


def with_parent_terms(a, b, u, h, scale: float):
    """Factors whose scaled products are ``scale·⟨a_i, b_j⟩ + h_j`` — ``a`` gains a column
    of ones, ``b`` the column ``h/scale`` (``h (…, P)`` broadcasts against ``b``'s leading
    dims) — and the values ``u`` padded with zero columns to the same width, since the fused
    CPU kernels (forward and backward) take queries, keys and values of one width only; the
    caller keeps the output's first ``u.shape[-1]`` columns. O((C + P)·d) memory. On CUDA the
    width is a multiple of 8: its fused kernels refuse a width of 65 (d = 64 and the term),
    which would leave SDPA its math kernel, forming the C×P scores (on the CPU 65 and 72 cost
    the same time, and 65 less memory)."""
    lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2], u.shape[:-2], h.shape[:-1])
    a, b = a.expand(*lead, *a.shape[-2:]), b.expand(*lead, *b.shape[-2:])
    u = u.expand(*lead, *u.shape[-2:])
    h = (h.to(b.dtype) / scale).expand(*lead, h.shape[-1]).unsqueeze(-1)
    align = 8 if a.is_cuda else 1
    width = -(-max(a.shape[-1] + 1, u.shape[-1]) // align) * align
    qk_pad, u_pad = width - a.shape[-1] - 1, width - u.shape[-1]
    a = torch.cat([a, torch.ones_like(a[..., :1]), a.new_zeros(*a.shape[:-1], qk_pad)], -1)
    b = torch.cat([b, h, b.new_zeros(*b.shape[:-1], qk_pad)], -1)
    u = torch.cat([u, u.new_zeros(*u.shape[:-1], u_pad)], -1) if u_pad else u
    return a, b, u


class AllParents(Support):
    """Φ_i = every parent: no mask (``dense`` is None).

    Takes no constructor arguments.

    Attributes:
        operator (type | None): None: lowered by the dense operator, one SDPA call without a
            mask.
    """

    def contains(self, child, parent):
        return torch.ones(torch.broadcast_shapes(child.shape, parent.shape), dtype=torch.bool,
                          device=child.device)

    def dense(self, num_children, num_parents, device):
        return None

    def describe(self):
        return "all parents"


class Causal(Support):
    """Φ_i = {j ≤ i}: a child reads itself and the parents before it.

    Takes no constructor arguments.

    Attributes:
        operator (type | None): None: lowered by the dense operator, through SDPA's fused
            ``is_causal`` path (``is_causal``).
    """

    def contains(self, child, parent):
        return parent <= child

    def dense(self, num_children, num_parents, device):
        return torch.ones(num_children, num_parents, dtype=torch.bool, device=device).tril()

    def is_causal(self):
        return True

    def describe(self):
        return "j ≤ i"


class Before(Support):
    """Φ_i = {j < i}: a child reads the parents strictly before it (the first child none).

    Takes no constructor arguments.

    Attributes:
        operator (type | None): None: lowered by the dense operator, with a boolean mask.
    """

    def contains(self, child, parent):
        return parent < child

    def dense(self, num_children, num_parents, device):
        return torch.ones(num_children, num_parents, dtype=torch.bool, device=device).tril(-1)

    def describe(self):
        return "j < i"


class Mask(Support):
    """Φ_i = {j : mask[…, i, j]}: the parents a boolean mask allows.

    Args:
        mask (torch.Tensor): a boolean tensor ``(…, C, P)``, its batch and heads dims
            broadcasting against ``(*batch, heads)``; not checked here (the priors that take
            one, ``Uniform`` and ``Categorical``, check its dtype).
    """

    def __init__(self, mask: torch.Tensor):
        self.mask = mask

    def contains(self, child, parent):
        i, j = torch.broadcast_tensors(child, parent)
        return self.mask[..., i, j]

    def dense(self, num_children, num_parents, device):
        return self.mask.to(device)

    def describe(self):
        return "mask"


class DenseOperator(Operator, dense_twin=True):
    """The dense lowering of any support (module docstring): one SDPA call, or the dense
    posterior softmax(ψ + log prior) when it is asked for or a potential has no factors.

    Every other operator's dense twin (``Operator.dense_twin``).

    Args:
        family (EdgeFamily): the edge family whose posterior it reads (``Operator``).
        cache (dict | None): what an iterating reader keeps across steps (``Operator``).
            None (default): a new, empty one.
    """

    def __init__(self, family, cache=None):
        super().__init__(family, cache)
        self._post = None
        self._scores = None
        self._lowering = None  # (reading, reason) of the last attend

    # -- pieces that do not change while the latents move ------------------------------
    def log_weights(self) -> torch.Tensor:
        """Unnormalised log prior ``(…, C, P)``, −∞ off the support."""
        f, xc = self.family, self.family.children.states
        return self._const("log_weights", lambda: f.tables.log_weights(xc.dtype))

    def flat_prior(self) -> bool:
        """True when the prior is uniform over all parents (no mask, no table): its log weights
        are zero and need not be added to the scores."""
        f, xc = self.family, self.family.children.states
        return self._const("flat", lambda: f.tables.sdpa_inputs(xc.dtype) == (None, False))

    def log_normaliser(self) -> torch.Tensor:
        """log Σ_j exp(log weights) per child ``(…, C)``: log p(φ_i = j) = weights − this."""
        return self._const("log_normaliser", lambda: torch.logsumexp(self.log_weights(), -1))

    def keep(self) -> torch.Tensor | None:
        """``(…, C, 1)`` 0/1: zero for children without parents (``empty="zero"``), or None."""
        return self.family.keep()

    # -- the scores ------------------------------------------------------------------
    def _parents_major(self) -> bool:
        """Few parents per child (slots): keep scores as (…, P, C) so the softmax runs along
        a non-innermost dim, where the CPU kernel vectorises over children; a softmax along an
        innermost dim of a few entries is several times slower."""
        return self.family.parents.size <= 32 and self.family.children.size >= 4 * \
            self.family.parents.size

    def _table(self) -> tuple[torch.Tensor, int]:
        """ψ + log prior and the parents' dim: ``(*batch, H, C, P)`` (dim −1) or, when
        ``_parents_major``, ``(*batch, H, P, C)`` (dim −2)."""
        if self._scores is None:
            f = self.family
            t = self._parents_major()
            total = None if self.flat_prior() else (
                self.log_weights().transpose(-1, -2) if t else self.log_weights())
            for psi in f.potentials:
                if psi.is_factorised:
                    a, b, scale = self.factors(psi)
                    if a.dtype in (torch.float16, torch.bfloat16):  # accumulate in float32
                        a, b = a.float(), b.float()
                    if isinstance(scale, torch.Tensor):  # learned: 0-dim, or (H, 1, 1) per head
                        scale = scale.to(a.dtype)
                    if a.shape[-2] <= b.shape[-2]:  # scale the smaller factor, not C×P scores
                        a = a * scale
                    else:
                        b = b * scale
                    term = b @ a.transpose(-1, -2) if t else a @ b.transpose(-1, -2)
                else:
                    term = psi.pairwise(f.children.states, f.parents.states)
                    term = term.transpose(-1, -2) if t else term
                total = term if total is None else total + term
            self._scores = total.expand(*f.batch_shape, f.heads, *total.shape[-2:])
        return self._scores, (-2 if self._parents_major() else -1)

    def scores(self) -> torch.Tensor:
        """ψ + log prior (unnormalised), ``(*batch, H, C, P)``, −∞ off the support."""
        table, dim = self._table()
        return table if dim == -1 else table.transpose(-1, -2)

    # -- the operator ------------------------------------------------------------------
    def dense_posterior(self) -> torch.Tensor:
        if self._post is None:
            table, dim = self._table()
            post, keep = torch.softmax(table, dim), self.keep()
            if keep is None and self.family.prior.empty == "error" and not checks_on():
                # unchecked rows without support: zero, as the fused kernel gives, not NaN
                post = post.masked_fill(torch.isneginf(table).all(dim, keepdim=True), 0.0)
            post = post.to(self.family.children.states.dtype)
            post = post if dim == -1 else post.transpose(-1, -2)
            self._post = post if keep is None else post * keep
        return self._post

    def attend(self, u: torch.Tensor) -> torch.Tensor:
        """``P u`` through one SDPA call or a kernel, unless the dense posterior already exists
        or a potential has no factorised form; the reading taken is ``lowering()``'s."""
        if self._post is not None or not self.is_fused():
            return self.dense_posterior() @ u
        f, xc = self.family, self.family.children.states
        a, b, scale = self.fused_factors()
        u_width = u.shape[-1]
        h = self._const("parent_terms", lambda: f.tables.parent_terms(xc.dtype))
        support = f.tables.support
        shape = (f.prior.distance_shape() if h is None and (
            support.is_causal() or isinstance(support, AllParents)) else None)
        offsets = f.tables.offsets() if h is None else None
        if h is not None and key_bias.applies(a, b, u, h):  # log prior g_i + h_j: g drops out,
            out = key_bias.key_bias_attention(  # h is a mask over the parents (CPU; with grad
                # through the compiled kernel's backward), or a term of each block's scores
                # (Triton, any dtype, h in float32)
                a, b, u, h, scale, f.tables.support.is_causal())
            self._lowering = "key-bias terms", None
        elif shape is not None and distance_kernel.applies(a, b, u):
            # −|(i − j − μ)·e^s|^β computed per block of scores (Triton): no C×P bias
            out = distance_kernel.distance_kernel_attention(a, b, u, shape, scale,
                                                            f.tables.support.is_causal())
            self._lowering = "distance kernel", None
        elif h is None and flex_reading.applies(a, b, u) \
                and (flex := flex_reading.plan(f.tables)) is not None:
            # CUDA: a distance table, a support's tiles or log_weight in one FlexAttention call
            out = flex_reading.attend(a, b, u, flex, float(scale))
            self._lowering = "flex", None, flex.visited
        elif offsets is not None and distance_table.applies(a, b, u):
            # a function of i − j alone, looked up per tile of scores (CPU): no C×P bias
            out = distance_table.distance_table_attention(a, b, u, offsets, scale)
            self._lowering = "distance table", None
        elif h is None and f.tables.by_rows() and row_chunks.applies():
            # log_weight alone: a block of children at a time, recomputed in the backward
            out = row_chunks.attention(a, b, u, f.tables, float(scale))
            self._lowering = "rows", None
        elif h is None and f.tables.blocks() is not None \
                and block_support.uses_kernel(a, b, u):
            # a support of few tiles: only its non-empty tiles read, partial ones masked (CPU)
            blocks = f.tables.blocks()
            out = block_support.block_support_attention(a, b, u, blocks, float(scale))
            self._lowering = "blocks", None, blocks.fraction
        else:
            if h is not None and not key_bias.folds_terms(a, b, u):  # half precision: the
                h = None  # table, not h rounded into the factors
            if h is None:
                mask, is_causal = self._const("sdpa", lambda: f.tables.sdpa_inputs(xc.dtype))
            else:  # … elsewhere h rides in one more key dimension
                a, b, u = with_parent_terms(a, b, u, h, scale)
                mask, is_causal = None, f.tables.support.is_causal()
            if mask is not None and 2 < mask.dim() < a.dim():  # a per-head table (H, C, P):
                # q's rank, as a view — the CPU's fused kernel takes a 2-D or a 4-D mask only,
                # a 3-D one sends SDPA to its math path (the C×P scores, twice, in memory)
                mask = mask[(None,) * (a.dim() - mask.dim())]
            out = F.scaled_dot_product_attention(a, b, u, attn_mask=mask, is_causal=is_causal,
                                                 scale=scale)
            if h is not None:
                out = out[..., :u_width]
            self._lowering = (("key-bias terms", None) if h is not None else ("sdpa", None)
                              if mask is None else ("dense", self._why_dense(a, offsets)))
        if not checks_on():  # nothing was checked: a NaN must stay a NaN
            out = keep_nonfinite_rows(out, a, b)
        keep = self.keep()
        return out if keep is None else out * keep

    def _why_dense(self, a: torch.Tensor, offsets) -> str:
        """Why this family's prior or support was read as a ``(…, C, P)`` table or mask."""
        f = self.family
        support, prior = f.tables.support, f.prior
        if offsets is not None:  # a distance table no kernel took here
            if a.device.type != "cpu":
                return (f"no {a.device.type.upper()} reading takes this distance table "
                        f"({prior.describe()}) here: FlexAttention reads CUDA tensors in "
                        f"float32 or half precision, widths ≥ {flex_reading.MIN_WIDTH}, from "
                        f"{support_blocks.BLOCKS_FROM:,} tokens; the CPU's compiled kernel "
                        f"reads float32 and float64")
            if a.dtype not in (torch.float32, torch.float64):
                return (f"the distance-table kernel reads float32 and float64, not "
                        f"{str(a.dtype).removeprefix('torch.')}")
            return "the compiled distance-table kernel is off, not built, or exporting"
        if f.tables.blocks() is not None:  # blocks no kernel took here
            return (f"its support ({support.describe()}) lists "
                    f"{f.tables.blocks().fraction:.1%} of the tiles, but the block kernel reads "
                    f"CPU tensors in float32 or float64 with the kernels on, FlexAttention CUDA "
                    f"tensors in float32 or half precision of widths ≥ {flex_reading.MIN_WIDTH} "
                    f"(here {a.device.type}, {str(a.dtype).removeprefix('torch.')}, factors of "
                    f"width {a.shape[-1]})")
        if f.tables.by_rows():  # log_weight alone, where no plan is recorded
            return ("its prior states log_weight alone, read a block of children at a time "
                    "except in an export or under torch.compile")
        if not isinstance(support, (AllParents, Causal)):
            n = max(f.children.size, f.parents.size)
            why = (f"under {support_blocks.BLOCKS_FROM:,} tokens the mask is small"
                   if n < support_blocks.BLOCKS_FROM
                   else "a lone Mask is its own (C, P) table" if isinstance(support, Mask)
                   else "it holds a tensor (a Mask), its (C, P) mask already"
                   if support_blocks.support_key(support) is None
                   else f"it lists over {support_blocks.MOST_LISTED:.0%} of the tiles"
                   if f.tables.table() is None else "its prior states a (C, P) table")
            return f"its support ({support.describe()}) is read as a (C, P) mask: {why}"
        if prior.empty != "error":
            return f"a child may have no parent (empty={prior.empty!r})"
        return (f"its prior ({prior.describe()}) states neither per-token terms nor a log "
                f"weight of i − j alone: log_weight is evaluated on the (C, P) grid")

    def lowering(self) -> Lowering:
        f = self.family
        size = (f.children.size, f.parents.size)
        if self._lowering is None:  # the posterior was built (asked for, or no factors)
            why = ("the posterior was asked for" if self.is_fused()
                   else "a potential has no factorised form (its pairwise table)")
            return Lowering("dense posterior", why, size)
        reading, reason, *visited = self._lowering
        return Lowering(reading, reason, size, *visited)

    def adjoint(self, u: torch.Tensor) -> torch.Tensor:
        return self.dense_posterior().transpose(-1, -2) @ u

    def mass(self) -> torch.Tensor:
        return self.dense_posterior().sum(-2).unsqueeze(-1)

    def log_partition(self) -> torch.Tensor:
        """log Σ_j exp(ψ_ij) p(φ_i = j) per child, ``(*batch, H, C)``; 0 for a child without
        any parent (``empty="zero"``: no edge, no factor)."""
        table, dim = self._table()
        lse = torch.logsumexp(table, dim)
        if self.flat_prior():
            return lse - math.log(self.family.parents.size)
        out = lse - self.log_normaliser()
        keep = self.keep()
        return out if keep is None else out * keep[..., 0].to(out.dtype)


__all__ = ["AllParents", "Causal", "Before", "Mask", "Intersection", "DenseOperator", "grid"]
