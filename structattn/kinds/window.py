"""Window supports — each child reads the parents first ≤ d ≤ W positions back, d = i − j,
first = 1 (j < i) or 0 (j ≤ i) — and their operator: one banded
``scaled_dot_product_attention`` call (``structattn.operators.band``), O(N·W), or FlexAttention with a
block mask on CUDA. The prior is a ``structattn.priors.DistancePrior`` (``Prior.reading``
gives any other the dense operator): it gives its log weights on the band
(``log_weights_on_band``: from its distance table ``log_by_distance`` where it states one,
as the geometric–Beta prior of expanding attention does, else its own, as a forget gate's),
its ``block_size`` and its ``certificate``. A prior with a certified ``tol`` and no width
of its own reads the window certified for the call (``structattn.certificates.certified``), or all of the
past through the dense operator; one whose ``certificate`` is "blocks" reads the key blocks
certified for each block of children, per head (``structattn.block_sparse``). Where a
kernel reads a band per head (Triton on a GPU, the compiled band kernel on the CPU), the
band's certificate comes from its own log-sums (``structattn.certificates.certified_read``),
never from a scoring of the band before it is read; a table prior's band (the generalised
Gaussian) is read on the CPU by the distance-table kernel over the band's distances. On the
CPU, where a certificate is not expected to pay, the whole past is read at once instead
(``kinds.certificate_costs``).

The children may be the last C of the P parent tokens (a decoding step): child i sits at
position P − C + i (``offset`` = P − C); the dense reading serves that case.

Cost: O(N·W·(k + d_v)) time, O(N·W) memory; the dense twin (a window holding all of the
past, C < P, or a potential with no factorised form) O(C·P).
"""

from __future__ import annotations

import torch

from .. import kernels, reading
from ..block_sparse import block_sparse_attention, causal_posterior, certify_blocks, read_whole
from ..certificates.certified import all_of_the_past, certify, window_bound
from ..checking._validation import is_exporting
from ..operators import band
from . import distance_table
from .base import Operator, Support
from .certificate_costs import block_budget as _block_budget
from .certificate_costs import block_worth as _block_worth
from .certificate_costs import blocks_together as _blocks_together
from .certificate_costs import table_pays as _table_pays
from .certified_band_op import read_band, settle
from .dense import with_parent_terms
from .key_bias import applies, band_applies, folds_terms, key_bias_attention


def keep_from_position(n: int, device, dtype) -> torch.Tensor:
    """``(N, 1)``: 0 for the token at position 0, which has no past (zero output), 1 elsewhere."""
    return (torch.arange(n, device=device) > 0).to(dtype)[:, None]


