"""A support kind: which parents each child may choose (``Support``), and the attention
operator that lowers it (``Operator``).

A prior states its support once, as data: a ``Support`` object whose ``contains(child,
parent)`` *is* the definition, Φ_i = {j : contains(i, j)}, evaluated pointwise on index
tensors. Every reading derives from that statement:

- Pyro's reading (the oracle) evaluates ``contains`` on the (child, parent) grid and masks
  the ``Categorical`` logits with it — nothing else;
- the compiled reading builds the support's ``operator`` (``Support.operator``; the dense
  operator when a kind names none), which may represent the same set in its own efficient
  form (``is_causal``, an edge list, a band). A test checks, for every support kind and
  prior, that the two agree.

An operator, for the posterior P (``(*batch, H, C, P)``, P_ij = p(φ_i = j | x)), offers

- ``attend(u) = P u`` and ``adjoint(u) = Pᵀ u`` (u: ``(*batch, H, P or C, d)``);
- ``mass() = Pᵀ 1`` ``(*batch, H, P, 1)``;
- ``log_partition()`` = log Σ_j exp(ψ_ij) p(φ_i = j) per child, ``(*batch, H, C)``;
- ``posterior()`` in the kind's layout and ``dense_posterior()`` ``(*batch, H, C, P)``.

The base class gives every one of them from the dense twin (``dense_twin()``, a
``DenseOperator`` over ``contains``), so a new kind is correct everywhere — single-shot
values, latent node sets, drawings, ``compare`` — as soon as it states ``contains``, and
fast wherever its operator overrides a method.
"""

from __future__ import annotations

import torch

from .lowered import Lowering


