"""The prior over one edge family: p(φ_i = j) for each child i over parents j.

A prior states two things once, as data (the ``torch.distributions`` convention of a
``support`` and a ``log_prob``), and every reading derives from them:

- ``support(C, P)``: the set of parents each child may choose, a ``structattn.kinds``
  ``Support`` (every parent, j ≤ i, a mask, an edge list, a window, …) whose
  ``contains(child, parent)`` is the definition;
- ``log_weight(child, parent, sizes)``: the unnormalised log prior at index pairs (None:
  uniform on the support), so that

      log p(φ_i = j) = w_ij − logsumexp_{j' ∈ Φ_i} w_ij'  on Φ_i, −∞ outside.

Pyro's reading (``structattn.family``) evaluates exactly these two on the (child, parent)
grid; the compiled reading builds the support's operator, which reads the prior's dense
``log_table`` (by default ``log_weight`` on the grid; a prior may give it faster, e.g. its
own logits tensor) and the support's own efficient form. ``tests/priors`` checks, for every
prior, that the two readings agree.

Everything broadcasts against ``(*batch, heads, C, P)``.
"""

from __future__ import annotations

import torch

from ..kinds.base import Support, grid
from ..kinds.dense import AllParents, DenseOperator
from .tables import PriorTables


class Prior:
    """Base class of edge priors (see the module docstring for the contract)."""

    #: a child with no allowed parent: "error" (ValueError) or "zero" (zero value, zero posterior)
    empty: str = "error"
    #: whether "no parent" is an outcome of every child (weighted like one more parent under
    #: a uniform prior; its value is zero), not only of children without parents
    leftover: bool = False
    #: the most potentials a family under this prior takes (None: any number)
    max_potentials: int | None = None
    #: certified truncation (``structattn.certified``): the posterior mass a window may leave
    #: out per child (None: the prior reads its whole support); read by the window operator
    tol: float | None = None
    #: the band's block of children where the prior is read through a window (its window
    #: operator's ``band.BandLayout``); None where it never is
    block_size: int | None = None
    #: how a ``tol`` is read: "window" (the shortest band certified for every child and head,
    #: ``structattn.certified``) or "blocks" (the key blocks each block of children needs,
    #: per head, ``structattn.block_sparse``: a prior whose log weight separates as g_i + h_j)
    certificate: str = "window"

    # -- what a subclass states -------------------------------------------------
    def support(self, num_children: int, num_parents: int) -> Support:
        """Φ_i for C children and P parents (default: every parent)."""
        return AllParents()

    def log_weight(self, child: torch.Tensor, parent: torch.Tensor, sizes: tuple[int, int]):
        """Unnormalised log p(φ_i = j) at long index tensors ``child``, ``parent`` (they
        broadcast; the prior's own leading dims — heads, batch — come first), for ``sizes``
        = (C, P); −∞ also excludes a parent. None: uniform on the support."""
        return None

    def check_nodes(self, family: str, children, parents) -> None:
        """Raise a ``ValueError`` naming ``family`` where this prior cannot relate these node
        sets (called when the family is declared); by default any two will do."""

    def describe(self) -> str:
        return type(self).__name__

    def edge_factor(self, potential, children, parents, index, none):
        """Pyro's reading of one potential at the chosen edges: the ``pyro.factor`` of the
        family's site. ``index``: the chosen parents, broadcastable to ``(*batch, H, C)``
        (enumeration dims first; with the "no parent" outcome, P means none and ``none``
        is the boolean of where it was chosen, else None). Default: ψ at the chosen parent
        (``potential.at``, from its own definition), 0 where there is none."""
        psi = potential.at(children, parents,
                           index if none is None else index.clamp(max=parents.shape[-2] - 1))
        return psi if none is None else psi.masked_fill(none, 0.0)

    # -- what the compiled reading uses (derived; overriding is an optimisation) ----------
    def log_table(self, num_children: int, num_parents: int, device, dtype) -> torch.Tensor | None:
        """Dense log weights ``(…, C, P)`` in ``dtype`` (None: the prior's own), or None for
        a uniform prior: ``log_weight`` on the grid. A prior may return the same numbers
        faster (e.g. its logits tensor itself); the prior tests check that it does."""
        w = self.log_weight(*grid(num_children, num_parents, device), (num_children, num_parents))
        return w if w is None or dtype is None else w.to(dtype)

    def terms(self, num_children: int, num_parents: int, device):
        """``(g, h)`` with ``log_weight(i, j) = g_i + h_j`` on the support — ``g (…, C)``,
        ``h (…, P)`` — when the prior's log weights separate so (a difference of per-token
        terms: ALiBi under j ≤ i, a forget gate's cumulative sum), else None. The dense
        operator then lowers the prior as one extra query/key dimension carrying ``h`` (``g``
        is constant along a child's row and drops out of its softmax): plain SDPA, never a
        C×P bias. The prior tests check ``g_i + h_j`` against ``log_weight`` for every prior
        that states it."""
        return None

    def reading(self, support: Support) -> type:
        """The operator class that marginalises a family under this prior: the support's
        (``Support.operator``; the dense operator when it names none)."""
        return support.operator or DenseOperator

    # -- certified truncation (a prior's ``tol``: ``structattn.certified``) ------------------
    # A prior over the past, j ≤ i (or j < i), whose log weight falls with the distance
    # d = i − j states these so that the compiled reading may read only a band of recent
    # parents, with the posterior mass beyond it certified ≤ tol per child.
    def log_by_distance(self, window: int, device, dtype) -> torch.Tensor | None:
        """``(heads or 1, window + 1)``: the log weight at each distance d = 0..window, when
        it depends on d alone (a stationary prior: ALiBi, a generalised Gaussian, the
        beta-geometric); None otherwise (a forget gate's depends on the tokens between)."""
        return None

    def log_weights_on_band(self, layout, width: int, first: int, device, dtype,
                            blocks: slice = slice(None)):
        """The log weights at a band's (child i, parent i − d) pairs (``structattn.band``
        layout over N = ``layout.n`` tokens, children and parents alike) for ``first`` ≤ d ≤
        min(``width``, i), −∞ at every other slot: ``(…, nb, B, L)`` in ``dtype`` (``blocks``:
        those blocks only). From the distance table when the prior states one, else from
        ``log_weight`` at the pairs."""
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
        broadcastable to ``(*batch, heads, N)``; −∞ where there are none. Default, for a
        stationary prior: its distance table summed from width + 1 to the longest distance
        N − 1 (a child's own past ends sooner: an upper bound)."""
        table = self.log_by_distance(num_tokens - 1, device, dtype)
        if table is None:
            raise NotImplementedError(
                f"{type(self).__name__} states neither log_by_distance nor log_tail_mass: "
                f"certified truncation needs the prior's weight beyond a window")
        if width + 1 >= num_tokens:
            return torch.full_like(table[:, :1], float("-inf"))
        beyond = torch.logcumsumexp(table.flip(-1), -1).flip(-1)  # [d]: log Σ_{d' ≥ d}
        return beyond[:, width + 1:width + 2]  # (H|1, 1)

    def hyper_prior(self) -> str | None:
        """A hyper-prior over the prior's parameters, as drawn in plate notation (one line
        per statement), or None when it has none."""
        return None

    def tables(self, num_children: int, num_parents: int, device) -> PriorTables:
        """This prior's tables for one edge family in one pass, each built at most once.
        The caller holds them for the pass; nothing is stored on the prior."""
        return PriorTables(self, num_children, num_parents, device)

    def short_support(self, num_children: int = 2, num_parents: int = 2) -> str:
        return self.support(num_children, num_parents).describe()
