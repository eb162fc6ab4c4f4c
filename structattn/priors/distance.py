"""Distance priors: p(φ_i = j) weighs the distance d = i − j back from child i.

A stationary ``DistancePrior`` states one thing, ``log_at_distance(d)``: the unnormalised
log weight at integer distances d (``(heads or 1, *d.shape)``; −∞ excludes a distance).
Everything else derives from it:

- ``log_weight`` at (child, parent) pairs, and ``log_by_distance`` (the table d = 0..W that
  the window operator reads on its band and certified truncation sums for its tail);
- the support: j ≤ i (``causal``) or every parent, from the distance ``first`` (0: the child
  itself, 1: strictly the past), up to the prior's own ``window`` if it has one; with
  ``tol`` all of the past, read through a certified window (``structattn.certificates.certified``) in
  blocks of ``block_size`` children — the model, and so Pyro's reading, is still the whole
  past;
- the tables: declaring a family whose support is a window checks the distance table
  ``(heads, N)`` and each parameter's heads, never a dense C×P table (a window never
  builds it).

ALiBi, the generalised Gaussian, the beta-geometric and a user's own (a power law, say) are
such priors: one short file each, with no tables of their own.

A *non-stationary* distance prior — FoX's forget gate, whose weight at a distance depends on
the tokens in between — sets ``stationary = False`` and states no ``log_at_distance``; it
keeps the options, the support and the certified window of the base, and overrides what
reads its weights: ``log_weight`` (Pyro's reading and the dense table), ``heads``,
``log_tail_mass`` (the certificate's tail) and, where its band weights are not simply
``log_weight`` at the band's pairs, ``log_weights_on_band``. ``log_by_distance`` is then
None (the window operator reads the band weights, or the prior's ``terms``), and the tables
check it as any prior's (``PriorTables.validate``).
"""

from __future__ import annotations

import torch

from ..certificates.certified import certificate_option, window_options
from ..checking._validation import checks_on, passes
from ..kinds.dense import DenseOperator
from ..kinds.window import Window
from .base import Prior
from .tables import PriorTables, _check_log_weights
from .uniform import dense_support


