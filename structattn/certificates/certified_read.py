"""Certified truncation read from the band kernel's own log-sums: a band per head certified
without scoring the band a second time.

Under a log prior g_i + h_j over j ≤ i (FoX, ALiBi) the posterior mass of child i beyond a
window W is M_i(W) = O/(I + O) with I = e^{g_i} Σ_{i−W ≤ j ≤ i} e^{s_ij + h_j} and O the same
sum over j < i − W; g_i cancels, and with S_i(W) ≥ every score beyond W (Cauchy–Schwarz with
the longest key farther back, ``structattn.certificates.certified``),

    M_i(W) ≤ B_i(W) = σ(log Σ_{j < i−W} e^{h_j} + S_i(W) − log Σ_{i−W ≤ j ≤ i} e^{s_ij + h_j}).

The last term is the key-bias kernel's ``lse`` at width W: reading a head's band gives its
certificate's evidence, less the rounding of the kernel's sums (``read_slack``). So the
window is chosen by reading: every head first reads the narrowest width of the doubling
sequence from ``start`` that the best scores could certify (a narrower reading could not); a
head whose children are all certified keeps that reading. The others take, from that
evidence (I grows with W, so it bounds every wider window's), the first width of the
doubling sequence it certifies, and read the width below it first where the best scores
could certify it (and, as ``certify``'s, where that band is no wider than an eighth of the
sequence): kept if its own evidence certifies it, else the wider one is read. A head that no
width below all of its past could certify, even at the best scores, reads all of it (bound
0); where no head could, they read it at once through ``whole_past`` (the exact layer's
reading). At most three readings: certifying costs little next to reading, where ``certify``
scored the band in float64 before the reading read it again. The same reading serves the
CPU, through the compiled band kernel (``read``). The prior is the one the kernel reads (h
as given), as the block-sparse certificate's. The ceiling is the longest key's alone, not
``certify``'s per-block ceilings as well: where only those certify a width (keys clustered
away from the queries), the band read here is wider than ``certify``'s.
"""

from __future__ import annotations

import torch

from ..operators import band
from .ceilings import RUN_ENTRIES, ceiling_from_norms, norm64
from .certified import CertifiedWindow, all_of_the_past, skipped_pairs, tail_bound
from .sampled import sampled_widths


def read_slack(lse: torch.Tensor, reach: torch.Tensor, width: int, computed: torch.dtype,
               block: int = 128) -> torch.Tensor:
    """How far below the exact log-sum the kernel's ``lse`` may be, besides the scores' own
    rounding (``score_ceiling``'s slack), ``lse``'s shape, float64. The kernel adds scale·s
    and h in ``computed`` (unit u; each logit off by ≤ 2u·``reach``, ``reach`` ≥ |s| + |h|
    on the row), takes e^{x} with |x| ≤ 2·reach (relative error u·|x| from its argument, and
    2⁻²² for a GPU's approximate exp), sums ≤ width + 2·block terms (γ) with a rescale per
    block of at least 16 parents (the rescales' arguments add up to the rise of the running
    maximum, ≤ 2·reach; each one's approximate exp 2⁻²² more), and takes a log (u·|lse| and
    2⁻²²). Charged generously: 4u·reach + 2(width + 3·block)·u + 2u·|lse|, and in float32
    (width + 3·block)·2⁻²⁰ + 2⁻¹⁸ for the approximations."""
    u = torch.finfo(computed).eps / 2
    terms = width + 3 * block
    rounding = terms * 2 ** -20 + 2 ** -18 if computed != torch.float64 else 0.0
    return 4 * u * reach + 2 * terms * u + 2 * u * lse.abs().to(torch.float64) + rounding


