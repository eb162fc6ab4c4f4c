"""Distance priors: p(φ_i = j) depends on the distance d = i − j alone.

A ``DistancePrior`` states one thing, ``log_at_distance(d)``: the unnormalised log weight at
integer distances d (``(heads or 1, *d.shape)``; −∞ excludes a distance). Everything else
derives from it:

- ``log_weight`` at (child, parent) pairs, and ``log_by_distance`` (the table d = 0..W that
  certified truncation reads);
- the support: j ≤ i (``causal``) or every parent, from the distance ``first`` (0: the child
  itself, 1: strictly the past); with ``tol`` all of the past, read through a certified
  window (``structattn.certified``) in blocks of ``block_size`` children — the model, and so
  Pyro's reading, is still the whole past;
- the tables: declaring a family checks the distance table ``(heads, N)``, never a dense C×P
  one (a certified window never builds it), and the heads.

ALiBi, the generalised Gaussian and a user's own (a power law, say) are such priors: one
short file each, with no tables of their own.
"""

from __future__ import annotations

import torch

from .._validation import checks_on, passes
from ..certified import certificate_option, window_options
from ..kinds.window import Window
from .base import Prior
from .tables import PriorTables, _check_log_weights
from .uniform import dense_support


class DistancePrior(Prior):
    """Base class of priors over the distance d = i − j (module docstring): a subclass calls
    ``super().__init__`` with its options and states ``log_at_distance`` and ``heads``."""

    #: the nearest distance on the support: 0 (the child itself) or 1 (strictly the past)
    first: int = 0

    def __init__(self, owner: str, *, causal: bool = True, tol: float | None = None,
                 block_size: int = 64, certificate: str = "window"):
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
        parameters' own)."""
        raise NotImplementedError

    @property
    def heads(self) -> int:
        """How many heads of parameters the prior has (1: shared by every head)."""
        return self.log_at_distance(torch.zeros(1, dtype=torch.long)).shape[0]

    # -- derived ----------------------------------------------------------------------------
    def support(self, num_children, num_parents):
        if self.tol is not None:  # all of the past, read through a certified window
            return Window(None, first=self.first)
        if self.first == 1:  # strictly the past, j < i
            return Window(None, first=1)
        return dense_support(self.causal, None)

    def log_weight(self, child, parent, sizes):
        return self.log_at_distance(child - parent)  # (H|1, *index)

    def log_by_distance(self, window, device, dtype):
        """``(heads or 1, window + 1)`` at d = 0..window (a stationary prior)."""
        return self.log_at_distance(torch.arange(window + 1, device=device), dtype).reshape(
            -1, window + 1).to(device)

    def tables(self, num_children, num_parents, device):
        return (DistanceTables if self.tol is not None else PriorTables)(
            self, num_children, num_parents, device)

    def describe(self) -> str:
        return f"{type(self).__name__}(heads={self.heads}, {self.short_support()})"


class DistanceTables(PriorTables):
    """The generic tables, except that declaring a family checks the prior's distance table
    ``(heads, N)`` instead of the dense C×P one, which a certified window never builds:
    every log weight is one of its entries (j ≤ i reads d = 0..N − 1), and every child reads
    its nearest distance."""

    def validate(self, family: str, *, batch_shape=(), heads: int = 1) -> None:
        prior, n = self.prior, max(self.num_children, self.num_parents)
        h = prior.heads
        if h not in (1, heads):
            raise ValueError(f"edge family {family!r}: {type(prior).__name__} has {h} heads "
                             f"of parameters but the family has heads={heads}")
        if not checks_on():
            return
        table = prior.log_by_distance(max(n - 1, 0), self.device, None)  # (H, N)
        _check_log_weights(family, table, "at distance index")
        nearest = table[:, prior.first] if table.shape[-1] > prior.first else table[:, :0]
        if not passes(~torch.isneginf(nearest).any()):
            raise ValueError(f"edge family {family!r}: {type(prior).__name__}'s log weight at "
                             f"distance {prior.first} is −inf, so the child nearest the start "
                             f"has an empty support; got {prior.describe()}")