class DistancePrior(Prior):
    r"""Base class of priors over the distance $d = i − j$ back from child $i$ (module docstring).

    A stationary subclass states ``log_at_distance`` (and ``heads``, if it can say it
    without evaluating a weight) and calls ``super().__init__`` with its options; every
    other hook derives from them.

    Args:
        owner (str): how error messages name the prior, e.g. ``"ALiBi prior"``.
        causal (bool): the support j ≤ i; False: every parent. Default True.
        tol (float | None): causal only: the posterior mass per child a certified window may
            leave out, in (0, 1) (``structattn.certificates.certified``); the model, and so Pyro's
            reading, is still all of the past. None (default): read all of the past.
        block_size (int): the band's block of children (the window operator's
            ``band.BandLayout``, certified truncation's and the mean-field windows' bands),
            an int ≥ 1. Default 64.
        certificate (str): how ``tol`` is read: ``"window"`` (default: the shortest band
            certified for every child and head) or ``"blocks"`` (the key blocks each block of
            children needs, per head, ``structattn.block_sparse``; needs a ``tol``, and
            applies to a prior whose log weight separates as g_i + h_j). The window operator
            reads it; ``structattn.export`` names it.

    Attributes:
        first (int): the nearest distance on the support, a class attribute: 0 (default: the
            child itself) or 1 (strictly the past; the first child then has no parent and
            gets a zero output).
        stationary (bool): whether the log weight depends on the distance alone, a class
            attribute. Default True (False: see the module docstring).

    Raises:
        ValueError: naming ``owner``: a ``tol`` outside (0, 1) or with ``causal=False``, a
            ``block_size`` that is not an int ≥ 1, a ``certificate`` other than
            ``"window"`` or ``"blocks"``, or ``"blocks"`` without a ``tol``.
    """

    first: int = 0
    stationary: bool = True
    block_size: int = 64
    certificate: str = "window"

    def __init__(self, owner: str, *, causal: bool = True, tol: float | None = None,
                 block_size: int = 64, certificate: str = "window"):
        """Check and keep the options (the class docstring's Args)."""
        self.causal = bool(causal)
        self.tol, self.block_size = window_options(owner, tol, block_size, self.causal)
        self.certificate = certificate_option(owner, certificate, tol)

    @property
    def empty(self) -> str:
        """Strictly the past (``first`` 1): the first token has no parent — a zero output."""
        return "zero" if self.first >= 1 else "error"

    # -- what a subclass states -------------------------------------------------------------
    def log_at_distance(self, d: torch.Tensor, dtype=None) -> torch.Tensor:
        """The unnormalised log weight ``(heads or 1, *d.shape)`` at integer distances ``d``
        (negative ones too where the support is not causal), in ``dtype`` (None: the
        parameters' own). Called by ``log_weight``, ``log_by_distance`` and ``heads``; a
        stationary prior must state it (a non-stationary one does not: it raises)."""
        raise NotImplementedError(
            f"{type(self).__name__} states no log_at_distance: a stationary DistancePrior "
            f"must; a non-stationary one (stationary = False) overrides log_weight instead")

    @property
    def heads(self) -> int:
        """How many heads of parameters the prior has (1: shared by every head); read by
        ``head_counts`` and ``describe``. Default: the rows of ``log_at_distance``."""
        return self.log_at_distance(torch.zeros(1, dtype=torch.long)).shape[0]

    def head_counts(self) -> dict[str, int]:
        """How many heads each parameter has, by name (each must be 1 or the family's
        heads); read by the tables when a family is declared. Default: ``{"parameters":
        heads}``; a prior whose parameters may disagree names each."""
        return {"parameters": self.heads}

    def window(self, num_parents: int) -> int | None:
        """The longest distance the support holds for ``num_parents`` parents, or None (all
        of the past); read by ``support``. Default None (the beta-geometric cuts it)."""
        return None

    def child_offset(self, num_children: int, num_parents: int) -> int:
        """Where child i sits among the parents: position ``child_offset`` + i; read by
        ``support`` and ``log_weight``. Default 0 (the children are the first C tokens; the
        beta-geometric's are the last C, a decoding step: P − C)."""
        return 0

    # -- derived ----------------------------------------------------------------------------
    def support(self, num_children, num_parents):
        """``first`` ≤ d ≤ ``window`` with d = (``child_offset`` + i) − j, a ``Window`` (read
        by the banded window operator); all of j ≤ i (or every parent, not ``causal``) with
        no ``tol`` is the dense operator's ``Causal`` (or ``AllParents``)."""
        width, offset = self.window(num_parents), self.child_offset(num_children, num_parents)
        if self.tol is None and self.first == 0 and width is None and offset == 0:
            return dense_support(self.causal, None)
        return Window(width, offset=offset, first=self.first)

    def log_weight(self, child, parent, sizes):
        offset = self.child_offset(*sizes)
        return self.log_at_distance(child + offset - parent)  # (H|1, *index)

    def log_table(self, num_children, num_parents, device, dtype):
        """Dense log weights ``(…, C, P)``: a stationary prior's C + P − 1 distinct weights,
        one per distance, laid along the grid's diagonals — one copy of ``(…, C, P)`` (4 GiB
        in float32 at C = P = 16,384 and four heads), not ``log_weight``'s several temporaries
        of that size, one per operation at every pair. A non-stationary prior:
        ``log_weight`` on the grid."""
        if not self.stationary or num_children == 0 or num_parents == 0:
            return super().log_table(num_children, num_parents, device, dtype)
        top = self.child_offset(num_children, num_parents) + num_children - 1  # the longest d
        # h[m] = weight at d = top − m, m = 0 … C + P − 2: descending distances
        h = self.log_at_distance(torch.arange(top, top - num_children - num_parents + 1, -1,
                                              device=device))  # (H|1, C + P − 1)
        # unfold: [k, j] = h[k + j], the weight at d = top − k − j; row k is child C − 1 − k
        w = h.unfold(-1, num_parents, 1).flip(-2)  # (H|1, C, P)
        return w if dtype is None else w.to(dtype)

    def log_at_offsets(self, num_children, num_parents, device, causal):
        """``log_at_distance`` at d = ``lowest`` … C − 1 (``Prior.log_at_offsets``) for a
        stationary prior whose children are the first C tokens (``child_offset`` 0); None
        otherwise."""
        if not self.stationary or self.child_offset(num_children, num_parents) != 0:
            return None
        lowest = 0 if causal else 1 - num_parents
        d = torch.arange(lowest, num_children, device=device)
        return self.log_at_distance(d).reshape(-1, d.numel()), lowest  # (H|1, n)

    def log_by_distance(self, window: int, device, dtype) -> torch.Tensor | None:
        """``(heads or 1, window + 1)``: the log weight at each distance d = 0..window, in
        ``dtype``; None for a non-stationary prior. Read by the window operator (its band's
        table, FlexAttention's score), ``log_weights_on_band``, ``log_tail_mass`` and the
        tables' check."""
        if not self.stationary:
            return None
        return self.log_at_distance(torch.arange(window + 1, device=device), dtype).reshape(
            -1, window + 1).to(device)

    def log_weights_on_band(self, layout, width: int, first: int, device, dtype,
                            blocks: slice = slice(None)):
        """The log weights at a band's (child i, parent i − d) pairs (``structattn.operators.band``
        layout over N = ``layout.n`` tokens, children and parents alike) for ``first`` ≤ d ≤
        min(``width``, i), −∞ at every other slot: ``(…, nb, B, L)`` in ``dtype`` (``blocks``:
        those blocks only). Read by the window operator (its band's bias) and certified
        truncation (the evidence inside a window). Default: from ``log_by_distance``, or
        ``log_weight`` at the pairs for a non-stationary prior."""
        inside = layout.within(width, first, device, blocks)  # (nb, B, L)
        table = self.log_by_distance(width, device, dtype)
        if table is not None:
            lw = table[:, layout.distance(device).clamp(0, width)][:, None]  # (H|1, 1, B, L)
        else:
            n = layout.n
            child = layout.child_positions(device)[blocks, :, None].clamp(max=n - 1)  # (nb, B, 1)
            parent = layout.parent_positions(device)[blocks, None].clamp(0, n - 1)  # (nb, 1, L)
            lw = self.log_weight(child, parent, (n, n)).to(dtype)  # (…, nb, B, L)
        return lw.masked_fill(~inside, float("-inf"))

    def log_tail_mass(self, width: int, num_tokens: int, device, dtype) -> torch.Tensor:
        """log of an upper bound on Σ_{j < i − width} w_ij — the prior's unnormalised weight
        (the units of ``log_weight``) of child i's parents farther back than ``width`` —
        broadcastable to ``(*batch, heads, N)``; −∞ where there are none. Read by certified
        truncation (``structattn.certificates.certified``). Default: the distance table summed from
        width + 1 to the longest distance N − 1 (a child's own past ends sooner: an upper
        bound); a non-stationary prior overrides it."""
        table = self.log_by_distance(num_tokens - 1, device, dtype)
        if table is None:
            raise NotImplementedError(
                f"{type(self).__name__} is not stationary and states no log_tail_mass: "
                f"certified truncation needs the prior's weight beyond a window")
        beyond = torch.logcumsumexp(table.flip(-1), -1).flip(-1)  # [d]: log Σ_{d' ≥ d}
        # d = width + 1 ≥ N holds nothing (−∞); no branch on ``width``, which an exported
        # program takes at run time
        d = torch.arange(num_tokens, device=device)
        return torch.where(d == width + 1, beyond, float("-inf")).amax(-1, keepdim=True)

    def reading(self, support):
        """The support's operator: a ``Window``'s reads this prior's band hooks."""
        return support.operator or DenseOperator

    def tables(self, num_children, num_parents, device):
        return DistanceTables(self, num_children, num_parents, device)

    def describe(self) -> str:
        return f"{type(self).__name__}(heads={self.heads}, {self.short_support()})"