class _Reader:
    """One family's rows ``G`` as the key-bias kernel reads them, and what their certificate
    needs per child (float64): the score ceiling's parts, the prior's tail beyond each
    width and each child's |s| + |h| reach."""

    def __init__(self, a, b, u, h, scale, products, read, lead, dtype):
        # a, b, u ``(*lead', n, ·)`` and h ``(*lead', n)`` as given (broadcasting to ``lead``):
        # the statistics come from them, ``(G, n)`` each; the rows ``(G, n, ·)`` are made
        # only when a band is read (``rows``), a copy where the heads are a strided view
        self.forward, self.src, self.lead, self.dtype = read, (a, b, u, h), lead, dtype
        n = a.shape[-2]
        G = 1
        for size in lead:
            G *= size
        self.scale, self.n, self.G = scale, n, G
        wide = torch.float64

        def per_child(x):  # (*lead', n) → (G, n)
            return x.expand(*lead, n).reshape(G, n)

        with torch.no_grad():
            a_norm, b_norm = norm64(a), norm64(b)
            high, slack = ceiling_from_norms(a_norm, b_norm, scale, a.shape[-1], products)
            self.high, self.slack = per_child(high), per_child(slack)
            self.a_norm = per_child(a_norm * abs(scale))
            self.b_run = per_child(b_norm.cummax(-1).values)
            hh = per_child(h.detach().to(wide))
            self.behind = torch.logcumsumexp(hh, -1)  # [k]: log Σ_{j ≤ k} e^{h_j}
            self.reach = self.high + hh.abs().cummax(-1).values  # ≥ |s_ij| + |h_j|, j ≤ i
            self.pos = torch.arange(n, device=a.device)
        self.computed = torch.float64 if dtype == torch.float64 else torch.float32
        self._rows = None

    @property
    def rows(self):
        """``(a, b, u, h)`` as rows ``(G, n, ·)`` (h ``(G, n)``, float32 at least)."""
        if self._rows is None:
            a, b, u, h = self.src
            flat = [x.expand(*self.lead, *x.shape[-2:]).reshape(-1, *x.shape[-2:])
                    .to(self.dtype) for x in (a, b, u)]
            hh = h.to(torch.promote_types(self.dtype, torch.float32)).expand(
                *self.lead, self.n).reshape(-1, self.n)
            self._rows = (*flat, hh)
        return self._rows

    def read(self, rows: torch.Tensor, width: torch.Tensor):
        """The band reading of ``rows`` ``(R,)``, each ``width`` ``(R,)`` back: ``(out (R, n,
        d_v), lse (R, n))``."""
        whole = rows.numel() == self.G and bool((rows == torch.arange(
            self.G, device=rows.device)).all())
        a, b, u, h = self.rows if whole else (t[rows] for t in self.rows)
        return self.forward(a, b, u, h, self.scale, width)

    def bound(self, rows, width, log_in):
        """B_i(width) ``(…, R, n)`` for ``rows`` ``(R,)`` at ``width`` ``(…, R)`` (several
        widths at once along the leading dims) from the evidence ``log_in`` ``(R, n)`` (a
        lower bound of log Σ_{window} e^{s + h}); 0 where the width holds the child's whole
        past."""
        w = width[..., None]
        far = self.pos - w - 1  # the nearest parent beyond the window, (…, R, n)
        at = far.clamp(min=0)
        behind, run = (t[rows].expand(*at.shape) for t in (self.behind, self.b_run))
        tail = behind.gather(-1, at).masked_fill(far < 0, float("-inf"))
        ceiling = self.a_norm[rows] * run.gather(-1, at) + self.slack[rows]
        out = tail_bound(log_in, tail, ceiling)
        return torch.where(self.pos <= w, torch.zeros_like(out), out)

    def certifies(self, rows, widths, log_in, eps):
        """``(len(widths), R)`` bool: whether the evidence ``log_in`` ``(R, n)`` certifies
        every child of each row at each of ``widths`` ``(W,)``; several widths per pass, at
        most ``RUN_ENTRIES`` entries at once."""
        step = max(1, RUN_ENTRIES // max(1, rows.numel() * self.n))
        return torch.cat([(self.bound(rows, w[:, None].expand(-1, rows.numel()), log_in)
                           <= eps).all(-1) for w in widths.split(step)])

    def evidence(self, rows, width, lse):
        """log I at ``width`` from the kernel's ``lse``, less its rounding: a lower bound."""
        lse = lse.detach().to(torch.float64)
        slack = read_slack(lse, self.reach[rows], int(width.max()), self.computed)
        return lse - self.slack[rows] - slack


def _triton_rows(a, b, u, h, scale: float, width: torch.Tensor):
    """The Triton key-bias kernel's band reading of rows: ``(out, lse)``."""
    from ..triton_kernels.key_bias import forward

    return forward(a, b, u, h, scale, True, width.to(torch.int32))


def certified_band_attention(a, b, u, scale: float, h, eps: float, *, start: int = 16,
                             block: int = 64, widest: int | None = None, read=None,
                             whole_past=None, pays=None, reject=None):
    """``(out, CertifiedWindow)``: each head's band certified ≤ ``eps`` and read through the
    key-bias kernel, its certificate from the readings' own log-sums (module docstring).

    Args:
        a, b: ``(*lead, N, k)`` the children's and parents' factors (the same N tokens);
            u: ``(*lead, N, d_v)`` values (the leading dims broadcast; the last is the heads).
        scale: a float, the scores' factor.
        h: ``(*lead, N)`` the prior's per-parent term, float32 at least (broadcasts).
        eps: the posterior mass each child may leave out, in (0, 1).
        start: the doubling sequence's first width. Default 16.
        block: the band's block of children (``certify``'s: the eighth-of-the-sequence rule
            measures its band). Default 64.
        widest: the widest band; beyond it, all of the past. None (default): N − 1.
        read: ``(a, b, u, h, scale, width) → (out, lse)`` for rows ``(G, n, ·)`` each read
            ``width`` ``(G,)`` back, ``lse`` each child's log-sum over its band (the CPU's
            compiled kernels: ``structattn.kinds.key_bias.band_rows``); None (default): the
            Triton kernel, its products in TF32 where float32 runs so.
        whole_past: ``(a, b, u, h, scale) → out`` on the factors as given, how every head
            reads all of its past where no band could be certified (the exact layer's own
            reading); None (default): ``read`` at the full width.
        pays: ``(first (G,), n, k) → bool``, whether reading each row first at ``first``
            (the narrowest width the best scores could certify; n − 1: all of its past) is
            expected to cost less than reading every row's whole past: where not, they are
            read so at once, bound 0 (the device's cost model); None (default): always.
        reject: ``(a, b, h, scale, lead, widths, eps) → bool``, True where the sizes or a
            cheaper test than the sample show that no band could pay (the whole past is then
            read before any sample is taken); None (default): no such test.

    Returns ``out`` ``(*lead, N, d_v)`` in u's dtype, differentiable in a, b, u, h, and the
    choice (``heads``: each head's width; ``bound``: each child's at it)."""
    lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2], u.shape[:-2], h.shape[:-1])
    n, d_v, k = a.shape[-2], u.shape[-1], a.shape[-1]
    dtype = torch.promote_types(torch.promote_types(a.dtype, b.dtype), u.dtype)
    last = n - 1
    widths = widths_from(last, start, widest)
    wt = torch.tensor(widths, device=a.device)
    sampled = None
    if pays is not None and len(widths) > 1:  # the cost model's cheapest evidence first: a
        # sample of children's exact tails (no statistics of every child computed yet)
        if reject is not None and reject(a, b, h, float(scale), lead, widths, eps):
            return _whole_past_read(a, b, u, h, scale, lead, n, d_v, eps, whole_past)
        sampled = sampled_widths(a, b, h, float(scale), lead, wt, eps)
        if not pays(sampled, n, k):
            return _whole_past_read(a, b, u, h, scale, lead, n, d_v, eps, whole_past)
    products = _products(dtype, k) if read is None else dtype
    r = _Reader(a, b, u, h, float(scale), products, _triton_rows if read is None else read,
                lead, dtype)
    G, dev = r.G, a.device
    every = torch.arange(G, device=dev)
    with torch.no_grad():
        best = r.behind + r.high  # I ≤ e^{best}
        # the bound at the best scores falls with the width: where the widest band below all
        # of the past could not be certified, no band could (the cheapest bound, O(G·N))
        none = len(widths) == 1 or not bool(r.certifies(every, wt[-2:-1], best, eps).any())
        possible = None if none else r.certifies(every, wt, best, eps)  # (len(widths), G):
        # whether the best scores inside could certify each width
    if none:  # (read with gradients, outside no_grad)
        return _whole(r, every, last, lead, n, d_v, u.dtype, eps, whole_past)
    hopeless = ~possible[:-1].any(0)
    # (G,): each row's first reading, at the narrowest width the best scores could certify
    # and the sampled children's tails allow (a narrower reading could not certify it: its
    # cost would be spent for nothing)
    own = torch.where(hopeless, last, wt[possible.int().argmax(0)])
    if sampled is not None:
        own = torch.maximum(own, sampled)
    if pays is not None and not pays(own, n, k):
        return _whole(r, every, last, lead, n, d_v, u.dtype, eps, whole_past)
    pieces, own, bounds, window = _read_all(r, own, wt, possible, widths, eps, block,
                                            whole_past)
    idx = torch.cat([p[0] for p in pieces])
    out = torch.cat([p[1] for p in pieces])[idx.argsort()]
    window = torch.where(window < 0, own[:, None], window)
    choice = per_head_choice(own.reshape(lead), bounds.reshape(*lead, n),
                             window.reshape(*lead, n), eps)
    return out.reshape(*lead, n, d_v).to(u.dtype), choice


