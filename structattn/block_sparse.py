"""Certified block-sparse reading: each block of children reads the key blocks that may hold
posterior mass, wherever they lie, and skips the others with the mass left out certified ≤ ε.

Children and parents are the same N tokens, each child reading j ≤ i, in blocks of L tokens.
The prior's log weight separates as g_i + h_j (``Prior.terms``: ALiBi, a forget gate; h = 0 for
the uniform causal prior), so a child's posterior is softmax_j(h_j + s_ij), s_ij = scale·⟨a_i,
b_j⟩. For child i in block c and an earlier key block β, cut into ``parts`` sub-blocks σ with
H_σ = max_{j∈σ} h_j, n_σ tokens and S_iσ ≥ every s_ij there (``ceilings.key_block_ceilings``,
rounding charged), β's unnormalised mass is at most e^{T_iβ}, T_iβ = log Σ_σ n_σ e^{H_σ + S_iσ}.
Reading a set R of key blocks (always the diagonal c), with I_i the mass read (computed, less
its rounding slack: a lower bound), the mass skipped is

    M_i ≤ B_i = σ(log Σ_{β∉R} e^{T_iβ} − log I_i),

the window's certificate (``structattn.certified``) with one ceiling per key block: a far block
that may matter is read, those between skipped; no prior is needed (causal attention too).

Choice: per child block, its earlier key blocks by decreasing max_{i∈c} T_iβ; read the first m
(m = 0, 1, 2, 3, 4, 5, 7, 9, 12, …) until every B_i ≤ ε, each round scoring the blocks it adds.
A child block of eight or more earlier blocks that would need over ¾ of them reads them all
(bound 0). Every head chooses its own blocks. The reading (``block_sparse_attention``) gathers,
per child block, its key blocks and attends over them and its own, differentiably in a, b, v
and h (O(blocks read·L·d) memory); a head that reads over half its past reads all of it
(``whole_past``), bound 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ._validation import check_size
from .ceilings import RUN_ENTRIES, key_block_ceilings, score_ceiling

__all__ = ["BlockSparse", "block_sparse_attention", "causal_posterior", "certify_blocks"]


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


def _flat(x: torch.Tensor, lead, *tail) -> torch.Tensor:
    """``x`` broadcast to ``(*lead, *tail)`` and flattened to ``(G, *tail)``."""
    return x.expand(*lead, *tail).reshape(-1, *tail)


def _blocks(x: torch.Tensor, nb: int, L: int, fill: float = 0.0) -> torch.Tensor:
    """``(G, N, …)`` → ``(G, nb, L, …)``, padded at the end with ``fill``."""
    pad = nb * L - x.shape[1]
    if pad:
        x = torch.cat([x, x.new_full((x.shape[0], pad, *x.shape[2:]), fill)], 1)
    return x.unflatten(1, (nb, L))


def certify_blocks(a: torch.Tensor, b: torch.Tensor, scale: float, h: torch.Tensor | None,
                   eps: float, *, block: int = 64, parts: int = 4) -> BlockSparse:
    """The key blocks each block of children must read for its posterior mass in the others
    to be certified ≤ ``eps`` (module docstring).

    Args:
        a: ``(*lead, N, k)`` the children's factors (queries).
        b: ``(*lead, N, k)`` the parents' factors (keys) of the same N tokens.
        scale: the scores' factor, s_ij = scale·⟨a_i, b_j⟩.
        h: ``(*lead, N)`` the prior's per-parent log term (broadcasts), or None (uniform).
        eps: in (0, 1).
        block: tokens per block, children and keys alike.
        parts: each key block's bound is the sum of ``parts`` sub-blocks' (where ``block``
            divides so), whose key ranges and prior maxima are tighter.

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
        _, slack = score_ceiling(a.detach().expand(*lead, n, k).reshape(G, n, k),
                                 b.detach().expand(*lead, n, k).reshape(G, n, k), scale)
        slack = _blocks(slack, nb, L).flatten(1)  # (G, nb·L)
        earlier_blocks = torch.arange(nb, device=dev)  # child block c has c earlier blocks
        # a head whose sampled child blocks (every eighth) are nearly all hopeless reads all of
        # its past, uncertified work spared (a guess, not a bound: the bound is then 0)
        whole = torch.zeros(G, dtype=torch.bool, device=dev)
        sample = torch.arange(8, max(nb, 8), 8, device=dev)
        if sample.numel() >= 2:
            plan = _plan(A, B, hh, slack, scale, L, nb, parts, sample)
            whole = _hopeless(plan, eps, sample, L).float().mean(-1) >= 0.9
        keep = (~whole).nonzero().squeeze(-1)
        count = earlier_blocks.expand(G, nb).clone()
        order = earlier_blocks.flip(0).expand(G, nb, nb).clone()
        bound = torch.zeros(G, nb * L, dtype=wide, device=dev)
        if keep.numel():
            c, o, bd = _rounds(A[keep], B[keep], hh[keep], slack[keep], scale, eps, L, nb,
                               parts)
            count[keep], order[keep], bound[keep] = c, o, bd
        bound = bound[:, :n]
        read = torch.zeros(G, nb, nb, dtype=torch.bool, device=dev)
        ranks = torch.arange(nb, device=dev)
        read.scatter_(-1, order, (ranks[None, None, :] < count[..., None]))
        read |= torch.eye(nb, dtype=torch.bool, device=dev)
        earlier_pairs = nb * (nb - 1) / 2
        skipped = 0.0 if earlier_pairs == 0 else 1 - float(count.sum()) / (G * earlier_pairs)
    return BlockSparse(read.reshape(*lead, nb, nb), bound.reshape(*lead, n), float(eps), L,
                       skipped, bool((bound <= eps).all()), order, count)


