"""Certified block-sparse reading: each block of children reads the key blocks that may hold
posterior mass, wherever they lie, and skips the others with the mass left out certified ≤ ε.

Children and parents are the same N tokens, each child reading j ≤ i, in blocks of L tokens.
The prior's log weight separates as g_i + h_j (``Prior.terms``: ALiBi, a forget gate; h = 0 for
the uniform causal prior), so a child's posterior is softmax_j(h_j + s_ij), s_ij = scale·⟨a_i,
b_j⟩. For child i in block c and an earlier key block β, U_iβ ≥ log Σ_{j∈β} e^{h_j + s_ij}: the
block's ceiling, or, where it is scored, its computed log mass with the rounding charged
(``structattn.certificates.block_choice``). Reading a set R of key blocks (always the diagonal c), with I_i
a lower bound on the mass read (the blocks scored in R and the diagonal, computed, less their
rounding), the mass skipped is

    M_i ≤ B_i = σ(log Σ_{β∉R} e^{U_iβ} − log I_i),

the window's certificate (``structattn.certificates.certified``) with one bound per key block: a far block
that may matter is read, those between skipped; no prior is needed (causal attention too).

Choice (``block_choice.choose_blocks``): per child block, its earlier key blocks are ranked by
their ceilings, those that may matter scored exactly (no gradient), and the fewest kept, by
decreasing mass, for which every B_i ≤ ε. A head whose sampled child blocks skip under
``WORTH`` of their past reads all of it (bound 0). Every head chooses its own blocks. The
reading (``block_sparse_attention``) gathers, per child block, its key blocks and attends over
them and its own, differentiably in a, b, v and h (O(blocks read·L·d) memory); a head that
reads over half its past reads all of it (``whole_past``), bound 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .certificates.block_choice import block_ceilings, choose_blocks, scores_needed, skipped_pairs
from .certificates.block_choice import in_blocks as _blocks
from .certificates.ceilings import RUN_ENTRIES, score_ceiling
from .checking._validation import check_size

__all__ = ["BlockSparse", "block_sparse_attention", "causal_posterior", "certify_blocks",
           "read_whole"]

#: the least share of its earlier key blocks a head's sampled child blocks must skip for the
#: head to be certified block by block (below it, it reads all of its past)
WORTH = 1 / 16


@dataclass
class BlockSparse:
    """What ``certify_blocks`` chose: the key blocks each child block reads, with B_i ≤ ε.

    Attributes:
        read (torch.Tensor): ``(*lead, nc, nb)`` bool, the key blocks each block of children
            reads (its own included).
        bound (torch.Tensor): ``(*lead, N)`` float64, each child's certified upper bound on
            its posterior mass in the blocks skipped.
        eps (float): the bound asked for; block (int): the tokens per block.
        skipped (float): the fraction of (child block, earlier key block) pairs skipped.
        certified (bool): every bound ≤ eps.
        order (torch.Tensor | None): ``(G, nc, nb)``, each child block's key blocks in the
            order chosen (G: the flattened leading dims); count (torch.Tensor | None):
            ``(G, nc)``, how many of them it reads.
    """

    read: torch.Tensor
    bound: torch.Tensor
    eps: float
    block: int
    skipped: float
    certified: bool
    order: torch.Tensor | None = field(default=None, repr=False)
    count: torch.Tensor | None = field(default=None, repr=False)


def _check(a, b, eps, block):
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
        raise ValueError(f"certify_blocks: eps (the posterior mass the skipped blocks may hold) "
                         f"must be in (0, 1); got {eps!r}")
    if a.dim() < 2 or b.dim() < 2 or a.shape[-2:] != b.shape[-2:]:
        raise ValueError(f"certify_blocks: a and b must be (…, N, k) factors of the same N "
                         f"tokens; got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape[-2] == 0:
        raise ValueError("certify_blocks: a and b hold no tokens (N = 0)")
    return check_size("certify_blocks", "block", block)


def _whole_heads(a, b, A, B, hh, scale: float, eps: float, L: int, nb: int, lead, worth: float,
                 together: bool, budget: float | None):
    """``(whole, slack)``: the heads ``certify_blocks`` reads whole ``(G,)``, and the scores'
    slack per child ``(G, nb·L)`` where some head is certified (else None)."""
    G, n, k = A.shape
    dev = A.device
    step = max(8, nb // 8)
    sample = torch.arange(step, max(nb, step), step, device=dev)
    whole = torch.zeros(G, dtype=torch.bool, device=dev)
    if sample.numel() >= 2:  # the last sampled block's last child, exactly: what it
        # cannot leave out, its block cannot (no statistic of every child computed)
        whole = _last_child_whole(A, B, hh, scale, eps, L, nb, int(sample[-1]), worth, budget)
        if together and 2 * int(whole.sum()) > G:
            whole[:] = True
    slack = None
    if not bool(whole.all()):
        _, slack = score_ceiling(a.detach().expand(*lead, n, k).reshape(G, n, k),
                                 b.detach().expand(*lead, n, k).reshape(G, n, k), scale)
        slack = _blocks(slack, nb, L).flatten(1)  # (G, nb·L)
    # a head whose sampled child blocks (every eighth, or at most eight evenly spread)
    # skip under WORTH of their earlier blocks reads all of its past, the certificate's
    # work spared (bound 0); the last one first, alone (a fifth of the sample's cost, the
    # most earlier blocks to skip): where it does not skip enough, neither would the rest.
    # With ``together``, where more than half the heads read all of their past, every one
    # does (the kernels parallelise over heads: one sparse head costs them its share)
    for part in ((sample[-1:], sample) if sample.numel() >= 2 and slack is not None
                 else ()):
        open_ = (~whole).nonzero().squeeze(-1)  # the heads still to decide
        c, _, _ = choose_blocks(A[open_], B[open_], hh[open_], slack[open_], scale, eps, L, nb,
                                part)
        whole[open_] = 1 - c.sum(-1) / part.sum() < worth
        if together and 2 * int(whole.sum()) > G:
            whole[:] = True
        if bool(whole.all()):
            break
    return whole, slack


def _last_child_whole(A, B, hh, scale: float, eps: float, L: int, nb: int, c: int,
                      worth: float, budget: float | None) -> torch.Tensor:
    """``(G,)``: the heads whose child block ``c``'s last child alone, by its exact
    posterior, cannot leave out ``worth`` of its ``c`` earlier blocks with mass ≤ ``eps``
    (its lightest blocks first): every child of the block must leave a block out for the
    block to, so neither can the block — ``certify_blocks``' rule reads the head whole.
    With a ``budget``, also the heads where that child's ceilings, against its exact mass,
    leave more than ``budget`` of the ``c`` blocks to score exactly (``scores_needed``): the
    least its block's scoring costs, where ceilings are loose (large, spread scores) as
    much as reading those blocks."""
    i = min((c + 1) * L, B.shape[1]) - 1  # the block's last child
    s = (A[:, i:i + 1, :] @ B[:, :i + 1].transpose(-1, -2)).squeeze(1).double() * scale
    s = s + hh[:, :i + 1]  # (G, i + 1)
    p = torch.softmax(s, -1)
    mass = p[:, :c * L].reshape(p.shape[0], c, L).sum(-1)  # (G, c): each earlier block's
    fits = (mass.sort(-1).values.cumsum(-1) <= eps).sum(-1)  # the most blocks left out
    whole = 1 - (c - fits) / c < worth
    if budget is None or bool(whole.all()):
        return whole
    T = block_ceilings(A[:, i:i + 1], B, _blocks(hh, nb, L, float("-inf")), scale, L)
    return whole | (scores_needed(T[:, 0, :c], s.logsumexp(-1), eps) > budget * c)


def _flat(x: torch.Tensor, lead, *tail) -> torch.Tensor:
    """``x`` broadcast to ``(*lead, *tail)`` and flattened to ``(G, *tail)``."""
    return x.expand(*lead, *tail).reshape(-1, *tail)


def read_whole(a: torch.Tensor, b: torch.Tensor, h: torch.Tensor | None, eps: float, *,
               block: int = 64) -> BlockSparse:
    """The choice that reads every earlier key block (each child's whole past, bound 0), made
    without any certificate work: what ``certify_blocks`` reports for heads read whole, for
    every head.

    Args:
        a: ``(*lead, N, k)`` the children's factors (their shape only).
        b: ``(*lead, N, k)`` the parents' factors (their shape only).
        h: ``(*lead, N)`` the prior's per-parent term, or None (its shape only).
        eps: the bound asked for, in (0, 1).
        block: tokens per block.

    Returns:
        A ``BlockSparse`` of every block read, bound 0, nothing skipped."""
    L = _check(a, b, eps, block)
    n = a.shape[-2]
    L = min(L, n)
    nb = math.ceil(n / L)
    lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2],
                                  () if h is None else h.shape[:-1])
    G, dev = math.prod(lead), a.device
    earlier = torch.arange(nb, device=dev)
    order = ((earlier[:, None] - 1 - earlier) % nb).expand(G, nb, nb).clone()  # nearest first
    read = torch.ones(nb, nb, dtype=torch.bool, device=dev).tril().expand(*lead, nb, nb)
    return BlockSparse(read.clone(), torch.zeros(*lead, n, dtype=torch.float64, device=dev),
                       float(eps), L, 0.0, True, order, earlier.expand(G, nb).clone())


def certify_blocks(a: torch.Tensor, b: torch.Tensor, scale: float, h: torch.Tensor | None,
                   eps: float, *, block: int = 64, worth: float = WORTH,
                   together: bool = False, budget: float | None = None) -> BlockSparse:
    """The key blocks each block of children must read for its posterior mass in the others
    to be certified ≤ ``eps`` (module docstring).

    Args:
        a: ``(*lead, N, k)`` the children's factors (queries).
        b: ``(*lead, N, k)`` the parents' factors (keys) of the same N tokens.
        scale: the scores' factor, s_ij = scale·⟨a_i, b_j⟩.
        h: ``(*lead, N)`` the prior's per-parent log term (broadcasts), or None (uniform).
        eps: in (0, 1).
        block: tokens per block, children and keys alike.
        worth: the least share of their earlier blocks a head's sampled child blocks must
            skip for the head to be certified block by block; default ``WORTH``.
        together: where more than half the heads would read all of their past, every head
            does (default False: each head as its sample says).
        budget: the largest share of its earlier blocks the last sampled child block's last
            child may leave to score exactly (by its ceilings against its exact mass) for its
            head to be certified block by block; None (default): any share.

    Returns:
        A ``BlockSparse``, with the blocks read in the order chosen (``order``, ``count``).

    Raises:
        ValueError: eps outside (0, 1), a block < 1, factors of different tokens.
    """
    L = _check(a, b, eps, block)
    n, k = a.shape[-2:]
    L = min(L, n)
    nb = math.ceil(n / L)
    wide = torch.float64
    lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2],
                                  () if h is None else h.shape[:-1])
    dev = a.device
    with torch.no_grad():
        low = torch.promote_types(a.dtype, torch.float32)  # the products' precision
        A, B = _flat(a.detach(), lead, n, k).to(low), _flat(b.detach(), lead, n, k).to(low)
        G = A.shape[0]
        hh = (torch.zeros(G, n, dtype=wide, device=dev) if h is None
              else _flat(h.detach().to(wide), lead, n))
        earlier_blocks = torch.arange(nb, device=dev)  # child block c has c earlier blocks
        whole, slack = _whole_heads(a, b, A, B, hh, scale, eps, L, nb, lead, worth, together,
                                    budget)
        keep = (~whole).nonzero().squeeze(-1)
        count = earlier_blocks.expand(G, nb).clone()
        # a head read whole: each child block's earlier blocks, nearest first, then the rest
        order = ((earlier_blocks[:, None] - 1 - earlier_blocks) % nb).expand(G, nb, nb).clone()
        bound = torch.zeros(G, nb * L, dtype=wide, device=dev)
        if keep.numel():
            c, o, bd = choose_blocks(A[keep], B[keep], hh[keep], slack[keep], scale, eps, L,
                                     nb, earlier_blocks)
            count[keep], order[keep], bound[keep] = c, o, bd
        bound = bound[:, :n]
        read = torch.zeros(G, nb, nb, dtype=torch.bool, device=dev)
        ranks = torch.arange(nb, device=dev)
        read.scatter_(-1, order, (ranks[None, None, :] < count[..., None]))
        read |= torch.eye(nb, dtype=torch.bool, device=dev)
    return BlockSparse(read.reshape(*lead, nb, nb), bound.reshape(*lead, n), float(eps), L,
                       skipped_pairs(count, nb), bool((bound <= eps).all()), order, count)


def block_sparse_attention(a: torch.Tensor, b: torch.Tensor, v: torch.Tensor, scale: float,
                           h: torch.Tensor | None, eps: float, *, block: int = 64,
                           whole_past: Callable | None = None, worth: float = WORTH,
                           together: bool = False, budget: float | None = None
                           ) -> tuple[torch.Tensor, BlockSparse]:
    """Causal attention under the log prior g_i + h_j, reading only the key blocks that
    ``certify_blocks`` keeps: each child's posterior mass in the blocks skipped is ≤ ``eps``.

    Args:
        a: ``(*lead, N, k)`` queries; b: ``(*lead, N, k)`` keys; v: ``(*lead, N, d)`` values
            (leading dims broadcast).
        scale: the scores' factor.
        h: ``(*lead, N)`` the prior's per-parent log term (``Prior.terms(N, N, device)[1]``),
            or None for the uniform causal prior.
        eps: the posterior mass each child may leave out, in (0, 1).
        block: tokens per block.
        whole_past: ``(a, b, v, scale, h) → out`` for ``(G, N, ·)`` rows, how a head that
            reads more than half of its past reads all of it (default: causal SDPA without a
            prior, the dense table with one; the layers pass the fused key-bias reading).
        worth: ``certify_blocks``'s.
        together: ``certify_blocks``'s.
        budget: ``certify_blocks``'s.

    Returns:
        ``(out, report)``: ``out`` ``(*lead, N, d)``, child i's posterior expectation of v
            over the blocks read (renormalised there; at most 2·eps·max‖v_j‖ from the exact one),
            differentiable in a, b, v and h; ``report`` the ``BlockSparse`` choice.

    The child blocks are read in groups of the same number of key blocks, each group in runs
    of at most ``RUN_ENTRIES`` scores: the scores never exceed what the blocks read hold.
    """
    cert = certify_blocks(a, b, scale, h, eps, block=block, worth=worth, together=together,
                          budget=budget)
    n, k, d = a.shape[-2], a.shape[-1], v.shape[-1]
    L = cert.block
    nb = math.ceil(n / L)
    lead = cert.bound.shape[:-1]
    dev = a.device
    A, B, V = _flat(a, lead, n, k), _flat(b, lead, n, k), _flat(v, lead, n, d)
    G = A.shape[0]
    work = torch.promote_types(torch.promote_types(A.dtype, B.dtype), torch.float32)
    hh = (torch.zeros(G, n, dtype=work, device=dev) if h is None
          else _flat(h, lead, n).to(work))
    # a row (head) that reads more than half of its past reads all of it, fused: O(N·d)
    earlier = nb * (nb - 1) // 2
    whole = cert.count.sum(-1) * 2 > earlier  # (G,)
    rows = torch.arange(G, device=dev)
    parts, which = [], []
    every = bool(whole.all())  # every row read whole: no rows gathered, no output scattered
    if bool(whole.any()):
        w = rows[whole]
        reader = _whole_past if whole_past is None else whole_past
        picked = (A, B, V, hh) if every else (A[w], B[w], V[w], hh[w])
        parts.append(reader(*picked[:3], scale, picked[3]).to(v.dtype))
        which.append(w)
        cert.count[w] = torch.arange(nb, device=dev)
        read = cert.read.view(G, nb, nb)
        read[w] = torch.ones(nb, nb, dtype=torch.bool, device=dev).tril()
        cert.bound.view(G, n)[w] = 0.0
        cert.skipped = 1 - float(cert.count.sum()) / (G * earlier) if earlier else 0.0
    if not every:
        s = rows[~whole]
        parts.append(_sparse(A[s], B[s], V[s], hh[s], cert.order[s], cert.count[s], scale, n,
                             L, work).to(v.dtype))
        which.append(s)
    out = parts[0] if every else torch.cat(parts)[torch.cat(which).argsort()]  # (G, N, d)
    return out.reshape(*lead, n, d), cert


def _sparse(A, B, V, hh, order, count, scale, n, L, work):
    """``(G, N, d)``: each child block reading its first ``count`` key blocks of ``order``
    and its own, in groups of the same count, each in runs of ``RUN_ENTRIES`` scores."""
    G, d = A.shape[0], V.shape[-1]
    nb = math.ceil(n / L)
    Ab, Bb, Vb = _blocks(A, nb, L), _blocks(B, nb, L), _blocks(V, nb, L)  # (G, nb, L, ·)
    hb = _blocks(hh, nb, L)  # (G, nb, L): padding keys are masked in _read
    count = count.flatten()  # (G·nc,), pair f = g·nb + c
    pieces, which = [], []
    for m in count.unique().tolist():
        pairs = (count == m).nonzero().squeeze(-1)
        step = max(1, RUN_ENTRIES // (L * L * (m + 1)))
        for lo in range(0, pairs.numel(), step):
            f = pairs[lo:lo + step]
            pieces.append(_read(Ab, Bb, Vb, hb, order, f // nb, f % nb, m, scale, n, L, work))
            which.append(f)
    out = torch.cat(pieces)[torch.cat(which).argsort()]  # (G·nc, L, d), pair order
    return out.view(G, nb * L, d)[:, :n]


def _read(Ab, Bb, Vb, hb, order, g, c, m, scale, n, L, work):
    """``(p, L, d)``: the child blocks ``c`` of rows ``g`` reading their first ``m`` key blocks
    of ``order`` and their own block, softmax over the scores plus h, causal in their own."""
    dev = Ab.device
    blocks = torch.cat([order[g, c, :m], c[:, None]], -1)  # (p, m + 1)
    keys = Bb[g[:, None], blocks].flatten(1, 2).to(work)  # (p, (m + 1)·L, k)
    vals = Vb[g[:, None], blocks].flatten(1, 2).to(work)
    s = Ab[g, c].to(work) @ keys.transpose(-1, -2) * scale  # (p, L, (m + 1)·L)
    s = s + hb[g[:, None], blocks].flatten(1, 2)[:, None, :]
    parent = ((blocks * L)[..., None] + torch.arange(L, device=dev)).flatten(1)  # (p, ·)
    child = (c * L)[:, None] + torch.arange(L, device=dev)  # (p, L)
    allowed = (parent[:, None, :] < n) & (parent[:, None, :] <= child[:, :, None])
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1)  # every row has its own
    return p @ vals


def causal_posterior(a, b, scale, h, read=None) -> torch.Tensor:
    """p(φ_i = j) = softmax_j(scale·⟨a_i, b_j⟩ + h_j) over j ≤ i: the dense table (N×N memory).

    Args:
        a (torch.Tensor): the children's factors, ``(…, N, k)``.
        b (torch.Tensor): the parents' factors of the same N tokens, ``(…, N, k)``.
        scale (float): the scores' factor.
        h (torch.Tensor): the prior's per-parent log term, ``(…, N)`` (zeros: uniform).
        read (torch.Tensor | None): ``(…, N, N)`` bool, the only pairs read; None: all j ≤ i.

    Returns:
        torch.Tensor: the posterior, ``(…, N, N)``.
    """
    n = a.shape[-2]
    allowed = torch.ones(n, n, dtype=torch.bool, device=a.device).tril()
    if read is not None:
        allowed = allowed & read
    s = scale * a @ b.transpose(-1, -2) + h.unsqueeze(-2).to(a.dtype)
    return torch.softmax(s.masked_fill(~allowed, float("-inf")), -1)


def _whole_past(a, b, v, scale, h):
    """``(G, N, d)``: causal attention under g_i + h_j over all of the past — without a prior
    (h = 0) causal SDPA (its fused kernel: O(N·d) memory), else the dense table."""
    if not bool(h.any()):
        return torch.nn.functional.scaled_dot_product_attention(
            a[None], b[None], v[None], is_causal=True, scale=scale)[0]
    return causal_posterior(a, b, scale, h) @ v
