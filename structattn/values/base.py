"""Value functions v_i(x, φ): what child i predicts given the edges.

Three readings:

- ``parent_values(parents)`` — ``(*batch, H, P, d_v)`` — for values that depend on the
  chosen parent only, v_i(x, φ_i = j) = g(x_j);
- ``expectation(attend, children, parents)``: E_{p(φ|x)}[v_i] given the family's
  attention operator ``attend(u)_i = Σ_j p(φ_i = j | x) u_j`` (``u``: ``(*batch, H, P, d)``);
  the default is ``attend(parent_values(parents))``, one SDPA call;
- ``pyro_value(edge)``: the Pyro reading at the sampled/enumerated edge. It emits
  value *terms* (``value_term``): deterministic sites whose sum is the value, each
  depending on one edge site, so ground truth is Σ_terms E_{Pyro marginal}[term].
"""

from __future__ import annotations

import torch

from ..heads import gather_parents


def value_term(name: str, value: torch.Tensor, *, family: str, edge: str | None,
               weight: float = 1.0) -> torch.Tensor:
    """Record ``weight · value`` as a term of ``family``'s value that depends on one edge site.

    A deterministic Pyro site (masked out of the log density) tagged with the family and
    the edge, so that ground truth is Σ_terms E_{Pyro marginal}[term] (module docstring).
    Called by a value's ``pyro_value``.

    Args:
        name (str): the term's Pyro site name, unique in the model (e.g. ``"attn.value"``).
        value (torch.Tensor): the term, ``(…, d)`` (its last dim is the event dim), e.g. the
            chosen parents' values ``(*batch, H, C, d_v)``.
        family (str): the name of the edge family whose value it is part of.
        edge (str | None): the edge site the term depends on (the family's, or a hop's);
            None: on no edge.
        weight (float): the term's weight. Default 1.

    Returns:
        ``weight · value``, the tensor recorded.
    """
    import pyro
    import pyro.distributions as dist

    value = value * weight
    # A tensor mask, not mask(False): Pyro's mask(False) log-prob is a float32 zero whatever
    # the value's dtype, which breaks float64 enumeration once a term joins a contraction.
    off = torch.zeros((), dtype=torch.bool, device=value.device)
    pyro.sample(name, dist.Delta(value, event_dim=1).mask(off), obs=value,
                infer={"_deterministic": True,
                       "structattn_term": {"family": family, "edge": edge}})
    return value


class Value:
    """Base class of value functions v_i(x, φ): what child i predicts given the edges.

    A subclass states ``parent_values`` for a value of the chosen parent alone (the
    expectation is then one attention call), or overrides ``expectation`` and
    ``pyro_value`` (module docstring); ``validate`` refuses node sets it cannot read. The
    base class takes no constructor arguments.

    Attributes:
        heads (int): how many heads the value has, H in ``(*batch, H, P, d_v)``; a class
            attribute or set by the constructor. Default 1.
        single_edge (bool): whether v_i depends on φ_i alone, not on a walk of several edges
            (``Hops``: False). Default True.
    """

    heads: int = 1
    single_edge: bool = True

    def parent_values(self, parents: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must define parent_values")

    def at(self, children, parents, index):
        return gather_parents(self.parent_values(parents), index)

    def expectation(self, attend, children: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        return attend(self.parent_values(parents))

    def pyro_value(self, edge) -> torch.Tensor:
        fam = edge.family
        v = self.at(fam.children.states, fam.parents.states, edge.index)
        if edge.none is not None:  # "no parent": a zero value
            v = v * (~edge.none).to(v.dtype)[..., None]
        with fam.plates():
            return value_term(f"{fam.name}.value", v, family=fam.name, edge=fam.name)

    def validate(self, family: str, children, parents) -> None:
        pass

    def describe(self) -> str:
        return type(self).__name__
