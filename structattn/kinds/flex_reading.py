"""FlexAttention on CUDA: the readings the CPU's own kernels serve there (a distance table,
a support's tiles, a prior of ``log_weight`` alone), as one ``flex_attention`` call with a
``score_mod``, a ``mask_mod`` and a block mask, never a ``(…, C, P)`` table or mask.

- a prior over the offsets (``PriorTables.offsets``): ``score_mod`` adds ``t[h, i − j + P −
  1]``, t the prior's table spread over every offset 1 − P … C − 1 (−∞ outside the band and
  the prior's own), ``(heads or 1, C + P − 1)``; the block mask lists the tiles the band
  lo ≤ i − j ≤ hi reaches, computed from the tiles' corners (O(C·P / 128²)), its ``mask_mod``
  the band. The table's gradient flows through FlexAttention's backward to the prior's
  parameters;
- a support read by blocks (``PriorTables.blocks``, a uniform prior): ``mask_mod`` is the
  support's ``contains``, the block mask its classification (``kinds.blocks``: listed and
  full tiles, grouped into FlexAttention's 128 × 128 tiles), never the (C, P) mask;
- a prior of ``log_weight`` alone (``PriorTables.by_rows``), where ``LOG_WEIGHT`` is on (off
  by default): ``score_mod`` calls the prior's ``log_weight`` on FlexAttention's index
  tensors and takes the head's entry, the ``mask_mod`` and block mask those of its support
  (every parent, j ≤ i as a band, or a support with a ``support_key`` classified); the
  parameters ``log_weight`` reads get their gradients from FlexAttention's backward.

It serves CUDA tensors in float32, bfloat16 and float16 with widths of 16 or more, from
``kinds.blocks.BLOCKS_FROM`` tokens, outside a recorded plan (FlexAttention runs fused
through ``torch.compile``: such a call is read every call), an exported program and
``torch.compile`` (whose graph would hold the block mask's construction); elsewhere the
CPU's kernels or the dense reading serve (FlexAttention has no backward on the CPU).
``disabled()`` turns it off in a block (per thread), so that the readings can be compared.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from .. import reading
from ..checking._validation import is_exporting
from ..operators.band import _fused_flex_attention
from . import blocks as support_blocks

__all__ = ["BLOCK", "FlexPlan", "applies", "attend", "disabled", "plan"]

#: FlexAttention's tiles, children × parents (its default: its kernels' blocks divide it)
BLOCK = 128
#: the dtypes FlexAttention's CUDA kernels read (float64: the dense reading)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: the narrowest factor and value width its CUDA kernels take
MIN_WIDTH = 16
#: whether a prior of ``log_weight`` alone is read here (off: the rows reading serves it). Off
#: until a GPU run checks it: torch.compile's CPU FlexAttention computes a wrong ``score_mod``
#: where ``log_weight`` reshapes its parameters per head (``a.reshape(-1, 1, 1)``, then the
#: head's entry: 2.96 off on the tests' ``Drift``), and the CUDA kernel is not yet checked
#: (``tests/kinds/test_flex_reading.py`` turns it on there)
LOG_WEIGHT = False
#: how many block masks are kept (the newest)
KEPT = 32
_kept: OrderedDict = OrderedDict()
_lock = threading.Lock()


@contextlib.contextmanager
def disabled():
    """Context manager: no FlexAttention reading inside this block (per thread); the families
    it would read take the reading they take without it."""
    with reading.entered(flex=False):
        yield


def available() -> bool:
    """Whether this torch has FlexAttention."""
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def applies(a: torch.Tensor, b: torch.Tensor, u: torch.Tensor) -> bool:
    """Whether FlexAttention may read these factors (module docstring): CUDA, one dtype of
    ``DTYPES``, widths ≥ ``MIN_WIDTH``, ``BLOCKS_FROM`` tokens or more, not exporting,
    recording-free compilation and not turned off (``disabled``)."""
    if not reading.context().flex or not a.is_cuda or a.dtype not in DTYPES:
        return False
    if not all(x.device == a.device and x.dtype == a.dtype for x in (b, u)):
        return False
    if min(a.shape[-1], u.shape[-1]) < MIN_WIDTH or b.shape[-2] == 0 \
            or max(a.shape[-2], b.shape[-2]) < support_blocks.BLOCKS_FROM:
        return False
    if is_exporting() or torch.compiler.is_exporting() or torch.compiler.is_compiling():
        return False
    return available()


@dataclass(frozen=True, eq=False)
class FlexPlan:
    """What one FlexAttention call reads: ``score_mod`` (None: the scores alone), the block
    mask (its ``mask_mod`` the support's), the rows of a per-head prior (1: shared), and the
    share of the 128 × 128 tiles listed (``visited``)."""

    score_mod: object
    block_mask: object
    visited: float
    rows: int = 1


def plan(tables) -> FlexPlan | None:
    """The FlexAttention reading of a family's prior (``PriorTables``), or None where it has
    none: a distance table, a support read by blocks, or a prior of ``log_weight`` alone over
    every parent, j ≤ i or a support with a ``support_key``."""
    C, P = tables.num_children, tables.num_parents
    offsets = tables.offsets()
    if offsets is not None:
        return _distance(offsets, C, P, tables.device)
    blocks = tables.blocks()
    if blocks is not None:
        return FlexPlan(None, *_support_mask(tables.support, blocks, C, P))
    if tables.by_rows() and LOG_WEIGHT:
        return _log_weight(tables, C, P)
    return None


def attend(a: torch.Tensor, b: torch.Tensor, u: torch.Tensor, flex: FlexPlan,
           scale: float) -> torch.Tensor:
    """``softmax_j(scale·⟨a_i, b_j⟩ + log w_ij) u_j`` over the support, as ``flex`` reads it.

    Args:
        a: ``(*lead, C, d)``; b: ``(*lead, P, d)``; u: ``(*lead, P, d_v)`` (the leading dims
            broadcast, the last one the heads).
        flex: ``plan``'s reading of the family.
        scale: a float.

    Returns ``(*lead, C, d_v)`` in u's dtype; a child with no parent (or whose every weight
    is −∞) gets a zero row."""
    lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2], u.shape[:-2], (flex.rows,))
    heads = lead[-1]
    q, k, v = (x.expand(*lead, *x.shape[-2:]).reshape(-1, heads, *x.shape[-2:])
               for x in (a, b, u))  # FlexAttention's (B, H, n, width)
    out = _fused_flex_attention()(q, k, v, score_mod=flex.score_mod,
                                  block_mask=flex.block_mask, scale=float(scale))
    return out.reshape(*lead, *out.shape[-2:])


# -- the three readings ----------------------------------------------------------------

def _distance(offsets, C: int, P: int, device) -> FlexPlan:
    """A table over the offsets: spread over every offset of the grid, −∞ outside the band
    and the prior's own table, so that ``score_mod`` indexes it without a bound check."""
    table = offsets.table
    table = table.to(torch.promote_types(table.dtype, torch.float32))
    n = table.shape[-1]
    d = torch.arange(1 - P, C, device=table.device)  # every offset of the grid
    at = d - offsets.lowest
    valid = (d >= offsets.lo) & (d <= offsets.hi) & (at >= 0) & (at < n)
    spread = table[:, at.clamp(0, max(n - 1, 0))].masked_fill(~valid, float("-inf"))
    rows, shift = spread.shape[0], P - 1

    def score_mod(score, bi, h, i, j):
        return score + spread[h if rows > 1 else 0, i - j + shift]

    lo, hi = max(offsets.lo, 1 - P), min(offsets.hi, C - 1)
    mask = _kept_mask(("band", lo, hi, C, P, str(device)),
                      lambda: _band_mask(lo, hi, C, P, device))
    return FlexPlan(score_mod, *mask, rows)


