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
from ..kinds.window import WindowOperator
from .tables import PriorTables


class Prior:
    r"""Base class of edge priors $p(φ_i = j)$: a support $Φ_i$ and log weights $w_{ij}$ on it.

    A subclass states ``support`` and ``log_weight`` (module docstring); every other hook
    has a default derived from them. A prior over the distance i − j (a band, certified
    truncation) is a ``structattn.priors.DistancePrior``, which adds its own hooks. The base
    class takes no constructor arguments; a subclass sets the attributes below where it
    departs from their defaults.

    Attributes:
        empty (str): what a child with no allowed parent gets: ``"error"`` (refused with a
            ValueError while validating) or ``"zero"`` (a zero value and an all-zero posterior
            row); read by the tables, the family's outcomes and every reading. Default
            ``"error"``.
        leftover (bool): whether "no parent" is an outcome of every child (weighted like one
            more parent under a uniform prior; its value is zero), not only of children
            without parents; read by the family and Pyro's reading (``declared_log_prior``).
            Default False (``StickBreaking``: True).
        max_potentials (int | None): the most potentials a family under this prior takes,
            checked when a potential is added; None: any number. Default None
            (``StickBreaking``: 1).
        tol (float | None): a tolerance the prior's own reading may spend: a distance prior's
            certified posterior mass outside its window (``DistancePrior``), stick-breaking's
            leftover stick that stops a scan; read by their operators and by
            ``structattn.export``, which refuses a certified window. None (default): none.
    """

    empty: str = "error"
    leftover: bool = False
    max_potentials: int | None = None
    tol: float | None = None

    # -- what a subclass states -------------------------------------------------
    def support(self, num_children: int, num_parents: int) -> Support:
        """Φ_i for C children and P parents, a ``structattn.kinds`` ``Support``; read by the
        tables (the compiled reading) and Pyro's reading (its ``contains``). Default: every
        parent."""
        return AllParents()

    def log_weight(self, child: torch.Tensor, parent: torch.Tensor, sizes: tuple[int, int]):
        """Unnormalised log p(φ_i = j) at long index tensors ``child``, ``parent`` (they
        broadcast; the prior's own leading dims — heads, batch — come first), for ``sizes``
        = (C, P); −∞ also excludes a parent. Read by Pyro's reading and ``log_table``.
        Default None: uniform on the support."""
        return None

    def check_nodes(self, family: str, children, parents) -> None:
        """Raise a ``ValueError`` naming ``family`` where this prior cannot relate these node
        sets; called by the family's validation, before the tables'. Default: any two will
        do."""

    def describe(self) -> str:
        """One line naming the prior, read by error messages, ``Family.describe`` and the
        drawings. Default: the class name."""
        return type(self).__name__

    def edge_factor(self, potential, children, parents, index, none):
        """Pyro's reading of one potential at the chosen edges: the ``pyro.factor`` of the
        family's site (called by Pyro's reading for each potential). ``index``: the chosen
        parents, broadcastable to ``(*batch, H, C)`` (enumeration dims first; with the "no
        parent" outcome, P means none and ``none`` is the boolean of where it was chosen,
        else None). Default: ψ at the chosen parent (``potential.at``, from its own
        definition), 0 where there is none (stick-breaking reads its break decisions)."""
        psi = potential.at(children, parents,
                           index if none is None else index.clamp(max=parents.shape[-2] - 1))
        return psi if none is None else psi.masked_fill(none, 0.0)

    # -- what the compiled reading uses (derived; overriding is an optimisation) ----------
    def log_table(self, num_children: int, num_parents: int, device, dtype) -> torch.Tensor | None:
        """Dense log weights ``(…, C, P)`` in ``dtype`` (None: the prior's own), or None for
        a uniform prior; read by the tables (``PriorTables.table``). Default: ``log_weight``
        on the grid. A prior may return the same numbers faster (e.g. its logits tensor
        itself); the prior tests check that it does."""
        if type(self).log_weight is Prior.log_weight:  # uniform on its support: no grid
            return None
        w = self.log_weight(*grid(num_children, num_parents, device), (num_children, num_parents))
        return w if w is None or dtype is None else w.to(dtype)

    def weights_from_log_weight(self) -> bool:
        """Whether ``log_table`` is the base one, ``log_weight`` evaluated on the grid (not a
        prior's own tensor nor a distance prior's diagonals): such a prior's weights may be
        evaluated a block of children at a time instead (``PriorTables.by_rows``)."""
        return type(self).log_table is Prior.log_table

    def terms(self, num_children: int, num_parents: int, device):
        """``(g, h)`` with ``log_weight(i, j) = g_i + h_j`` on the support — ``g (…, C)``,
        ``h (…, P)`` — when the prior's log weights separate so (a difference of per-token
        terms: ALiBi under j ≤ i, a forget gate's cumulative sum); read by the tables
        (``PriorTables.separable``). The dense and window operators then lower the prior as
        one extra query/key dimension carrying ``h`` (``g`` is constant along a child's row
        and drops out of its softmax): plain SDPA or the fused key-bias kernel, never a C×P
        bias. Default None (they do not separate). The prior tests check ``g_i + h_j``
        against ``log_weight`` for every prior that states it."""
        return None

    def log_at_offsets(self, num_children: int, num_parents: int, device, causal: bool):
        """``(table, lowest)`` when the log weight depends on the offset d = i − j alone, child
        i at position i among the parents: ``log_weight(i, j) = table[…, i − j − lowest]``,
        ``table (heads or 1, n)`` over d = ``lowest`` … C − 1, with ``lowest`` 0 (``causal``:
        the support j ≤ i) or −(P − 1) (every parent). Read by the tables
        (``PriorTables.offsets``) for a support of every parent or j ≤ i: a kernel then looks
        the bias up per tile of scores (``kinds.distance_table``), never a C×P table, and
        checks the table in O(C + P). Default None (the weight is not stationary). The prior
        tests check the table against ``log_weight`` for every prior that states it."""
        return None

    def distance_shape(self):
        """``(μ, s, β)``, each a tensor ``()`` or ``(heads,)``, when the log weight is
        −|(i − j − μ)·e^s|^β with child i at position i among the parents (the generalised
        Gaussian): a kernel then computes it per block of scores from the pairs' distances
        (``kinds.distance_kernel``), never a C×P table. Default None."""
        return None

    def reading(self, support: Support) -> type:
        """The operator class that marginalises a family under this prior, called by the
        lowering: the support's (``Support.operator``; the dense operator when it names
        none). Default so, except a ``Window``'s banded operator, which reads a
        ``DistancePrior``'s band hooks: any other prior on a window is read densely."""
        operator = support.operator or DenseOperator
        return DenseOperator if operator is WindowOperator else operator

    def hyper_prior(self) -> str | None:
        """A hyper-prior over the prior's parameters, as drawn in plate notation (one line
        per statement), read by the model drawing; default None (it has none)."""
        return None

    def tables(self, num_children: int, num_parents: int, device) -> PriorTables:
        """This prior's tables for one edge family in one pass, each built at most once;
        called when the family is made. The caller holds them for the pass; nothing is
        stored on the prior. Default: the generic ``PriorTables``."""
        return PriorTables(self, num_children, num_parents, device)

    def short_support(self, num_children: int = 2, num_parents: int = 2) -> str:
        """The support in a few words, read by the priors' ``describe``. Default: the
        support's own ``describe`` at C × P."""
        return self.support(num_children, num_parents).describe()