class DistanceTables(PriorTables):
    """The generic tables, except that declaring a family under a stationary prior on a window,
    or one a kernel computes per block of scores (``distance_shape``), checks each parameter's
    heads first, and, on a window, the prior's distance table ``(heads, N)``
    instead of the dense C×P one, which a window never builds: every log weight is one of its
    entries (d = (offset + i) − j ≤ N − 1), and every child reads its nearest distance. On
    every parent or j ≤ i the generic check reads the table over the offsets
    (``PriorTables.offsets``); any other support is the dense operator's, whose table is read
    anyway."""

    def validate(self, family: str, *, batch_shape=(), heads: int = 1) -> None:
        prior = self.prior
        window = isinstance(self.support, Window)
        if not (prior.stationary and (window or prior.distance_shape() is not None)):
            return super().validate(family, batch_shape=batch_shape, heads=heads)
        for name, h in prior.head_counts().items():
            if h not in (1, heads):
                raise ValueError(f"edge family {family!r}: {type(prior).__name__} {name} has {h} "
                                 f"entries (one per head) but the family has heads={heads}; "
                                 f"give a scalar or a tensor of shape ({heads},)")
        if not window:
            return super().validate(family, batch_shape=batch_shape, heads=heads)
        if not checks_on():
            return
        n = max(self.num_children, self.num_parents)
        table = prior.log_by_distance(max(n - 1, 0), self.device, None)  # (H, N)
        _check_log_weights(family, table, "at distance index")
        nearest = table[:, prior.first] if table.shape[-1] > prior.first else table[:, :0]
        if not passes(~torch.isneginf(nearest).any()):
            raise ValueError(f"edge family {family!r}: {type(prior).__name__}'s log weight at "
                             f"distance {prior.first} is −inf, so the child nearest the start "
                             f"has an empty support; got {prior.describe()}")