def _plan(A, B, hh, slack, scale, L, nb, parts, sel) -> dict:
    """For the child blocks ``sel`` (their rows, padded to whole blocks): ``T`` ``(G, R, nb)``
    the log ceilings of each earlier key block (−∞ elsewhere and on padding rows), ``order``
    ``(G, |sel|, nb)`` the key blocks by decreasing max over the block's children, ``tail``
    ``(G, R, nb + 1)`` [m]: log Σ of e^T beyond the first m in that order, ``upto`` the same
    before them, ``log_in`` ``(G, R)`` each child's own block's log mass and ``slack`` its
    rounding (``log_in − slack``: a lower bound); ``Bb``, ``hb``: keys, h in blocks."""
    wide = torch.float64
    G, n, _ = A.shape
    dev = A.device
    rows = (sel[:, None] * L + torch.arange(L, device=dev)).flatten()  # (R,)
    real = rows < n
    Ar = _blocks(A, nb, L).flatten(1, 2)[:, rows]  # (G, R, k), zeros past N
    # each key block's bound as the sum of its sub-blocks' (``parts`` of L / parts tokens:
    # the keys' ranges, and h's maximum, are tighter over fewer tokens)
    sub = L // parts if L % parts == 0 and L >= parts else L
    ns = math.ceil(n / sub)
    ceil = key_block_ceilings(Ar, B, scale, sub)  # (G, R, ns)
    tokens = torch.full((ns,), float(sub), dtype=wide, device=dev)
    tokens[-1] = n - (ns - 1) * sub
    Ts = tokens.log() + _blocks(hh, ns, sub, float("-inf")).amax(-1)[:, None, :] + ceil
    per = L // sub  # sub-blocks per block (the last block may hold fewer)
    Ts = torch.cat([Ts, Ts.new_full((G, rows.numel(), nb * per - ns), float("-inf"))], -1)
    T = Ts.unflatten(-1, (nb, per)).logsumexp(-1)  # (G, R, nb)
    row_block = sel.repeat_interleave(L)  # (R,)
    earlier = (torch.arange(nb, device=dev)[None, :] < row_block[:, None]) & real[:, None]
    T = T.masked_fill(~earlier, float("-inf"))
    # per child block, the earlier key blocks by their largest term (ties: nearest first)
    Tc = T.unflatten(1, (sel.numel(), L)).amax(2)  # (G, |sel|, nb)
    order = nb - 1 - Tc.flip(-1).sort(dim=-1, descending=True, stable=True).indices
    To = T.gather(-1, order.repeat_interleave(L, dim=1))  # (G, R, nb), in that order
    none = To.new_full((G, rows.numel(), 1), float("-inf"))
    tail = torch.cat([To.flip(-1).logcumsumexp(-1).flip(-1), none], -1)
    upto = torch.cat([none, To.logcumsumexp(-1)], -1)
    # the diagonal block, read by every child block: its exact log mass
    Bb, hb = _blocks(B, nb, L), _blocks(hh, nb, L, float("-inf"))
    s = (Ar.unflatten(1, (sel.numel(), L)) @ Bb[:, sel].transpose(-1, -2)).to(wide) * scale
    s = s + hb[:, sel, None, :]  # (G, |sel|, L, L)
    r = torch.arange(L, device=dev)
    log_in = s.masked_fill(r[None, :] > r[:, None], float("-inf")).logsumexp(-1).flatten(1)
    return {"T": T, "order": order, "tail": tail, "upto": upto, "log_in": log_in,
            "slack": slack[:, rows], "Bb": Bb, "hb": hb}


