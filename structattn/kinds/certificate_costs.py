"""The CPU's cost rules for certified readings: where a certificate's own work and the
readings it leads to are not expected to cost less than reading each child's whole past
through the fused kernel, the window operator (``kinds/window.py``) reads the whole past at
once, bound 0 — the certificate steps aside. Each rule takes the narrowest width a reading
could certify: from the sizes and the last child's exact tail (``band_rejected``), from the
best scores, or from a sample of children's exact evidence (``certificates.sampled``), the
cheapest evidence first. The constants were measured on
a 2-core AVX2 host (``benchmarks/bench_certificates.py``); elsewhere (CUDA) the certificates always run."""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch

from ..block_sparse import WORTH
from ..certificates.certified_read import widths_from
from ..certificates.sampled import last_child_widths, sampled_widths
from . import distance_table

_SET_ASIDE = [0]  # how many ``set_aside`` blocks are open


@contextmanager
def set_aside():
    """Within it, the certificates run wherever they apply, whatever they cost: to measure
    what they certify (``gallery/lm_probes.py``), not to read fast."""
    _SET_ASIDE[0] += 1
    try:
        yield
    finally:
        _SET_ASIDE[0] -= 1


def _band_cost(widths: list, n: int, k: int, rows: int) -> float:
    """``band_pays``' expected cost of reading each row first at its width in ``widths``
    (``n − 1``: all of its past), as a share of every row's whole past, the certificate's
    own work included."""
    last = n - 1
    shares = [1.0 if w >= last else _share(w, n) + 0.25 * _share(2 * w, n) for w in widths]
    return sum(shares) / len(shares) + 0.2 * (2048 / n) ** 2 * (64 / k) * 4 / rows + 0.03


def _share(width: float, n: int) -> float:
    """A band of ``width`` read per head on the CPU as a share of the whole past:
    1.1·p((w + 150)/N), p(x) = 2x − x² (its pairs, the kernel's tiles at its edges included;
    the band and distance-table kernels alike, ``bench_certificates.py``)."""
    x = min(1.0, (width + 150) / n)
    return 1.1 * (2 * x - x * x)


def band_rejected(a, b, h, scale: float, lead, widths: list, eps: float) -> bool:
    """Whether the band per head cannot pay, shown before any sample (``certified_read``'s
    ``reject``): by the sizes alone — no band of ``widths`` read by every row pays
    (``band_pays``) — or by each row's last child: no band narrower than the one beyond
    which its exact mass is ≤ ``eps`` (``sampled.last_child_widths``) is certified, and the
    rows read first at those widths would not pay."""
    if _SET_ASIDE[0]:
        return False
    n, k, rows = a.shape[-2], a.shape[-1], math.prod(lead)
    if all(_band_cost([w], n, k, rows) > 0.6 for w in widths[:-1]):
        return True
    first = last_child_widths(a, b, h, scale, lead, torch.tensor(widths, device=a.device), eps)
    return _band_cost(first.tolist(), n, k, rows) > 0.6


def band_pays(first: torch.Tensor, n: int, k: int) -> bool:
    """The CPU's cost model of a band per head read to certify it, against the fused kernel
    over each head's whole past (``certified_read``'s ``pays``; measured on a 2-core AVX2
    host, ``benchmarks/bench_certificates.py``): a band of width w costs about
    1.1·p((w + 150)/N) of the whole past, p(x) = 2x − x² (its pairs, the kernel's tiles at
    its edges included); a row's first reading at ``first`` (where a sample of its children
    certifies, ``certificates.sampled``) is followed, in about one row in four where it does
    not certify them all, by one twice as wide; the certificate's own work costs about
    3.5 ms, ~20% of the whole past at N = 2,048, k = 64, four heads (∝ 1/(N²·k·heads)), and
    its sample ~3% (0.7 ms of 21 at N = 2,048, 13 ms of 970 at 16,384). Worth it where the
    expected cost is under 60% of the whole past."""
    if _SET_ASIDE[0]:
        return True
    return _band_cost(first.tolist(), n, k, first.numel()) <= 0.6


