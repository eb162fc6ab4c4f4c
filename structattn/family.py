"""Edge families: one categorical edge variable φ_i per child, over its allowed parents.

``edges(name, children, parents, prior)`` is the declaration's edge site. Read by plain
Pyro (``structattn.reading.PYRO``, when no other reading is entered) it *is* a
``pyro.sample`` site of a ``Categorical`` over parents inside plates ``(*batch, heads,
children)``, marked for parallel enumeration; its potentials become ``pyro.factor`` sites
and its value v_i(x, φ_i) at the sampled φ a deterministic site (``values.value_term``).
Under another reading (the compiled ``Marginalise``, ``TraceStructure``) the same call
returns that reading's handle instead and nothing is sampled.

::

    parents  x_1   x_2  …  x_P
               \\    |     /        φ_i ∈ Φ_i ⊆ {1..P},  p(φ_i = j) = prior
    children       x_i              ψ(x_{φ_i}, x_i) = potential, v_i(x, φ_i) = value
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch

from . import reading
from .checking._validation import same_device, shape_str
from .iterative.scheme import InferenceScheme
from .kinds.base import Support
from .nodes import NodeSet
from .potentials.base import Potential
from .priors.base import Prior
from .priors.declared import declared_log_prior
from .priors.tables import PriorTables
from .values.base import Value


@dataclass(eq=False)
class EdgeFamily:
    """The IR of one edge family: φ = (φ_i)_{i∈children}, one per head.

    ``structattn.edges`` builds it and checks it (``validate_structure``); a reader records it,
    e.g. ``structattn.trace_structure(...).families[name]``.

    Attributes:
        name: the family's name, unique in the model (its Pyro site).
        children: the node set whose C tokens each choose a parent, states
            ``(*batch, C, d)``.
        parents: the node set chosen from, P tokens, states ``(*batch, P, d)`` (the same batch
            dims as ``children``).
        prior: p(φ_i = j), a ``structattn.priors.Prior`` (its support and log weights).
        heads: independent edge variables per child, one per head (default 1).
        potentials: the ``structattn.potentials.Potential`` terms declared so far, in order
            (``structattn.potential``); empty until one is declared.
        value: the ``structattn.values.Value`` declared by ``structattn.value``; None until
            then.
        inference: how the compiled reader marginalises the family (``structattn.iterative.scheme``);
            None: exactly.
        tables: the prior's ``PriorTables`` for these node sets in this pass, built from
            ``prior`` when the family is made.
    """

    name: str
    children: NodeSet
    parents: NodeSet
    prior: Prior
    heads: int = 1
    potentials: list = field(default_factory=list)
    value: Value | None = None
    #: how the compiled reader marginalises it (``structattn.iterative.scheme``); None: exactly
    inference: InferenceScheme | None = None
    _heads_plate: object = field(default=None, repr=False)
    #: the prior's tables for this family, this pass (built on demand, each at most once)
    tables: PriorTables = field(init=False, repr=False)

    def __post_init__(self):
        self.tables = self.prior.tables(self.children.size, self.parents.size,
                                        self.children.states.device)

    @property
    def outcomes(self) -> int:
        """How many values φ_i takes in Pyro's reading: the P parents, and "no parent" when the
        prior lets a child have none (``empty="zero"``, or ``leftover``: every child)."""
        return self.parents.size + (self.prior.empty == "zero" or self.prior.leftover)

    @property
    def support(self):
        """The prior's support for these node sets (a ``structattn.kinds`` ``Support``)."""
        return self.tables.support

    @property
    def batch_shape(self) -> torch.Size:
        return self.children.batch_shape

    @property
    def plate_nesting(self) -> int:
        """Plates ``(*batch, heads, children)``."""
        return len(self.batch_shape) + 2

    def plates(self) -> contextlib.ExitStack:
        """The Pyro plates of this family's edge variables, (*batch, heads, children)."""
        import pyro

        if self._heads_plate is None and self.heads > 1:  # size-1 plates: see NodeSet.plates
            self._heads_plate = pyro.plate(f"{self.name}.heads", self.heads, dim=-2)
        stack = contextlib.ExitStack()
        for plate in self.children.plates(event_dims=1):
            stack.enter_context(plate)
        if self._heads_plate is not None:
            stack.enter_context(self._heads_plate)
        return stack

    def keep(self) -> torch.Tensor | None:
        """``(…, C, 1)`` 0/1 factor zeroing children without parents (``empty="zero"``) in the
        compiled reading: their value and posterior row are zero; None when no child can be
        empty. (Pyro's reading gives them a "no parent" outcome of its own.)"""
        xc = self.children.states
        empty = self.tables.empty_children()
        return None if empty is None else (~empty).to(xc.dtype)[..., None]

    def describe(self) -> str:
        scheme = "" if self.inference is None else f", read by {self.inference.describe()}"
        return (f"φ {self.name!r}: {self.parents.name} → {self.children.name}, "
                f"prior {self.prior.describe()}, heads={self.heads}{scheme}")

    def pyro_sample(self) -> SampledEdge:
        """Pyro's reading (``structattn.reading.PYRO``): φ a ``pyro.sample`` site."""
        return _sample_edges(self)

    def validate_structure(self) -> None:
        c, p = self.children.states, self.parents.states
        if c.shape[:-2] != p.shape[:-2]:
            raise ValueError(
                f"edge family {self.name!r}: children {self.children.name!r} and parents "
                f"{self.parents.name!r} must share batch dims; got {shape_str(c.shape)} and "
                f"{shape_str(p.shape)} (batch {shape_str(c.shape[:-2])} vs "
                f"{shape_str(p.shape[:-2])})"
            )
        if not same_device(c.device, p.device):
            raise ValueError(
                f"edge family {self.name!r}: children {self.children.name!r} are on {c.device} "
                f"but parents {self.parents.name!r} are on {p.device}"
            )
        if c.dtype != p.dtype:
            raise ValueError(
                f"edge family {self.name!r}: children {self.children.name!r} have dtype "
                f"{c.dtype} but parents {self.parents.name!r} have dtype {p.dtype}"
            )
        if type(self.support).contains is Support.contains:
            raise ValueError(f"edge family {self.name!r}: the support {type(self.support).__name__} "
                             f"states no contains(child, parent); a support kind must state "
                             f"which parents each child may choose")
        self.prior.check_nodes(self.name, self.children, self.parents)  # the prior's own words
        self.tables.validate(self.name, batch_shape=self.batch_shape, heads=self.heads)
        if self.inference is not None:
            self.inference.check(self)

    def check_complete(self) -> None:
        """A family to read needs a value and at least one potential."""
        if self.value is None:
            raise ValueError(f"edge family {self.name!r} has no value function")
        if not self.potentials:
            raise ValueError(
                f"edge family {self.name!r} has no potential: declare one with "
                f"structattn.potential(edge, …) before structattn.value(edge, …)")

    def add_potential(self, potential: Potential) -> None:
        if not isinstance(potential, Potential):
            raise ValueError(
                f"edge family {self.name!r}: a potential must be a structattn Potential; got "
                f"{type(potential).__name__}"
            )
        if self.value is not None:
            raise ValueError(
                f"edge family {self.name!r}: potentials must be declared before "
                f"structattn.value(...) — the value is the expectation under the posterior those "
                f"potentials define"
            )
        self._check_heads("potential", potential)
        most = self.prior.max_potentials
        if most is not None and len(self.potentials) >= most:
            raise ValueError(
                f"edge family {self.name!r}: a {type(self.prior).__name__} prior takes at most "
                f"{most} potential(s) ({type(self.prior).__name__}.max_potentials); got another, "
                f"{type(potential).__name__}. Sum them into one potential")
        potential.validate(self.name, self.children, self.parents)
        self.potentials.append(potential)

    def set_value(self, value: Value) -> None:
        if not isinstance(value, Value):
            raise ValueError(
                f"edge family {self.name!r}: a value must be a structattn Value; got "
                f"{type(value).__name__}"
            )
        if self.value is not None:
            raise ValueError(f"edge family {self.name!r} already has a value function")
        self._check_heads("value", value)
        if self.prior.empty == "zero" and not value.single_edge:
            raise ValueError(
                f"edge family {self.name!r}: empty='zero' gives parentless children a zero value, "
                f"which is defined for values of a single edge; a {type(value).__name__} value "
                f"walks on through parentless nodes. Use empty='error' (give every node a parent, "
                f"e.g. a self-loop)"
            )
        value.validate(self.name, self.children, self.parents)
        self.value = value

    def _check_heads(self, what, obj):
        if obj.heads != self.heads:
            raise ValueError(
                f"edge family {self.name!r} has heads={self.heads} but its {what} "
                f"{type(obj).__name__} has heads={obj.heads}"
            )


