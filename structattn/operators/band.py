"""Blocked banded attention: every child i looks back at most ``window`` positions.

Children are cut into blocks of ``B``; block c (children cB … cB + B − 1) can only reach
parents cB − mB … cB + B − 1 with m = ⌈window / B⌉, so its keys are one contiguous slice
of L = (m + 1)·B parents. The slices are strided views of the (front-padded) parents, so
one batched matmul — or one ``scaled_dot_product_attention`` call — does every block:
O(N·L·d) time and O(N·L) memory for a band of scores, never N×N.

Within a block, the distance child − parent is the same ``(B, L)`` table for every block:
``distance[r, s] = mB + r − s`` (``BandLayout.distance``); a parent outside the sequence
(front padding) has ``distance > child position``, so any window ≤ the child's position
excludes it.

Shapes: ``(*lead, N, k)`` node factors → ``(*lead, nb, B, k)`` child blocks and
``(*lead, nb, L, k)`` parent slices; band tensors are ``(*lead, nb, B, L)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class BandLayout:
    """Blocks of ``block`` children over ``n`` positions, each seeing ``m`` blocks back."""

    n: int
    block: int
    m: int

    @staticmethod
    def for_window(n: int, window: int, block: int) -> BandLayout:
        """The layout of a band ``window`` wide over ``n`` children; ``n`` and ``window`` may
        be symbolic (an exported program's sizes and runtime width: no branch on them)."""
        block = block if _symbolic(n) else max(1, min(block, n))  # (a block past n pads)
        return BandLayout(n, block, torch.sym_max(1, -(-window // block)))

    @property
    def num_blocks(self) -> int:
        return -(-self.n // self.block)

    @property
    def width(self) -> int:
        """L: parents in each block's slice."""
        return (self.m + 1) * self.block

    @property
    def reach(self) -> int:
        """The largest distance every child of a block can see: mB."""
        return self.m * self.block

    def distance(self, device) -> torch.Tensor:
        """``(B, L)`` long: child − parent within any block."""
        r = torch.arange(self.block, device=device)[:, None]
        s = torch.arange(self.width, device=device)[None, :]
        return self.m * self.block + r - s

    def child_positions(self, device) -> torch.Tensor:
        """``(nb, B)`` long: each block slot's position (≥ n: padding)."""
        return torch.arange(self.num_blocks * self.block, device=device).view(self.num_blocks,
                                                                              self.block)

    def parent_positions(self, device) -> torch.Tensor:
        """``(nb, L)`` long: each block's parent slots' positions, kB − mB + s (< 0: front
        padding; ≥ n: back padding) — the same for every child row of the block."""
        return self.child_positions(device)[:, :1] - self.distance(device)[:1]

    def within(self, width: int, first: int, device, blocks: slice = slice(None)) -> torch.Tensor:
        """``(nb, B, L)`` bool: the slots of the window first ≤ d ≤ width of each real child
        (position < n), d ≤ its position (blocks ``blocks`` only)."""
        dist = self.distance(device)  # (B, L)
        pos = self.child_positions(device)[blocks, :, None]  # (nb, B, 1)
        return (dist >= first) & (dist <= width) & (dist <= pos) & (pos < self.n)

    def children(self, x: torch.Tensor) -> torch.Tensor:
        """``(*lead, N, k)`` → ``(*lead, nb, B, k)`` (padded with zeros at the end)."""
        pad = self.num_blocks * self.block - self.n
        if _symbolic(pad) or pad:
            x = F.pad(x, (0, 0, 0, pad))
        return x.unflatten(-2, (self.num_blocks, self.block))

    def parents(self, x: torch.Tensor) -> torch.Tensor:
        """``(*lead, N, k)`` → ``(*lead, nb, L, k)``: block c's slice starts mB before it."""
        front, back = self.reach, self.num_blocks * self.block - self.n
        x = F.pad(x, (0, 0, front, back))  # (*lead, (nb + m)·B, k)
        if _symbolic(self.width):  # ``unfold`` takes a plain int: a symbolic width gathers
            slots = self.parent_positions(x.device) + self.reach  # (nb, L) rows of the padded x
            return x[..., slots, :]
        return x.unfold(-2, self.width, self.block).transpose(-1, -2)  # (*lead, nb, L, k)

    def unblock(self, y: torch.Tensor) -> torch.Tensor:
        """``(*lead, nb, B, d)`` → ``(*lead, N, d)``."""
        return y.flatten(-3, -2)[..., :self.n, :]

    def to_dense(self, band: torch.Tensor) -> torch.Tensor:
        """``(*lead, nb, B, L)`` band (zero outside the sequence) → ``(*lead, N, N)``."""
        lead = band.shape[:-3]
        dense = band.new_zeros(*lead, self.num_blocks * self.block,
                               (self.num_blocks + self.m) * self.block)
        pos = self.child_positions(band.device)  # (nb, B)
        cols = (pos[:, :, None] - self.distance(band.device)[None] + self.reach)  # padded col
        rows = pos[:, :, None].expand_as(cols)
        dense[..., rows, cols] = band
        return dense[..., :self.n, self.reach:self.reach + self.n]


def _symbolic(size) -> bool:
    """Whether ``size`` is a ``torch.SymInt`` (traced by ``torch.export``), not a Python int."""
    return isinstance(size, torch.SymInt)


def scores(a: torch.Tensor, b: torch.Tensor, scale: float, layout: BandLayout) -> torch.Tensor:
    """ψ_ij = scale·⟨a_i, b_j⟩ on the band: ``(*lead, nb, B, L)``."""
    return layout.children(a) @ layout.parents(b).transpose(-1, -2) * scale


def apply(weights: torch.Tensor, u: torch.Tensor, layout: BandLayout) -> torch.Tensor:
    """``Σ_j w_ij u_j`` for band weights ``(*lead, nb, B, L)`` and ``u`` ``(*lead, N, d)``."""
    return layout.unblock(weights @ layout.parents(u))


def attend(a, b, u, scale: float, bias: torch.Tensor, layout: BandLayout) -> torch.Tensor:
    """Fused: ``softmax(scale·⟨a_i, b_j⟩ + bias_ij) u`` over the band, through one
    ``scaled_dot_product_attention`` call (no band of probabilities is kept for backward).
    ``bias``: ``(*lead or broadcastable, nb, B, L)`` with −∞ off each child's support; every
    row must have a finite entry. Leading dims are flattened to SDPA's (batch, heads)."""
    qa, kb, vu = layout.children(a), layout.parents(b), layout.parents(u)
    lead = qa.shape[:-3]
    nb, B, L = layout.num_blocks, layout.block, layout.width
    if _symbolic(nb) or _symbolic(L):  # exported: the mask broadcast by SDPA, not reshaped
        # (a reshape of an expanded mask asks whether each symbolic size is 1: a guard)
        out = F.scaled_dot_product_attention(qa, kb, vu, attn_mask=bias, scale=scale)
        return layout.unblock(out).clone(memory_format=torch.contiguous_format)  # (a fresh
        # layout: the slice's strides would make each later reshape ask if a size is 1)
    flat = (-1, nb)
    # (…, nb, B, L) → (X, nb, B, L); one bias for every lead → (1, nb, B, L): the CPU's fused
    # kernel takes a 2-D or 4-D mask only (a 3-D one sends SDPA to its math path)
    bias = bias.expand(*lead, nb, B, L).reshape(*flat, B, L) if bias.dim() > 3 else bias[None]
    out = F.scaled_dot_product_attention(
        qa.reshape(*flat, B, qa.shape[-1]), kb.reshape(*flat, L, kb.shape[-1]),
        vu.reshape(*flat, L, vu.shape[-1]), attn_mask=bias, scale=scale)
    return layout.unblock(out.reshape(*lead, nb, B, vu.shape[-1]))


def flex_attend(a, b, u, scale: float, log_prior, window, first: int = 1, **kwargs):
    """CUDA fast path: FlexAttention with a block mask for ``first ≤ i − j ≤ window_i`` and the log
    prior as a ``score_mod``; ``log_prior(head_or_child_index..., distance)`` as in
    ``windows``. ``a, b, u``: ``(B, H, N, d)``. Only blocks inside the band are computed."""
    from torch.nn.attention.flex_attention import create_block_mask

    n = a.shape[-2]
    per_child = isinstance(window, torch.Tensor)

    def in_band(bi, h, i, j):
        d = i - j
        w = window[bi, h, i] if per_child else window
        return (d >= first) & (d <= w)

    def score_mod(score, bi, h, i, j):
        return score + log_prior(bi, h, i, i - j)

    mask = create_block_mask(in_band, B=a.shape[0] if per_child else None,
                             H=a.shape[1] if per_child else None, Q_LEN=n, KV_LEN=n,
                             device=a.device)
    return _fused_flex_attention()(a, b, u, score_mod=score_mod, block_mask=mask, scale=scale,
                                   **kwargs)


_FUSED: dict = {}


def _fused_flex_attention():
    """``flex_attention`` fused by ``torch.compile`` (called eagerly it computes and keeps the
    whole N×N score matrix, and warns so); inside a graph dynamo is compiling, the function
    itself. A plan cannot be recorded through it (``structattn.compiling.replay`` would replay the
    unfused operator): such a call is read each time."""
    from torch.nn.attention.flex_attention import flex_attention

    from ..checking._validation import is_exporting, is_recording

    if torch.compiler.is_compiling() or is_exporting():  # fused by the compiler that reads it
        return flex_attention
    if is_recording():
        raise RuntimeError("FlexAttention runs fused through torch.compile, not in a plan")
    if "fn" not in _FUSED:
        _FUSED["fn"] = torch.compile(flex_attention, dynamic=False)
    return _FUSED["fn"]