def per_head_choice(heads: torch.Tensor, bound: torch.Tensor, window: torch.Tensor,
                    eps: float) -> CertifiedWindow:
    """The ``CertifiedWindow`` of a band per head: each head's width ``heads`` ``(*lead)``,
    each child's ``bound`` and smallest certifying width ``window`` ``(*lead, N)``."""
    n = bound.shape[-1]
    own = heads.reshape(-1)
    return CertifiedWindow(int(own.max()), bound, window, float(eps),
                           sum(skipped_pairs(n, w) for w in own.tolist()) / own.numel(),
                           bool((bound <= eps).all()), heads)


def _read_all(r, own, wt, possible, widths, eps, block, whole_past):
    """Every row read: those with a band first at ``own`` (then again, ``_read_again``),
    those that read all of their past together at the end (through ``whole_past`` where all
    do). Returns ``(pieces, own, bounds, window)``: the ``(rows, out)`` read, each row's
    width, each child's bound and the smallest width certifying it (−1: none below
    ``own``)."""
    G, n, dev, last = r.G, r.n, own.device, r.n - 1
    d_v = r.src[2].shape[-1]
    bounds = torch.zeros(G, n, dtype=torch.float64, device=dev)
    window = torch.full((G, n), -1, dtype=torch.long, device=dev)
    pieces = []
    banded = (own < last).nonzero()[:, 0]  # the rows read all of their past: once, at the end
    if banded.numel():
        out, lse = r.read(banded, own[banded])
        with torch.no_grad():
            bd = r.bound(banded, own[banded], r.evidence(banded, own[banded], lse))
            window[banded] = torch.where(bd <= eps, own[banded, None], -1)
            bounds[banded] = bd
            done = (bd <= eps).all(-1)
        pieces.append((banded[done], out[done]))
        rest = banded[~done]
        if rest.numel():
            eighth = torch.tensor([8 * band.BandLayout.for_window(n, w, block).width <= n
                                   for w in widths], device=dev)
            own = own.clone()
            again = _read_again(r, rest, own, lse[~done], wt, possible, eighth, eps,
                                window, bounds, pieces, last,
                                whole_past is not None and r.forward is not _triton_rows)
            if again is None:  # most rows read all of their past (the CPU): all of them
                own[:] = last  # do, in one balanced call (the exact layer's own reading)
                pieces.clear()
            else:
                own[rest] = again
    whole = (own >= last).nonzero()[:, 0]  # every row that reads all of its past, at once
    if whole.numel():
        out = whole_past(*r.src, r.scale).reshape(G, n, d_v) if whole.numel() == G and \
            whole_past is not None else r.read(whole, own[whole])[0]  # (the exact layer's)
        bounds[whole] = 0.0
        pieces.append((whole, out))
    return pieces, own, bounds, window