def grid(num_children: int, num_parents: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Every (child, parent) index pair, as two long tensors that broadcast to ``(C, P)``.

    The grid a support's ``contains`` and a prior's ``log_weight`` are evaluated on.

    Args:
        num_children (int): C, the number of children.
        num_parents (int): P, the number of parents.
        device (torch.device | str | None): where to build the indices.

    Returns:
        The child indices ``(C, 1)`` and the parent indices ``(1, P)``.

    Example:
        >>> from structattn.kinds import Causal, grid
        >>> i, j = grid(2, 3, "cpu")
        >>> i.shape, j.shape
        (torch.Size([2, 1]), torch.Size([1, 3]))
        >>> Causal().contains(i, j).tolist()
        [[True, False, False], [True, True, False]]
    """
    return (torch.arange(num_children, device=device)[:, None],
            torch.arange(num_parents, device=device)[None, :])


def keep_nonfinite_rows(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """NaN where a fused kernel's output ``out`` ``(…, C, d_v)`` may have turned non-finite
    scores into zeros. The CPU's fused SDPA kernels read a row whose scores are all NaN as a row
    without parents and return 0 there, a plausible number; with the value checks off
    (``structattn.validation(False)``) a NaN must come out as NaN. (With them on, the inputs
    were checked and so were the parameters, once per change: ``structattn.compiling.replay``.) Such a
    row has a non-finite
    child factor ``a`` ``(…, C, d_k)`` — that row becomes NaN — or reads only parents with a
    non-finite factor ``b`` ``(…, P, d_k)`` — then every row of that batch element and head
    becomes NaN (rows reading a finite parent too are NaN from the kernel already; rows reading
    no bad parent, e.g. before it under a causal support, are NaN too: a cheap bound).

    No check and no host sync: ``out + 0·(Σ_k a_ik + Σ_jk b_jk)``, two sums (accumulated in
    float32 for half precision, so that no finite sum overflows) and two adds, in place when
    no gradient flows — O(C·d_k + P·d_k + C·d_v) beside the kernel's O(C·P·d), nothing in the
    backward."""
    if out.device.type != "cpu":  # CUDA's fused kernels return NaN for NaN scores
        return out  # (tests/test_cuda.py): no carrier, which would cost 3 launches a call
    acc = torch.float32 if a.dtype in (torch.float16, torch.bfloat16) else a.dtype
    rows = a.detach().sum(-1, keepdim=True, dtype=acc)
    rows = rows + b.detach().sum((-2, -1), keepdim=True, dtype=acc)
    if rows.dtype != out.dtype:  # half precision: 0 (or NaN) before the cast, which could overflow
        rows = (rows * 0).to(out.dtype)
    # in place where no backward will read the kernel's output (inference): no new C×d_v tensor
    return out.add(rows, alpha=0) if out.requires_grad else out.add_(rows, alpha=0)


class Support:
    """Base class of support kinds: Φ_i ⊆ {0, …, P − 1}, the parents child i may choose.

    A subclass states ``contains(child, parent)``, the definition; it may also name the
    ``Operator`` subclass that lowers it (``operator``) and give its dense mask faster than
    the grid (``dense``). Supports intersect with ``&`` (``Intersection``) and unite with
    ``|`` (``Union``). The base class takes no constructor arguments.

    Attributes:
        operator (type | None): the ``Operator`` subclass lowering this kind, a class
            attribute (a prior's ``reading`` may choose another). None (default):
            ``DenseOperator``, one masked SDPA call.
    """

    operator: type | None = None

    def contains(self, child: torch.Tensor, parent: torch.Tensor) -> torch.Tensor:
        """Boolean: whether parent j is in Φ_i, for long index tensors that broadcast (e.g.
        ``(C, 1)`` and ``(1, P)``, or ``(E,)`` and ``(E,)``); leading dims of the support's
        own data (a mask's batch and heads) come first."""
        raise NotImplementedError(
            f"support kind {type(self).__name__} must state contains(child, parent): the set "
            f"of parents each child may choose")

    def dense(self, num_children: int, num_parents: int, device) -> torch.Tensor | None:
        """Boolean ``(…, C, P)`` mask for the dense lowering, or None for 'every parent'.
        Default: ``contains`` on the grid."""
        return self.contains(*grid(num_children, num_parents, device))

    def is_causal(self) -> bool:
        """Whether this support is exactly j ≤ i (SDPA's fused ``is_causal`` path)."""
        return False

    def __and__(self, other: Support) -> Support:
        return Intersection(self, other)

    def __or__(self, other: Support) -> Support:
        return Union(self, other)

    def describe(self) -> str:
        return type(self).__name__


class Intersection(Support):
    """Φ_i = the parents every part allows (e.g. j ≤ i ∧ a mask); what ``a & b`` gives.

    Lowered by the operator its parts name (at most one does), else by the dense operator.

    Args:
        *parts (Support): the supports to intersect; an ``Intersection`` among them
            contributes its own parts.

    Raises:
        ValueError: parts naming different operators.
    """

    def __init__(self, *parts: Support):
        self.parts = [q for p in parts for q in (p.parts if isinstance(p, Intersection) else [p])]
        named = {type(p).operator for p in self.parts} - {None}
        if len(named) > 1:
            raise ValueError(f"support {self.describe()}: its parts name different operators "
                             f"{sorted(o.__name__ for o in named)}; one support, one operator")
        self.operator = named.pop() if named else None

    def contains(self, child, parent):
        out = self.parts[0].contains(child, parent)
        for p in self.parts[1:]:
            out = out & p.contains(child, parent)
        return out

    def dense(self, num_children, num_parents, device):
        out = None
        for p in self.parts:
            m = p.dense(num_children, num_parents, device)
            out = m if out is None else (out if m is None else out & m)
        return out

    def describe(self):
        return " ∧ ".join(p.describe() for p in self.parts)


class Union(Support):
    """Φ_i = the parents any part allows (e.g. a window ∨ the first g tokens); what ``a | b``
    gives. Lowered by the dense operator (one masked SDPA call): a part's own operator reads
    its set alone.

    Args:
        *parts (Support): the supports to unite; a ``Union`` among them contributes its own
            parts.
    """

    operator = None

    def __init__(self, *parts: Support):
        self.parts = [q for p in parts for q in (p.parts if isinstance(p, Union) else [p])]

    def contains(self, child, parent):
        out = self.parts[0].contains(child, parent)
        for p in self.parts[1:]:
            out = out | p.contains(child, parent)
        return out

    def dense(self, num_children, num_parents, device):
        out = None
        for p in self.parts:
            m = p.dense(num_children, num_parents, device)
            if m is None:  # a part allows every parent: so does the union
                return None
            out = m if out is None else out | m
        return out

    def describe(self):
        return " ∨ ".join(f"({p.describe()})" if isinstance(p, Intersection) else p.describe()
                          for p in self.parts)


class Operator:
    """Base class of attention operators: one edge family's posterior P at the current node
    states, ``attend(u) = P u`` and the rest (module docstring).

    Everything a subclass does not override comes from the dense twin (``dense_twin``), so
    a support kind's operator is correct before it is fast. The lowering builds one for a
    family at its current node states (``Prior.reading`` names the class).

    Args:
        family (EdgeFamily): the edge family (``structattn.family.EdgeFamily``) whose
            posterior it reads, at its node sets' current states.
        cache (dict | None): what does not change while latents move — the prior's tables,
            an observed side's factor — kept across the steps of an iterating reader, one
            dict per family. None (default): a new, empty one.

    Attributes:
        history: what an inference scheme iterated to build this operator
            (``structattn.iterative.scheme``); None for a support kind's closed-form operator.
        kind_name (str): how error messages name this operator's support (e.g.
            ``"an edge-list"``). Default ``"this"``.
    """

    #: the dense lowering every kind falls back on: the subclass declared with
    #: ``dense_twin=True`` (``structattn.kinds.dense.DenseOperator``)
    _dense_twin: type | None = None
    history = None
    kind_name = "this"
    #: how ``lowering`` names this operator's reading
    reading_name = "dense"

    def __init__(self, family, cache: dict | None = None):
        self.family = family
        self.cache = {} if cache is None else cache
        self._twin = None

    def _const(self, key, fn):
        if key not in self.cache:
            self.cache[key] = fn()
        return self.cache[key]

    # -- the score factors: ψ_ij = scale·⟨a_i, b_j⟩ ---------------------------------------
    def factors(self, potential):
        """``(a, b, scale)`` of a factorised potential; an observed side's half is computed
        once per forward (when the potential states its halves separately)."""
        f = self.family
        if not potential.is_split:
            return potential.factors(f.children.states, f.parents.states)
        k = id(potential)
        a = (self._const(("a", k), lambda: potential.child_factor(f.children.states))
             if f.children.observed else potential.child_factor(f.children.states))
        b = (self._const(("b", k), lambda: potential.parent_factor(f.parents.states))
             if f.parents.observed else potential.parent_factor(f.parents.states))
        return a, b, potential.factor_scale()

    def fused_factors(self):
        """``(a, b, scale)`` of the family's one factorised potential with ``scale`` a float,
        as the fused kernels take it: a tensor (learnable) temperature — one, or one per head
        (an ``(H, 1, 1)`` scale) — is folded into ``a``.
        Refused with a clear error when the family has not exactly one factorised potential."""
        f = self.family
        if not self.is_fused():
            raise NotImplementedError(
                f"edge family {f.name!r}: {self.kind_name} support needs exactly one factorised "
                f"potential (ψ = ⟨a_i, b_j⟩·scale, e.g. Bilinear) for {type(self).__name__}; got "
                f"{[type(p).__name__ for p in f.potentials]}")
        a, b, scale = self.factors(f.potentials[0])
        if isinstance(scale, torch.Tensor):
            a, scale = a * scale.to(a.dtype), 1.0
        return a, b, float(scale)

    def is_fused(self) -> bool:
        """Whether the family has exactly one factorised potential (the fused kernels apply)."""
        pots = self.family.potentials
        return len(pots) == 1 and pots[0].is_factorised

    def __init_subclass__(cls, *, dense_twin: bool = False, **kwargs):
        super().__init_subclass__(**kwargs)
        if dense_twin:
            Operator._dense_twin = cls

    # -- the operator: by default, the dense twin's ------------------------------------------
    def dense_twin(self):
        """The dense operator of the same family (shares this operator's cache)."""
        if self._twin is None:
            dense = Operator._dense_twin
            self._twin = self if isinstance(self, dense) else dense(self.family, self.cache)
        return self._twin

    def posterior(self) -> torch.Tensor:
        """p(φ_i = j | x) in this kind's layout (dense ``(*batch, H, C, P)`` by default)."""
        return self.dense_posterior()

    def dense_posterior(self) -> torch.Tensor:
        """p(φ_i = j | x), ``(*batch, H, C, P)``; all-zero rows for parentless children."""
        return self.dense_twin().dense_posterior()

    def layout(self, dense: torch.Tensor) -> torch.Tensor:
        """A dense ``(…, C, P)`` posterior in this kind's layout (``posterior()``'s)."""
        return dense

    def attend(self, u: torch.Tensor) -> torch.Tensor:
        return self.dense_twin().attend(u)

    def adjoint(self, u: torch.Tensor) -> torch.Tensor:
        return self.dense_twin().adjoint(u)

    def mass(self) -> torch.Tensor:
        return self.dense_twin().mass()

    def log_partition(self) -> torch.Tensor:
        return self.dense_twin().log_partition()

    def lowering(self):
        """How this operator read its family in this call: a ``kinds.lowered.Lowering``
        naming ``reading_name`` and the family's size, or its dense twin's where it read
        through it (the dense operator names the path it took, and why a dense one was
        dense)."""
        if self._twin is not None and self._twin is not self:  # it read through its twin
            return self._twin.lowering()
        f = self.family
        return Lowering(self.reading_name, None, (f.children.size, f.parents.size))

    def reports(self) -> dict:
        """What this operator reports in the trace (``Trace`` field → this family's entry),
        e.g. certified truncation's window or a stick-breaking family's leftover mass."""
        return {}