def _log_weight(tables, C: int, P: int) -> FlexPlan | None:
    """``log_weight`` as the ``score_mod``, its support's block mask; None where the prior's
    weights have leading dims other than the heads', or its support has no ``support_key``."""
    prior, support, device, sizes = tables.prior, tables.support, tables.device, (C, P)
    one = torch.zeros(1, 1, dtype=torch.long, device=device)
    lead = prior.log_weight(one, one, sizes).shape[:-2]
    rows = 1
    for s in lead:
        rows *= s
    if any(s != 1 for s in lead[:-1]):  # batch dims of its own: the rows reading serves
        return None
    if support.dense(1, 1, device) is None:  # every parent
        mask = _kept_mask(("band", 1 - P, C - 1, C, P, str(device)),
                          lambda: _band_mask(1 - P, C - 1, C, P, device))
    elif support.is_causal():
        mask = _kept_mask(("band", 0, C - 1, C, P, str(device)),
                          lambda: _band_mask(0, C - 1, C, P, device))
    elif support_blocks.support_key(support) is not None:
        mask = _support_mask(support, support_blocks.classify_once(support, C, P, device), C, P)
    else:
        return None

    def score_mod(score, bi, h, i, j):
        lw = prior.log_weight(i, j, sizes).reshape(-1)
        return score + lw[h if rows > 1 else 0].to(score.dtype)

    return FlexPlan(score_mod, *mask, rows)


