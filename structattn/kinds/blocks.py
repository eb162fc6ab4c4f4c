"""A support's block structure: which (BQ children × BK parents) tiles of the (C, P) grid hold
a pair of the support, and of those which hold every pair (full) or some (partial, with the
tile's own mask) — what the block-support reading (``structattn.kinds.block_support``) visits.

    tile (r, c) = children [r·BQ, (r + 1)·BQ) × parents [c·BK, (c + 1)·BK), clipped to C and P;
    listed ⇔ ∃ (i, j) in the tile with contains(i, j);  full ⇔ ∀ (i, j) in the tile, contains(i, j).

``classify`` evaluates ``support.contains`` on a few block rows of the grid at a time (``chunk``
of them: O(chunk·BQ·P) memory), never the whole (C, P) mask: O(C·P) time once (the cost of
``contains`` on every pair), but O(n_partial·BQ·BK + C + nq·nk) memory to keep — a band or a
Longformer pattern, O(N·w) and N²/(BQ·BK) flags, where the dense mask is N² (at 16,384
tokens in 64 × 64 tiles: 4 MiB of masks and 64 KiB of flags, against 256 MiB).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..checking._validation import check_size, is_recording, shape_str
from .base import Support

__all__ = ["SupportBlocks", "classify", "classify_once", "support_key"]

#: the (child, parent) pairs one chunk's grid holds at most by default (``classify``'s
#: ``chunk=None``): 1 Mi pairs, 1 MiB as a boolean and 8 MiB as a support's long
#: intermediates (``child - parent``) — larger chunks are slower (fresh pages for each one)
PAIRS = 1 << 20
#: the default tiles, children × parents: the fastest forward and backward measured for
#: Longformer's Band(256) | Global(16) at 8,192 tokens, d = 16, on the CPU kernel (against
#: 128 × 128, 128 × 64, 64 × 128, 32 × 64 and 256 × 256)
BLOCK_Q, BLOCK_K = 64, 64


@dataclass(frozen=True, eq=False)  # its fields are tensors: no elementwise ==
class SupportBlocks:
    """A support's non-empty tiles as CSR over blocks of children (``classify``).

    Attributes:
        num_children (int): C; num_parents (int): P.
        block_q (int): BQ, children per block; block_k (int): BK, parents per block.
        offsets (torch.Tensor): ``(nq + 1,)`` int64, nq = ⌈C / BQ⌉: child block r lists
            ``blocks[offsets[r]:offsets[r + 1]]``.
        blocks (torch.Tensor): ``(nnz,)`` int64, each child block's non-empty key blocks, in
            ascending order.
        mask_index (torch.Tensor): ``(nnz,)`` int64, per listed tile −1 (full: every pair in
            the support) or the index of its mask in ``masks``.
        masks (torch.Tensor): ``(n_partial, BQ, BK)`` bool, each partial tile's ``contains``
            (pairs beyond C or P False).
        counts (torch.Tensor): ``(C,)`` int64, each child's number of parents (0: a child
            with no parent, ``empty``).
    """

    num_children: int
    num_parents: int
    block_q: int
    block_k: int
    offsets: torch.Tensor
    blocks: torch.Tensor
    mask_index: torch.Tensor
    masks: torch.Tensor
    counts: torch.Tensor

    @property
    def num_child_blocks(self) -> int:
        """nq = ⌈C / BQ⌉."""
        return -(-self.num_children // self.block_q)

    @property
    def num_parent_blocks(self) -> int:
        """nk = ⌈P / BK⌉."""
        return -(-self.num_parents // self.block_k)

    @property
    def nnz(self) -> int:
        """How many tiles are listed (full or partial)."""
        return int(self.blocks.numel())

    @property
    def fraction(self) -> float:
        """Listed tiles / all nq·nk tiles (0 for an empty grid): the share of the dense work
        the block reading does."""
        total = self.num_child_blocks * self.num_parent_blocks
        return self.nnz / total if total else 0.0

    @property
    def empty(self) -> torch.Tensor:
        """``(C,)`` bool: children with no parent at all."""
        return self.counts == 0

    def to(self, device) -> SupportBlocks:
        """The same structure with its tensors on ``device``."""
        move = {k: getattr(self, k).to(device)
                for k in ("offsets", "blocks", "mask_index", "masks", "counts")}
        return SupportBlocks(self.num_children, self.num_parents, self.block_q, self.block_k,
                             **move)


def _contains(support: Support, child: torch.Tensor, parent: torch.Tensor) -> torch.Tensor:
    """``support.contains`` on children ``(n, 1)`` × parents ``(1, P)``, as a ``(n, P)`` bool;
    a support with leading dims of its own (a mask per batch or head) is refused."""
    n, P = child.shape[0], parent.shape[1]
    inside = support.contains(child, parent)
    if not isinstance(inside, torch.Tensor) or inside.dtype != torch.bool:
        what = inside.dtype if isinstance(inside, torch.Tensor) else type(inside).__name__
        raise ValueError(f"classify: support {support.describe()}: contains(child, parent) must "
                         f"return a bool tensor; got {what}")
    lead = inside.shape[:-2]
    if any(s != 1 for s in lead):
        raise ValueError(f"classify: support {support.describe()}: one block structure serves one "
                         f"(C, P) support; its contains has leading dims {shape_str(lead)} (a mask "
                         f"per batch or head): classify each separately")
    try:
        return inside.reshape(inside.shape[-2:] if inside.dim() >= 2 else inside.shape
                              ).broadcast_to(n, P)
    except RuntimeError:
        raise ValueError(f"classify: support {support.describe()}: contains on children {n} × "
                         f"parents {P} must broadcast to {shape_str((n, P))}; got "
                         f"{shape_str(inside.shape)}") from None


class _Masks:
    """The partial tiles' masks ``(n, BQ, BK)``, appended chunk by chunk into one buffer that
    doubles when full: a few long-lived allocations, not one per chunk between the chunks'
    large transient ones (which fragments the C library's heap: RSS grew ~2 MiB a chunk at
    16,384 tokens, measured)."""

    def __init__(self, capacity: int, BQ: int, BK: int, device):
        self.data = torch.zeros(max(1, capacity), BQ, BK, dtype=torch.bool, device=device)
        self.used = 0

    def append(self, tiles: torch.Tensor) -> None:
        n = tiles.shape[0]
        if self.used + n > self.data.shape[0]:
            grown = self.data.new_zeros(max(2 * self.data.shape[0], self.used + n),
                                        *self.data.shape[1:])
            grown[:self.used] = self.data[:self.used]
            self.data = grown
        self.data[self.used:self.used + n] = tiles
        self.used += n

    def result(self) -> torch.Tensor:
        return self.data[:self.used].clone()


def classify(support: Support, num_children: int, num_parents: int, block_q: int = BLOCK_Q,
             block_k: int = BLOCK_K, device=None, chunk: int | None = None) -> SupportBlocks:
    """The tiles of ``support`` on the (C, P) grid that hold a pair, full or partial (module
    docstring), read ``chunk`` blocks of children at a time.

    Args:
        support (Support): the support (``structattn.kinds``); its ``contains`` may not have
            leading dims of its own (one structure per (C, P) support).
        num_children (int): C ≥ 0; num_parents (int): P ≥ 0.
        block_q (int): BQ ≥ 1, children per block; block_k (int): BK ≥ 1, parents per block.
            Default ``BLOCK_Q`` × ``BLOCK_K``, 64 × 64.
        device (torch.device | str | None): where to evaluate ``contains`` and keep the
            structure. None: the CPU.
        chunk (int | None): how many blocks of children are evaluated at once (peak memory
            O(chunk·BQ·P)). None (default): as many as keep a chunk under ``PAIRS`` pairs (at
            least one block).

    Returns:
        SupportBlocks: the CSR structure, its partial tiles' masks and each child's count.

    Raises:
        ValueError: a size that is not an int (≥ 0 for C and P, ≥ 1 for the others), or a
            ``contains`` that does not return a bool tensor broadcasting to the grid.

    Example:
        >>> from structattn.kinds import Causal
        >>> s = classify(Causal(), 5, 5, 2, 2)
        >>> s.offsets.tolist(), s.blocks.tolist(), s.mask_index.tolist()
        ([0, 1, 3, 6], [0, 0, 1, 0, 1, 2], [0, -1, 1, -1, -1, -1])
    """
    C = check_size("classify", "num_children", num_children, least=0)
    P = check_size("classify", "num_parents", num_parents, least=0)
    BQ = check_size("classify", "block_q", block_q)
    BK = check_size("classify", "block_k", block_k)
    if not isinstance(support, Support):
        raise ValueError(f"classify: support must be a structattn.kinds.Support; got "
                         f"{type(support).__name__}")
    nq, nk = -(-C // BQ), -(-P // BK)
    chunk = (max(1, PAIRS // (BQ * max(P, 1))) if chunk is None
             else check_size("classify", "chunk", chunk))
    device = torch.device("cpu") if device is None else torch.device(device)
    long = dict(dtype=torch.long, device=device)
    parent = torch.arange(P, **long)[None, :]  # (1, P)
    cols = (P - torch.arange(nk, **long) * BK).clamp(max=BK)  # (nk,) parents per key block
    # what is kept, allocated once (a chunk writes into it): its transient grids then reuse
    # the same memory chunk after chunk
    counts = torch.zeros(C, dtype=torch.int32, device=device)
    listed = torch.zeros(nq, nk, dtype=torch.bool, device=device)  # nq·nk bits: N²/(BQ·BK)
    full = torch.zeros(nq, nk, dtype=torch.bool, device=device)
    masks = _Masks(2 * nq, BQ, BK, device)
    for r0 in range(0, nq, chunk):
        r1 = min(nq, r0 + chunk)
        n, first = min(r1 * BQ, C) - r0 * BQ, r0 * BQ
        child = torch.arange(first, first + n, **long)[:, None]  # (n, 1)
        inside = _contains(support, child, parent)  # (n, P)
        grid = torch.zeros((r1 - r0) * BQ, nk * BK, dtype=torch.bool, device=device)
        grid[:n, :P] = inside
        del inside
        # sums over outer dims (vectorised along the parents), never over a tile's BK
        # contiguous entries (an inner reduction of a few entries: ~40× slower, measured)
        ones = grid.view(torch.uint8)
        counts[first:first + n] = ones[:n].sum(-1, dtype=torch.int32)  # parents of each child
        hits = ones.view(r1 - r0, BQ, nk * BK).sum(1, dtype=torch.int32)  # (nb, nk·BK)
        hits = hits.view(r1 - r0, nk, BK).sum(-1)  # (nb, nk) pairs of each tile in the support
        rows = (C - torch.arange(r0, r1, **long) * BQ).clamp(max=BQ)  # (nb,) children per block
        listed[r0:r1] = hits > 0
        full[r0:r1] = hits == rows[:, None] * cols[None, :]
        tiles = grid.view(r1 - r0, BQ, nk, BK).transpose(1, 2)  # (nb, nk, BQ, BK), a view
        masks.append(tiles[listed[r0:r1] & ~full[r0:r1]])  # row-major, as the listing
    partial = (listed & ~full)[listed]  # (nnz,) which listed tiles are partial, row-major
    mask_index = torch.full(partial.shape, -1, **long)
    mask_index[partial] = torch.arange(int(partial.sum()), **long)
    offsets = torch.zeros(nq + 1, **long)
    offsets[1:] = listed.sum(-1).cumsum(0)
    return SupportBlocks(C, P, BQ, BK, offsets=offsets, blocks=listed.nonzero()[:, 1],
                         mask_index=mask_index, masks=masks.result(), counts=counts.long())


#: the tokens (max of children and parents) from which the dense operator reads a support by
#: blocks: below, the dense mask is small and one fused SDPA call reads it
BLOCKS_FROM = 1024
#: the largest share of the tiles a support may list and still be read by blocks: above it,
#: the dense mask's one fused call costs about as much
MOST_LISTED = 0.5
#: how many structures ``classify_once`` keeps (the newest)
KEPT = 32
_kept: OrderedDict = OrderedDict()
_kept_lock = threading.Lock()


def support_key(support: Support):
    """A hashable key that determines ``support``'s ``contains`` at any sizes, or None: the
    class and its attributes where each is a plain value (int, float, str, bool, None, a tuple
    of them, a support with a key — a union's or intersection's parts); None where one is a
    tensor (a ``Mask``) or anything else, whose contents may change between calls."""
    def plain(v):
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, Support):
            key = support_key(v)
            return _NO if key is None else key
        if isinstance(v, (tuple, list)):
            parts = tuple(plain(x) for x in v)
            return _NO if any(p is _NO for p in parts) else (type(v).__name__, parts)
        return _NO

    items = []
    for name, value in sorted(vars(support).items()):
        key = plain(value)
        if key is _NO:
            return None
        items.append((name, key))
    return (type(support).__module__, type(support).__qualname__, tuple(items))


_NO = object()


def classify_once(support: Support, num_children: int, num_parents: int, device=None
                  ) -> SupportBlocks:
    """``classify`` at the default tiles, kept for supports with a ``support_key`` (the newest
    ``KEPT``): a support is a function of the sizes, so its structure is computed once per
    (key, C, P, device) — a recorded plan then holds it as a constant — and each call for one
    without a key (a ``Mask`` among its parts; the dense operator reads those densely)."""
    device = torch.device("cpu") if device is None else torch.device(device)
    key, tiles = support_key(support), (BLOCK_Q, BLOCK_K)  # the tiles as they are now
    if key is None:
        return classify(support, num_children, num_parents, *tiles, device=device)
    key = (key, num_children, num_parents, tiles, str(device))
    with _kept_lock:
        if key in _kept:
            _kept.move_to_end(key)
            return _kept[key]
    if is_recording() or torch.compiler.is_compiling():  # computed in the graph, not kept
        return classify(support, num_children, num_parents, *tiles, device=device)
    with torch.no_grad():
        blocks = classify(support, num_children, num_parents, *tiles, device=device)
    with _kept_lock:
        _kept[key] = blocks
        while len(_kept) > KEPT:
            _kept.popitem(last=False)
    return blocks