def _whole(r, every, last: int, lead, n: int, d_v: int, dtype, eps: float, whole_past):
    """Every row read over all of its past (no band could be certified): one reading —
    ``whole_past`` on the factors as given, where there is one — each bound 0."""
    if whole_past is not None:
        return _whole_past_read(*r.src, r.scale, lead, n, d_v, eps, whole_past)
    out, _ = r.read(every, torch.full_like(every, last))
    return (out.reshape(*lead, n, d_v).to(dtype),
            all_of_the_past(lead, n, eps, every.device, per_lead=True))


def _whole_past_read(a, b, u, h, scale, lead, n: int, d_v: int, eps: float, whole_past):
    """``_whole`` before any statistics: ``whole_past`` on the factors as given, bound 0."""
    out = whole_past(a, b, u, h, float(scale))
    return (out.reshape(*lead, n, d_v).to(u.dtype),
            all_of_the_past(lead, n, eps, a.device, per_lead=True))


def widths_from(last: int, start: int, widest: int | None) -> list[int]:
    """The doubling sequence of widths from ``start`` to ``last`` (all of the past), those
    beyond ``widest`` left out."""
    widths = [max(1, min(start, last))]
    while widths[-1] < last:
        widths.append(min(2 * widths[-1], last))
    if widest is not None:
        widths = [w for w in widths[:-1] if w <= widest] + [last]
    return widths