def table_band_pays(first: torch.Tensor, n: int, k: int, grad: bool) -> bool:
    """The CPU's cost model of a distance table's certified band (the generalised Gaussian:
    ``certify`` scores a band in float64, with the keys' per-block ceilings, then the
    distance-table kernel reads the band it certifies), against the kernel over each head's
    whole past (measured on a 2-core host, ``benchmarks/bench_certificates.py``): the band
    of width w costs about 1.1·p((w + 150)/N) of the whole past, p(x) = 2x − x², and the
    certificate about 1.6·(2,048/N)·(64/k) of its forward (28 ms against 17 ms at
    N = 2,048, 4 heads of 64; linear in N where the reading is quadratic), a third of that
    against a forward and backward. Worth it where the expected cost is under 75% of the
    whole past, with ``first`` ``(G,)`` each head's narrowest width a reading could certify
    (N − 1: all of its past)."""
    if _SET_ASIDE[0]:
        return True
    shares = [1.0 if w >= n - 1 else _share(w, n) for w in first.tolist()]
    return sum(shares) / len(shares) + _table_fixed(n, k, grad) <= 0.75


def _table_fixed(n: int, k: int, grad: bool) -> float:
    """``certify``'s own cost as a share of the distance-table kernel's whole past
    (``table_band_pays``)."""
    return 1.6 * (2048 / n) * (64 / k) / (3 if grad else 1)


def table_pays(a, b, scale: float, prior, eps: float, first: int, widest: int | None) -> bool:
    """Whether a distance table's certificate is worth computing for these factors
    ``(*lead, N, k)`` (``table_band_pays``, from a sample of children's exact evidence,
    ``sampled_widths``, over the widths ``certify`` would try): where the distance-table
    kernel reads the band (the CPU); elsewhere, or for a prior with no table, True. Where
    the sizes alone rule it out — not even the narrowest band would pay — no sample is taken
    and no value read (such a reading is recorded as a plan); where each head's last child
    does (``last_child_widths``), no sample is taken."""
    n = a.shape[-2]
    table = prior.log_by_distance(n - 1, a.device, torch.float32)
    if _SET_ASIDE[0] or table is None or not distance_table.applies(a, b, a):
        return True
    widths = widths_from(n - 1, 16, widest)
    grad = torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)
    # the cheapest bound, from the sizes alone (no value read: a plan records it): not even
    if _share(widths[0], n) + _table_fixed(n, a.shape[-1], grad) > 0.75:  # the narrowest
        return False  # band would pay for the certificate
    widths = torch.tensor(widths, device=a.device)
    lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    last = last_child_widths(a, b, None, scale, lead, widths, eps, first=first, table=table)
    if not table_band_pays(last, n, a.shape[-1], grad):  # the last child's tails: no sample
        return False
    narrowest = sampled_widths(a, b, None, scale, lead, widths, eps, first=first, table=table)
    return table_band_pays(narrowest, n, a.shape[-1], grad)


def block_worth(a, b, h, block: int) -> float | None:
    """The least share of its earlier key blocks a head's sampled child blocks must skip for
    its blocks to be certified (``block_sparse.certify_blocks``'s ``worth``), or None: every
    head reads all of its past, no certificate computed. On the CPU the certificate's own
    work — ceilings and scorings over every (child block, key block) pair, in float64 —
    costs 2–3× the fused kernel's forward over the whole past and about half of its forward
    and backward (``benchmarks/bench_certificates.py``): never worth it without a gradient;
    with one, from 64 key blocks on (below, the sample alone costs ~5% of the reading) and
    where the sampled blocks skip ≥ 95% of their past. Elsewhere ``WORTH``."""
    if a.device.type != "cpu" or _SET_ASIDE[0]:
        return WORTH
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (a, b, h))
    if not grad or -(-a.shape[-2] // block) < 64:
        return None
    return 0.95


def block_budget(a) -> float | None:
    """The most share of its earlier key blocks the block certificate's sampled last child
    may leave to score exactly (``block_sparse.certify_blocks``' ``budget``), or None: any.
    On the CPU its scoring, in float64 and not fused, costs several times the fused reading
    of the same pairs: measured at 8,192 and 16,384 tokens (``benchmarks/
    bench_certificates.py``), the heads it pays for need at most 3.6% of their blocks scored
    there (FoX's default gate, ALiBi's two fastest heads), those it does not at least 6.7%
    (ALiBi on large tokens, whose sample alone then cost 5–10% of a forward and backward)."""
    return 0.05 if a.device.type == "cpu" and not _SET_ASIDE[0] else None


def blocks_together(a) -> bool:
    """Whether the heads' blocks are certified together (``certify_blocks``'s ``together``):
    on the CPU, whose kernels parallelise over heads, where more than half the heads would
    read all of their past, every head does — a lone sparse head saved less than its certificate
    and the sample cost (ALiBi on large tokens at 16,384 tokens: 1.19× the exact forward and
    backward, one head of four certified)."""
    return a.device.type == "cpu" and not _SET_ASIDE[0]