class SampledEdge:
    """The Pyro reading's handle: φ as sampled (or enumerated) parent indices. A family whose
    prior lets a child have no parent (``empty="zero"``) has one more outcome, φ_i = P, "no
    parent", which is certain for parentless children and impossible for the others; its
    potentials are 0 and its value is zero there."""

    def __init__(self, family: EdgeFamily, index: torch.Tensor, none: torch.Tensor | None = None):
        self.family, self.none, self.chosen = family, none, index
        # the parent index the value reads (clamped at "no parent")
        self.index = index if none is None else index.clamp(max=family.parents.size - 1)

    def add_potential(self, potential):
        import pyro

        fam = self.family
        fam.add_potential(potential)
        # the prior says how a potential enters (ψ at the chosen parent, or e.g. a scan's
        # break decisions)
        psi = fam.prior.edge_factor(potential, fam.children.states, fam.parents.states,
                                    self.chosen, self.none)
        with fam.plates():
            pyro.factor(f"{fam.name}.potential{len(fam.potentials) - 1}", psi)

    def expect(self, value):
        self.family.set_value(value)
        return value.pyro_value(self)


def _sample_edges(family: EdgeFamily) -> SampledEdge:
    """Default (Pyro) reading of an edge site: a ``Categorical`` over the declared prior."""
    import pyro
    import pyro.distributions as dist

    # with a leftover, "no parent" is already an outcome of every child: (…, C, P + 1)
    log_prior, has_parent = declared_log_prior(family, leftover=family.prior.leftover)
    none = family.outcomes > family.parents.size
    if none and not family.prior.leftover:
        # the "no parent" outcome: certain without a parent, impossible with one
        log_none = torch.where(has_parent, float("-inf"), 0.0).to(log_prior.dtype)
        log_prior = torch.cat([torch.where(has_parent[..., None], log_prior, float("-inf")),
                               log_none[..., None]], -1)
    with family.plates():
        if log_prior.shape[-1] == 1:
            # One outcome: φ_i = 0 surely. Observed, since Pyro cannot enumerate a size-1 support.
            index = pyro.sample(family.name, dist.Categorical(logits=log_prior),
                                obs=torch.zeros(log_prior.shape[:-1], dtype=torch.long,
                                                device=log_prior.device))
        else:
            index = pyro.sample(family.name, dist.Categorical(logits=log_prior),
                                infer={"enumerate": "parallel"})
    return SampledEdge(family, index, index == family.parents.size if none else None)


