"""Closed-form marginalisation of one edge family: E_{p(φ_i|x)}[v_i(x, φ_i)].

A family's attention operator ``attend(u)_i = Σ_j p(φ_i = j | x) u_j`` is built once per
family from its prior's statement: the prior's ``reading`` of its support, the support
kind's ``Operator`` (``structattn.kinds``: dense, edge list, window, or a kind of one's
own) — or, for a family declared with an inference scheme (``structattn.iterative.scheme``, e.g.
mean-field windows), the scheme's operator at its fixed point. The same operator serves
single-shot values, the iterating reader (``structattn.iterative.iterate``), drawings and
``compare``; the value function turns it into E[v] (one call for a linear value, K calls
for K hops).

Each function takes an edge family (``structattn.family.EdgeFamily``) as ``family``, read by
its attributes (its prior, support, value, node sets and inference scheme): ``family`` is in
a layer above this one (``DESIGN.md``: "Layers: imports only downward"), so it is not
imported here.
"""

from __future__ import annotations

import torch

from ..kinds.base import Operator


def operator_for(family, cache: dict | None = None, *, record: bool = False) -> Operator:
    """The family's operator at the current node states (``cache``: what an iterating reader
    keeps across steps; ``record``: an inference scheme keeps its history in the operator's
    ``history``)."""
    if family.inference is not None:
        return family.inference.operator(family, record=record)
    cls = family.prior.reading(family.support)
    if not (isinstance(cls, type) and issubclass(cls, Operator)):
        raise ValueError(f"edge family {family.name!r}: support {family.support.describe()} "
                         f"names operator {cls!r}, which is not a structattn.kinds.Operator "
                         f"subclass")
    return cls(family, cache)


def posterior(family) -> torch.Tensor:
    """p(φ_i = j | x): ``(*batch, H, C, P)``; rows sum to one over the support (all-zero
    rows for children without parents under ``empty="zero"``)."""
    return operator_for(family).dense_posterior()


def expectation(family, operator: Operator, *, want_posterior: bool = False):
    """``(E[v], posterior or None)`` of a complete family (``check_complete``) through its
    ``operator`` (``operator_for``, or the iteration's at the final states).

    The posterior is in the operator's layout: dense ``(*batch, H, C, P)``, or per edge
    ``(*batch, H, E)`` for an edge list.
    """
    out = family.value.expectation(operator.attend, family.children.states,
                                   family.parents.states)
    return out, (operator.posterior() if want_posterior else None)