def _rounds(A, B, hh, slack, scale, eps, L, nb, parts):
    """``(count (G, nc), order (G, nc, nb), bound (G, nb·L))``: every child block's key
    blocks read in the rounds m = 0, 1, 2, 3, 4, 5, 7, … (module docstring)."""
    wide = torch.float64
    G, n, _ = A.shape
    dev = A.device
    sel = torch.arange(nb, device=dev)
    plan = _plan(A, B, hh, slack, scale, L, nb, parts, sel)
    order, tail, log_in, slack = plan["order"], plan["tail"], plan["log_in"], plan["slack"]
    Ab, Bb, hb = _blocks(A, nb, L), plan["Bb"], plan["hb"]  # (G, nb, L, ·)
    earlier_blocks = sel  # child block c has c earlier blocks
    # a child block that could not certify reading ¾ of its earlier blocks even if each held
    # its ceiling's mass reads all of them, unscored: "whole" (bound 0)
    hopeless = _hopeless(plan, eps, sel, L)  # (G, nc)
    count = torch.where(hopeless, earlier_blocks, 0)
    done = hopeless.clone()
    bound = torch.zeros(G, nb * L, dtype=wide, device=dev)
    child_block = sel.repeat_interleave(L)
    m_prev, m = 0, 0
    while True:
        if m > m_prev:
            log_in = _add_blocks(log_in, Ab, Bb, hb, order, ~done, m_prev, m, scale, L)
        bd = torch.sigmoid(tail[..., min(m, nb)] - (log_in - slack))  # (G, nb·L)
        ok = (bd <= eps).view(G, nb, L).all(-1)  # (G, nc)
        new = ok & ~done
        count = torch.where(new, min(m, nb), count)
        bound = torch.where(new[:, child_block], bd, bound)
        done |= ok
        # past ¾ of eight or more earlier blocks: read them all, bound 0
        late = ~done & (4 * min(m, nb) > 3 * earlier_blocks) & (earlier_blocks >= 8)
        count = torch.where(late, earlier_blocks, count)
        done |= late
        if bool(done.all()) or m >= nb:
            break
        m_prev, m = m, max(m + 1, math.ceil(1.25 * m))
    return torch.minimum(count, earlier_blocks), order, bound


