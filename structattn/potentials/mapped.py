"""A potential on transformed node states: ψ'(x_j, x_i) = ψ(g(x_j), f(x_i))."""

from __future__ import annotations

from ..nodes import NodeSet
from .base import Potential


class Mapped(Potential):
    """``ψ'(x_j, x_i) = ψ(g(x_j), f(x_i))``: a potential ψ on transformed node states.

    E.g. a LayerNorm and a biased projection (the original slot attention:
    ``q = to_q(LayerNorm(z))``). The closed-form expected gradient of the base potential
    does not survive a nonlinear map, so a latent side is differentiated by autograd and has
    no CCCP update; observed sides are still mapped once per forward by the iterative
    engine. It has the base potential's heads.

    Args:
        base (Potential): ψ, the potential evaluated on the mapped states.
        children (Callable | None): f, any differentiable map of the children's states
            ``(*batch, C, d)``. None (default): the identity.
        parents (Callable | None): g, any differentiable map of the parents' states
            ``(*batch, P, d)``. None (default): the identity.

    Raises:
        ValueError: ``base`` not a ``Potential``, or a map that is neither callable nor None.
    """

    def __init__(self, base: Potential, *, children=None, parents=None):
        if not isinstance(base, Potential):
            raise ValueError(f"Mapped potential: base must be a structattn Potential; got "
                             f"{type(base).__name__}")
        for what, f in (("children", children), ("parents", parents)):
            if f is not None and not callable(f):
                raise ValueError(f"Mapped potential: {what} must be a callable or None; got "
                                 f"{type(f).__name__}")
        self.base, self.heads = base, base.heads
        self.f = (lambda x: x) if children is None else children
        self.g = (lambda x: x) if parents is None else parents

    @property
    def is_factorised(self) -> bool:
        return self.base.is_factorised

    @property
    def is_split(self) -> bool:
        return self.base.is_split

    def child_factor(self, children):
        return self.base.child_factor(self.f(children))

    def parent_factor(self, parents):
        return self.base.parent_factor(self.g(parents))

    def factor_scale(self):
        return self.base.factor_scale()

    def factors(self, children, parents):
        return self.base.factors(self.f(children), self.g(parents))

    def pairwise(self, children, parents):
        return self.base.pairwise(self.f(children), self.g(parents))

    def at(self, children, parents, index):
        return self.base.at(self.f(children), self.g(parents), index)

    def validate(self, family, children, parents):
        # the maps' output shapes, from one node each (not a pass over every node)
        mc = NodeSet(children.name, self.f(children.states[..., :1, :]), children.observed)
        mp = NodeSet(parents.name, self.g(parents.states[..., :1, :]), parents.observed)
        self.base.validate(family, mc, mp)

    def describe(self) -> str:
        return f"Mapped({self.base.describe()})"