def _support_mask(support, blocks, C: int, P: int):
    """The block mask of a support with a ``support_key``, from its classification
    (``blocks``), its ``mask_mod`` the support's ``contains``."""
    def mask_mod(bi, h, i, j):
        return support.contains(i, j)

    key = ("support", support_blocks.support_key(support), C, P, str(blocks.offsets.device))
    return _kept_mask(key, lambda: _from_classes(*_coarse(blocks, support), C, P, mask_mod))


# -- block masks -------------------------------------------------------------------------

def _kept_mask(key, build):
    """``build()``'s block mask and the share of the tiles it lists, kept per key (the newest
    ``KEPT``): a support's or band's structure is a function of its sizes."""
    with _lock:
        if key in _kept:
            _kept.move_to_end(key)
            return _kept[key]
    with torch.no_grad():
        mask = build()
        mask = mask, _visited(mask)  # read once, on the host
    with _lock:
        _kept[key] = mask
        while len(_kept) > KEPT:
            _kept.popitem(last=False)
    return mask


def _band_mask(lo: int, hi: int, C: int, P: int, device):
    """The block mask of lo ≤ i − j ≤ hi: a tile is listed where its offsets, from its first
    child less its last parent to its last child less its first parent, meet the band, full
    where they lie inside it."""
    i0 = torch.arange(0, C, BLOCK, device=device)[:, None]
    j0 = torch.arange(0, P, BLOCK, device=device)[None, :]
    i1, j1 = (i0 + BLOCK).clamp(max=C) - 1, (j0 + BLOCK).clamp(max=P) - 1
    low, high = i0 - j1, i1 - j0
    listed = (high >= lo) & (low <= hi)
    full = (low >= lo) & (high <= hi)
    bounds = torch.tensor([lo, hi], device=device)

    def in_band(bi, h, i, j):
        d = i - j
        return (d >= bounds[0]) & (d <= bounds[1])

    return _from_classes(listed, full, C, P, in_band)


def _coarse(blocks, support):
    """A classification's listed and full tiles ``(nq, nk)`` bool, grouped into ``BLOCK`` ×
    ``BLOCK`` tiles (listed: any part listed; full: every part full, parts beyond the grid
    counting as full). Where its tiles do not divide ``BLOCK``, the support is classified
    again at ``BLOCK`` × ``BLOCK``."""
    if BLOCK % blocks.block_q or BLOCK % blocks.block_k:
        blocks = support_blocks.classify(support, blocks.num_children, blocks.num_parents,
                                         BLOCK, BLOCK, device=blocks.offsets.device)
    nq, nk, device = blocks.num_child_blocks, blocks.num_parent_blocks, blocks.offsets.device
    rows = torch.repeat_interleave(torch.arange(nq, device=device), blocks.offsets.diff())
    fq, fk = BLOCK // blocks.block_q, BLOCK // blocks.block_k
    mq, mk = -(-nq // fq) * fq, -(-nk // fk) * fk
    listed = torch.zeros(mq, mk, dtype=torch.bool, device=device)
    full = torch.ones(mq, mk, dtype=torch.bool, device=device)
    full[:nq, :nk] = False
    listed[rows, blocks.blocks] = True
    whole = blocks.mask_index < 0
    full[rows[whole], blocks.blocks[whole]] = True
    listed = listed.view(mq // fq, fq, mk // fk, fk).any(3).any(1)
    full = full.view(mq // fq, fq, mk // fk, fk).all(3).all(1) & listed
    return listed, full


def _from_classes(listed, full, C: int, P: int, mask_mod):
    """A ``BlockMask`` from the listed and full tiles ``(nq, nk)``: the partial ones read
    through ``mask_mod``, the full ones without it."""
    from torch.nn.attention.flex_attention import BlockMask

    def ordered(m):  # each row's True columns first, ascending: (1, 1, nq) and (1, 1, nq, nk)
        order = torch.sort((~m).to(torch.int8), dim=-1, stable=True).indices
        return m.sum(-1).to(torch.int32)[None, None], order.to(torch.int32)[None, None]

    return BlockMask.from_kv_blocks(*ordered(listed & ~full), *ordered(full),
                                    BLOCK_SIZE=(BLOCK, BLOCK), mask_mod=mask_mod,
                                    seq_lengths=(C, P))


def _visited(mask) -> float:
    """The share of the tiles a block mask lists (partial or full)."""
    partial, full = mask.kv_num_blocks, mask.full_kv_num_blocks
    listed = int(partial.sum()) + (0 if full is None else int(full.sum()))
    total = partial.shape[-1] * -(-mask.seq_lengths[1] // BLOCK)
    return listed / total if total else 0.0