class WindowOperator(Operator):
    """The banded lowering of a ``Window`` support (module docstring) under a
    ``DistancePrior``: one banded reading, a certified window or key blocks (``tol``), or
    the dense twin where none applies. Reports certified truncation's choice
    (``truncation``).

    Args:
        family (EdgeFamily): the edge family whose posterior it reads (``Operator``).
        cache (dict | None): what an iterating reader keeps across steps (``Operator``).
            None (default): a new, empty one.
    """

    reading_name = "window"

    def __init__(self, family, cache=None):
        super().__init__(family, cache)
        self._band = None
        self._width = False  # not chosen yet
        #: certified truncation's choice (``structattn.certificates.certified.CertifiedWindow``) when the
        #: prior asks for one (``tol``) and the band applies; the trace reports it
        self.truncation = None
        self._windows = False  # each head's window (``_head_windows``), not chosen yet
        self._given = False  # the width is an exported program's runtime input
        self._outcome = None  # the band read's choice, not settled yet (``_settle``)

    def _settle(self):
        """The band read's choice (``_certified_read``) as ``truncation``, its width and each
        head's window: made when asked for, so that a recorded reading branches on no value."""
        if self._outcome is not None:  # (each head's window follows: ``_head_windows``)
            self.truncation = settle(self._outcome, self.family.prior.tol)
            self._outcome, self._width = None, self.truncation.width

    def _chosen_width(self) -> int | None:
        """The window the band reads: the support's, or — when the prior states a certified
        ``tol`` — the shortest one whose posterior tail is certified ≤ tol for every child
        (then the support's is its cap); None: all of the past."""
        self._settle()
        if self._width is not False:
            return self._width
        f = self.family
        width, eps = f.support.width, f.prior.tol
        n = f.children.size
        if eps is not None and self.is_fused() and f.support.offset == 0 \
                and n == f.parents.size and n > 1:
            a, b, scale = self.fused_factors()  # (*batch, H, N, k)
            block = f.prior.block_size
            given = reading.context().window
            if given is not None:  # an exported program: the width is its runtime input,
                # and its certificate at that width a verdict the program asserts
                width = given[0] if width is None else torch.sym_min(given[0], width)
                given[1].append((window_bound(a, b, scale, f.prior, width, first=f.support.first,
                                              block=block) <= eps).all())
                self._width, self._given = width, True
                return width
            # a band wider than half the sequence reads more pairs than the causal kernel does
            # (N·L against N²/2), and slower ones: beyond it, read all of the past. A band per
            # head reads from each child's window on: up to half the sequence (3/4 of the
            # causal pairs, at ~1.4× the fused kernel's cost per pair on the CPU, measured)
            per_head = self._per_head()
            widest = None if width is not None else n // 2 if per_head else max(
                (w for w in (2 ** e for e in range(n.bit_length()))
                 if 2 * band.BandLayout.for_window(n, w, block).width <= n), default=0)
            # on the CPU a band scored in float64 costs more per pair than its reading: the
            # width the start's evidence certifies is read as it is (bench_certificates.py)
            if width is None and not _table_pays(a, b, float(scale), f.prior, eps,
                                                 f.support.first, widest):
                self.truncation = all_of_the_past(torch.broadcast_shapes(
                    a.shape[:-2], b.shape[:-2]), n, eps, a.device, per_head)
            else:
                self.truncation = certify(a, b, scale, f.prior, eps, cap=width, block=block,
                                          first=f.support.first, widest=widest,
                                          per_lead=per_head, narrower=a.device.type != "cpu")
            width = self.truncation.width
        self._width = width
        return width

    def reports(self) -> dict:
        self._settle()
        return {} if self.truncation is None else {"truncation": self.truncation}

    def _separable_past(self) -> bool:
        """Whether the prior separates as g_i + h_j over j ≤ i of the same tokens (no offset),
        with one factorised potential: what both readings below need."""
        f = self.family
        n = f.children.size
        return (self.is_fused() and f.support.offset == 0 and f.support.first == 0
                and n == f.parents.size and n > 1 and f.tables.separable() is not None)

    def _blocks(self) -> bool:
        """Whether the certified block-sparse reading applies: the prior asks for it
        (``certificate="blocks"`` with a ``tol``) over all of the past (``_separable_past``)."""
        prior = self.family.prior
        return (prior.tol is not None and prior.certificate == "blocks"
                and self.family.support.width is None and self._separable_past())

    def _per_head(self) -> bool:
        """Whether each head reads a band of its own (a band kernel's ``window``: Triton on
        the GPU, the compiled kernel on the CPU, ``band_applies``): a separable prior over the
        past (``_separable_past``) not read by its key blocks."""
        if not self._separable_past() or self._blocks():
            return False
        a, b, _ = self.fused_factors()
        return band_applies(a, b)

    def _reads_to_certify(self) -> bool:
        """Whether the band per head is certified by reading it (``structattn.
        certified_read``: the key-bias kernel's own log-sums are the certificate's evidence,
        no second scoring of the band): a ``tol`` over all of the past, no width chosen yet,
        a band per head (``_per_head``: the Triton kernel on a GPU, the compiled band kernel
        on the CPU, ``key_bias.band_rows``), not an exported program."""
        f = self.family
        if (f.prior.tol is None or f.support.width is not None or self._width is not False
                or self._outcome is not None
                or reading.context().window is not None or not self._per_head()):
            return False
        return kernels._enabled() and not (is_exporting() or torch.compiler.is_exporting())

    def _certified_read(self, u):
        """Each head's certified band, read (``certified_band_op.read_band``): the output;
        the choice is kept (``_settle``: ``truncation``, the width, each head's window)."""
        a, b, scale, h = self._block_terms()
        prior = self.family.prior
        out, self._outcome = read_band(a, b, u, h, float(scale), prior.tol, prior.block_size)
        return out

    def _head_windows(self) -> torch.Tensor | None:
        """Each head's window ``(*batch, H)`` (the longest its children need: certified per
        head, or the support's), or None: every head reads all of its past."""
        self._settle()
        if self._windows is False:
            width, n = self._chosen_width(), self.family.children.size
            if self.truncation is not None:
                windows = self.truncation.heads
                self._windows = None if bool((windows >= n - 1).all()) else windows
            elif width is None or width >= n - 1:
                self._windows = None
            else:
                a = self.fused_factors()[0]
                self._windows = torch.full(a.shape[:-2], width, dtype=torch.long, device=a.device)
        return self._windows

    def _block_terms(self):
        """``(a, b, scale, h)``: the factors and the prior's per-parent term (float32 at least:
        h grows along the sequence)."""
        a, b, scale = self.fused_factors()  # (*batch, H, N, k)
        h = self.family.tables.separable()[1]
        return a, b, scale, h.to(torch.promote_types(a.dtype, torch.float32))

    def _banded(self) -> bool:
        """Whether the band applies: one factorised potential, the children are all the
        parents (no offset) and the window is shorter than the past."""
        f = self.family
        n = f.children.size
        if not (self.is_fused() and f.support.offset == 0 and n == f.parents.size):
            return False
        w = self._chosen_width()
        return w is not None and (self._given or w < n - 1)  # (a runtime width: no branch)

    def _setup(self):
        if self._band is None:
            f = self.family
            n, window = f.children.size, self._chosen_width()
            a, b, scale = self.fused_factors()  # (*batch, H, N, k)
            xc, first = f.children.states, f.support.first
            # the token at position 0 has no past unless it reads itself
            keep = keep_from_position(n, a.device, xc.dtype) if first else None
            table = f.prior.log_by_distance(window, a.device, xc.dtype)  # (H|1, W + 1) or None
            layout = band.BandLayout.for_window(n, window, f.prior.block_size)
            inside = layout.within(window, first, a.device)  # (nb, B, L)
            # children without any parent in the band (child 0, padding) attend anywhere; zeroed
            rows = inside.any(-1, keepdim=True)
            # a log prior g_i + h_j with no distance table (FoX's gate): h rides in one more key
            # dimension and the mask is the band's geometry alone, constant — SDPA's fused
            # kernel, which gives no mask a gradient, runs instead of its math path (3× slower
            # at N = 4,096), and no (…, nb, B, L) bias is gathered
            h = f.tables.parent_terms(xc.dtype) if table is None and folds_terms(a, b) \
                else None  # (in half precision the band's weights: h would be rounded)
            geometry = None if h is None else torch.zeros(
                inside.shape, dtype=xc.dtype, device=a.device).masked_fill(~inside & rows,
                                                                           float("-inf"))
            self._band = dict(a=a, b=b, scale=scale, keep=keep, table=table, layout=layout,
                              inside=inside, rows=rows, bias=None, h=h, geometry=geometry, p=None)
        return self._band

    def _bias(self):
        """The band's log prior ``(…, nb, B, L)``: −∞ off each child's support, 0 on the rows
        without any parent (child 0 under j < i, padding: they attend anywhere, zeroed)."""
        s = self._setup()
        if s["bias"] is None:
            f = self.family
            bias = f.prior.log_weights_on_band(s["layout"], self._chosen_width(), f.support.first,
                                               s["a"].device, f.children.states.dtype)
            s["bias"] = torch.where(s["rows"], bias, torch.zeros_like(bias))
        return s["bias"]

    def _band_posterior(self):
        s = self._setup()
        if s["p"] is None:
            scores = band.scores(s["a"], s["b"], s["scale"], s["layout"])  # (*batch, H, nb, B, L)
            s["p"] = torch.softmax(scores + self._bias(), -1) * s["rows"]
        return s["p"]

    def dense_posterior(self):
        if self._reads_to_certify():  # the certificate from a reading of zero values
            a = self.fused_factors()[0]
            self._certified_read(a.new_zeros(*a.shape[:-1], 1))
        if self._per_head() and self._head_windows() is not None:  # a band per head
            a, b, scale, h = self._block_terms()
            n = a.shape[-2]
            i, j = torch.arange(n, device=a.device)[:, None], torch.arange(n, device=a.device)
            read = j >= i - self._head_windows()[..., None, None]  # (*batch, H, N, N)
            return causal_posterior(a, b, scale, h, read)
        if self._blocks():  # the posterior renormalised on the key blocks certified
            a, b, scale, h = self._block_terms()
            if self.truncation is None:
                worth, prior = _block_worth(a, b, h, self.family.prior.block_size), \
                    self.family.prior
                self.truncation = read_whole(a, b, h, prior.tol, block=prior.block_size) \
                    if worth is None else certify_blocks(a, b, scale, h, prior.tol,
                                                         block=prior.block_size, worth=worth,
                                                         together=_blocks_together(a),
                                                         budget=_block_budget(a))
            blk = torch.arange(a.shape[-2], device=a.device) // self.truncation.block
            read = self.truncation.read[..., blk, :][..., blk]
            return causal_posterior(a, b, scale, h, read)
        if not self._banded():
            return super().dense_posterior()
        return self._setup()["layout"].to_dense(self._band_posterior())

    def attend(self, u):
        if self._blocks():
            a, b, scale, h = self._block_terms()
            prior = self.family.prior
            worth = _block_worth(a, b, h, prior.block_size)
            if worth is None:  # the certificate would cost more than it could save
                self.truncation = read_whole(a, b, h, prior.tol, block=prior.block_size)
                return _whole_past(a, b, u, scale, h)
            out, self.truncation = block_sparse_attention(
                a, b, u, scale, h, prior.tol, block=prior.block_size, whole_past=_whole_past,
                worth=worth, together=_blocks_together(a), budget=_block_budget(a))
            return out
        if self._reads_to_certify():
            return self._certified_read(u)
        if self._per_head() and self._head_windows() is not None:
            a, b, scale, h = self._block_terms()
            return key_bias_attention(a, b, u, h, float(scale), True, self._head_windows())
        if not self._banded():
            return super().attend(u)
        s = self._setup()
        if s["p"] is not None:
            return _kept(band.apply(s["p"], u, s["layout"]), s["keep"])
        a, b, window = s["a"], s["b"], self._chosen_width()
        if s["table"] is not None and distance_table.applies(a, b, u):  # the CPU: the table
            # looked up per tile over the band's distances alone, as the whole past's kernel
            # reads it — no (…, nb, B, L) bias built, no padded slots scored
            return _kept(distance_table.band_attention(
                a, b, u, s["table"], self.family.support.first, window, s["scale"]), s["keep"])
        if a.is_cuda and s["table"] is not None and _flex_available():
            table, H = s["table"], s["table"].shape[0]

            def log_prior(bi, h, i, d):
                return table[h if H > 1 else 0, d.clamp(0, window)]

            lead = a.shape[:-2]  # FlexAttention takes (B, H, N, d): fold the batch dims
            out = band.flex_attend(a.reshape(-1, *a.shape[-3:]), b.reshape(-1, *b.shape[-3:]),
                                   u.reshape(-1, *u.shape[-3:]), s["scale"], log_prior, window,
                                   first=self.family.support.first)
            return _kept(out.reshape(*lead, *out.shape[-2:]), s["keep"])
        if s["h"] is not None:
            a, b, wide = with_parent_terms(a, b, u, s["h"], s["scale"])
            out = band.attend(a, b, wide, s["scale"], s["geometry"], s["layout"])
            return _kept(out[..., :u.shape[-1]], s["keep"])
        return _kept(band.attend(a, b, u, s["scale"], self._bias(), s["layout"]), s["keep"])