def _hopeless(plan: dict, eps: float, sel: torch.Tensor, L: int) -> torch.Tensor:
    """``(G, |sel|)`` bool: the child blocks ``sel`` (of eight earlier blocks or more) whose
    bound stays above ``eps`` after reading ¾ of their earlier blocks even if every block read
    held its ceiling's mass (the most I_i could grow by)."""
    G = plan["T"].shape[0]
    m = (sel * 3 // 4).repeat_interleave(L)[None, :, None].expand(G, -1, 1)  # (G, R, 1)
    best = torch.logaddexp(plan["log_in"] - plan["slack"],
                           plan["upto"].gather(-1, m).squeeze(-1))
    bd = torch.sigmoid(plan["tail"].gather(-1, m).squeeze(-1) - best)  # (G, R)
    return ~(bd <= eps).view(G, sel.numel(), L).all(-1) & (sel >= 8)


def _add_blocks(log_in, Ab, Bb, hb, order, pending, m_prev, m, scale, L):
    """``log_in`` ``(G, nb·L)`` with the key blocks of ranks m_prev … m − 1 added, for the
    pending (g, child block) pairs: their log mass, in runs of ``RUN_ENTRIES`` scores."""
    wide = torch.float64
    G, nb = pending.shape
    g_idx, c_idx = pending.nonzero(as_tuple=True)
    width = min(m, nb) - m_prev
    if width <= 0 or g_idx.numel() == 0:
        return log_in
    out = log_in.view(G, nb, L).clone()
    step = max(1, RUN_ENTRIES // (L * L * width))
    for lo in range(0, g_idx.numel(), step):
        g, c = g_idx[lo:lo + step], c_idx[lo:lo + step]
        beta = order[g, c, m_prev:m_prev + width]  # (p, width)
        allowed = beta < c[:, None]  # only earlier blocks: later ranks may be past them
        keys = Bb[g[:, None], beta].flatten(1, 2)  # (p, width·L, k)
        s = (Ab[g, c] @ keys.transpose(-1, -2)).to(wide) * scale  # (p, L, width·L)
        s = s + hb[g[:, None], beta].flatten(1, 2)[:, None, :]
        s = s.masked_fill(~allowed.repeat_interleave(L, -1)[:, None, :], float("-inf"))
        out[g, c] = torch.logaddexp(out[g, c], s.logsumexp(-1))
    return out.flatten(1)


def block_sparse_attention(a: torch.Tensor, b: torch.Tensor, v: torch.Tensor, scale: float,
                           h: torch.Tensor | None, eps: float, *, block: int = 64,
                           whole_past: Callable | None = None
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

    Returns:
        ``(out, report)``: ``out`` ``(*lead, N, d)``, child i's posterior expectation of v
            over the blocks read (renormalised there; at most 2·eps·max‖v_j‖ from the exact one),
            differentiable in a, b, v and h; ``report`` the ``BlockSparse`` choice.

    The child blocks are read in groups of the same number of key blocks, each group in runs
    of at most ``RUN_ENTRIES`` scores: the scores never exceed what the blocks read hold.
    """
    cert = certify_blocks(a, b, scale, h, eps, block=block)
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
    if bool(whole.any()):
        w = rows[whole]
        reader = _whole_past if whole_past is None else whole_past
        parts.append(reader(A[w], B[w], V[w], scale, hh[w]).to(v.dtype))
        which.append(w)
        cert.count[w] = torch.arange(nb, device=dev)
        read = cert.read.view(G, nb, nb)
        read[w] = torch.ones(nb, nb, dtype=torch.bool, device=dev).tril()
        cert.bound.view(G, n)[w] = 0.0
        cert.skipped = 1 - float(cert.count.sum()) / (G * earlier) if earlier else 0.0
    if not bool(whole.all()):
        s = rows[~whole]
        parts.append(_sparse(A[s], B[s], V[s], hh[s], cert.order[s], cert.count[s], scale, n,
                             L, work).to(v.dtype))
        which.append(s)
    out = torch.cat(parts)[torch.cat(which).argsort()]  # (G, N, d)
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