def edges(name: str, children: NodeSet, parents: NodeSet, prior: Prior, *, heads: int = 1,
          inference: InferenceScheme | None = None) -> Any:
    """Declare the edge family ``name``: for each child i (and head), φ_i ~ prior over parents.

    Args:
        name: the family's name, unique in the model (its Pyro site is ``name``).
        children: the node set whose tokens choose a parent (``structattn.nodes``), C tokens.
        parents: the node set chosen from, P tokens.
        prior: p(φ_i = j), a ``structattn.priors.Prior`` (its support and log weights).
        heads: independent edge variables per child, one per head.
        inference: how the compiled module marginalises the family when not exactly
            (``structattn.iterative.scheme``, e.g. ``structattn.windows.MeanFieldWindows()``); Pyro's
            reading is exact whatever it says. None: exactly.

    Returns:
        The family's handle, for ``potential`` and ``value``.

    Raises:
        ValueError: an empty name, node sets not from ``structattn.nodes``, a prior that is
            not a ``Prior``, or one that cannot relate these node sets.

    Example:
        A family of two heads over the tokens' past, as the declaration states it
        (``structattn.compile`` shows the same model compiled):

        >>> import torch, structattn as sa
        >>> def attention(x):
        ...     tokens = sa.nodes("x", x)
        ...     phi = sa.edges("attn", tokens, tokens, sa.priors.Uniform(causal=True), heads=2)
        ...     sa.potential(phi, sa.potentials.DotProduct(heads=2))
        ...     return sa.value(phi, sa.values.Identity(heads=2))
        >>> family = sa.trace_structure(attention, torch.randn(1, 5, 4)).families["attn"]
        >>> family.heads, family.support.describe()
        (2, 'j ≤ i')
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"an edge family needs a non-empty string name; got {name!r}")
    for role, ns in (("children", children), ("parents", parents)):
        if not isinstance(ns, NodeSet):
            raise ValueError(
                f"edge family {name!r}: {role} must be a node set from structattn.nodes(...); "
                f"got {type(ns).__name__}"
            )
    if not isinstance(prior, Prior):
        raise ValueError(
            f"edge family {name!r}: prior must be a structattn prior (e.g. "
            f"structattn.priors.Uniform()); got {type(prior).__name__}"
        )
    if not isinstance(heads, int) or isinstance(heads, bool) or heads < 1:
        raise ValueError(f"edge family {name!r}: heads must be a positive int; got {heads!r}")
    if inference is not None and not isinstance(inference, InferenceScheme):
        raise ValueError(f"edge family {name!r}: inference must be a structattn inference scheme "
                         f"(e.g. structattn.windows.MeanFieldWindows()) or None; got "
                         f"{type(inference).__name__}")
    family = EdgeFamily(name, children, parents, prior, heads, inference=inference)
    family.validate_structure()
    return reading.current_reading().edges(family)


def potential(edge: Any, potential: Potential) -> None:
    """Add the log-potential ψ(x_{φ_i}, x_i) of an edge family (a ``pyro.factor`` site).

    Potentials come before the family's ``structattn.value``; a family takes one or more.

    Args:
        edge: the family's handle, as ``structattn.edges`` returns it.
        potential: a ``structattn.potentials.Potential`` with the family's number of heads:
            its scores ``(*batch, heads, C, P)``, added to the prior's log weights before the
            posterior over φ_i.

    Raises:
        ValueError: ``potential`` is not a ``Potential``, the family already has a value, its
            heads differ from the family's, the prior takes no more potentials
            (``max_potentials``), or the potential's own checks refuse the node sets.
    """
    edge.add_potential(potential)


def value(edge: Any, value: Value) -> torch.Tensor:
    """The value v_i(x, φ_i) of an edge family.

    In the Pyro reading this is the value at the sampled edge; compiled, it is its
    posterior expectation E_{p(φ_i | x)}[v_i(x, φ_i)].

    Args:
        edge: the family's handle (``structattn.edges``).
        value: a ``structattn.values.Value``, what a child receives from its parent.

    Returns:
        ``(*batch, heads, children, d_v)``.
    """
    return edge.expect(value)