def _whole_past(a, b, u, scale, h):
    """All of the past j ≤ i under g_i + h_j: the fused key-bias reading where it applies
    (O(N·d) memory), else the dense table."""
    if applies(a, b, u, h):
        return key_bias_attention(a, b, u, h, float(scale), True)
    return causal_posterior(a, b, scale, h) @ u


def _kept(out: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """``out`` zeroed at the children without a past (``keep``; None: every child has one)."""
    return out if keep is None else out * keep



def _flex_available() -> bool:
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


class Window(Support):
    """Φ_i = {j : first ≤ (offset + i) − j ≤ width}: the parents at most ``width`` positions
    back from the child, lowered by ``WindowOperator``.

    Args:
        width (int | None): the longest distance read, an int (not checked); None: all of
            the past.
        offset (int): where child i sits among the parents, position ``offset + i``: 0
            (default) when the children are the parents' first tokens, P − C when they are
            the last C (a decoding step).
        first (int): the nearest distance read: 1 (default: the parents before the child) or
            0 (the child too).

    Raises:
        ValueError: ``first`` not 0 or 1.

    Example:
        >>> from structattn.kinds import Window
        >>> Window(2).dense(4, 4, "cpu").int()
        tensor([[0, 0, 0, 0],
                [1, 0, 0, 0],
                [1, 1, 0, 0],
                [0, 1, 1, 0]], dtype=torch.int32)
    """

    operator = WindowOperator  # its lowering: one banded reading

    def __init__(self, width: int | None, offset: int = 0, first: int = 1):
        if first not in (0, 1):
            raise ValueError(f"Window support: first (the nearest distance read) must be 0 or 1; "
                             f"got {first!r}")
        self.width, self.offset, self.first = width, offset, first

    def contains(self, child, parent):
        d = child + self.offset - parent
        return (d >= self.first) if self.width is None else (d >= self.first) & (d <= self.width)

    def dense(self, num_children, num_parents, device):
        ones = torch.ones(num_children, num_parents, dtype=torch.bool, device=device)
        past = ones.tril(self.offset - self.first)  # j ≤ i + offset − first
        return past if self.width is None else past & ones.triu(self.offset - self.width)

    def is_causal(self):
        """All of the past and the child itself, with no offset: j ≤ i."""
        return self.width is None and self.first == 0 and self.offset == 0

    def describe(self):
        return f"{self.first} ≤ i − j" + ("" if self.width is None else f" ≤ {self.width}")