def _read_again(r, rest, own, lse, wt, possible, eighth, eps, window, bounds, pieces, last,
                all_or_none=False):
    """The rows ``rest`` the first reading did not certify (``lse``: their log-sums), read at
    the first width that reading's evidence certifies (the width below it first, where
    ``certify``'s rules would try it: it could certify, its band is at most an eighth of
    the sequence, and it is wider than the one read), then at that width where the one
    below fails. A row whose width is all of its past (``last``) is not read here: the
    caller reads those rows together. Writes their ``window`` and ``bounds`` rows, appends
    ``(rows, out)`` to ``pieces``, and returns the width each row is read at ``(R,)``; with
    ``all_or_none`` (the CPU, whose kernels parallelise over rows), None (nothing read)
    where most rows would read all of their past: every row then does, at once."""
    with torch.no_grad():  # the first width the start's evidence certifies, per row
        log_in = r.evidence(rest, own[rest], lse)
        ok = r.certifies(rest, wt, log_in, eps)
        ok[-1] = True  # (len(widths), R); all of the past: bound 0
        k = ok.int().argmax(0)  # (R,)
        target = wt[k]
        below = wt[(k - 1).clamp(min=0)]
        tries = ((k > 1) & possible[(k - 1).clamp(min=0), rest] & eighth[(k - 1).clamp(min=0)]
                 & (below > own[rest]))  # (a width read already failed: not read again)
        first = torch.where(tries, below, target)
        whole = int((own >= last).sum()) + int((target >= last).sum())
    if all_or_none and 2 * whole > r.G:  # (the rows read apart use the cores unevenly)
        return None
    now = (first < last).nonzero()[:, 0]  # (the others read all of their past, later)
    good = torch.ones_like(tries)
    if now.numel():
        rows = rest[now]
        out2, lse2 = r.read(rows, first[now])
        with torch.no_grad():  # (the start's evidence bounds every wider window's too)
            bd2 = torch.minimum(r.bound(rows, first[now], r.evidence(rows, first[now], lse2)),
                                r.bound(rows, first[now], log_in[now]))
            good[now] = (bd2 <= eps).all(-1) | ~tries[now]  # a target read is certified
            window[rows] = torch.where((window[rows] < 0) & (bd2 <= eps), first[now, None],
                                       window[rows])
            bounds[rows] = bd2
        pieces.append((rows[good[now]], out2[good[now]]))
    again = (~good & (target < last)).nonzero()[:, 0]
    if again.numel():
        rows = rest[again]
        out3, lse3 = r.read(rows, target[again])
        with torch.no_grad():
            bd3 = torch.minimum(
                r.bound(rows, target[again], r.evidence(rows, target[again], lse3)),
                r.bound(rows, target[again], log_in[again]))
            window[rows] = torch.where(window[rows] < 0, target[again][:, None], window[rows])
            bounds[rows] = bd3
        pieces.append((rows, out3))
    return torch.where(good, first, target)


def _products(dtype: torch.dtype, k: int) -> torch.dtype:
    """The dtype whose unit bounds the kernel's products' rounding (``score_ceiling``'s γ_k):
    the factors' own; float32 products on TF32 (``_tiles.settings``) round each factor to 10
    bits, float16's unit u, a product off by 2u: γ_k(u) ≥ 2u from k = 3 (below, bfloat16's)."""
    from ..triton_kernels._tiles import settings

    if dtype == torch.float32 and settings(dtype, 16)["PRECISION"] == "tf32":
        return torch.float16 if k >= 3 else torch.bfloat16
    return dtype
