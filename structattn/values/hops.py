"""Multihop value: what a child predicts from a walk along its edges (paper §5.1)."""

from __future__ import annotations

import math

import torch

from ..heads import gather_parents
from ..priors.declared import declared_log_prior
from .base import value_term
from .linear import Linear


class Hops(Linear):
    """``v_i(x, φ) = Σ_k w_k W_V x_{φ^k(i)}``, φ^0(i) = i, φ^k(i) = φ_{φ^{k−1}(i)}: the value of
    a walk of k steps along the edges ⇒ E[v] = Σ_k w_k P^k (V X).

    Compiled, P^k is never formed: attention is applied to the values k times (K SDPA
    calls). Children and parents must be one node set (checked when the family is declared).

    The Pyro reading draws each hop afresh from the posterior edge of the node reached,
    φ^k_i ~ p(φ_{φ^{k−1}_i} | x) (a random walk on the attention graph), for which
    Σ_k w_k P^k V X is exact; ground truth enumerates the walk (φ^1_i, …, φ^K_i) jointly.
    That posterior is built from the prior's log table and each declared potential's own
    ``at`` — the quantities of the family's ``pyro.factor`` sites — never from the
    compiler's score tables (``_edge_log_posterior``).

    Args:
        W_v (torch.Tensor): the value projection W_V, a matrix ``(heads*d_v, d_parent)``, as
            ``Linear``'s.
        weights (Sequence[float]): the hop weights ``(w_0, …, w_K)``, K ≥ 1, finite numbers
            (negative or zero allowed), not all zero. Default ``(0, 1, 1)``: the paper's
            (P + P²)VX; the authors' code uses ``(⅓, ⅓, ⅓)``.
        heads (int): the number of heads, dividing ``W_v``'s rows. Default 1.

    Raises:
        ValueError: a ``W_v`` ``Linear`` refuses, or ``weights`` not a sequence of finite
            numbers, shorter than 2, or all zero.
    """

    single_edge = False

    def __init__(self, W_v: torch.Tensor, weights=(0.0, 1.0, 1.0), *, heads: int = 1):
        super().__init__(W_v, heads=heads)  # W_V and its checks: a Linear value per hop
        try:
            given = tuple(weights)
        except TypeError:
            raise ValueError(f"Hops value: hop_weights must be a sequence (w_0, …, w_K) of finite "
                             f"numbers; got {weights!r}") from None
        bad = [w for w in given if isinstance(w, bool) or not isinstance(w, (int, float))
               or not math.isfinite(w)]
        if bad:
            raise ValueError(f"Hops value: hop_weights must be finite numbers (a weight may be "
                             f"negative or zero); got {bad[0]!r} in {given!r}")
        weights = [float(w) for w in given]
        if len(weights) < 2:
            raise ValueError(f"Hops value: hop_weights must be (w_0, …, w_K) with K ≥ 1; got "
                             f"{weights}")
        if not any(weights):
            raise ValueError(f"Hops value: hop_weights are all zero, so the value would be 0 for "
                             f"every input; got {weights}")
        self.weights = weights

    def expectation(self, attend, children, parents):
        u = self.parent_values(parents)  # (*batch, H, P, d_v): V X
        out = self.weights[0] * u if self.weights[0] else 0
        for w in self.weights[1:]:
            u = attend(u)  # P^k V X, one attention call per hop
            out = out + w * u
        return out

    def pyro_value(self, edge):
        import pyro
        import pyro.distributions as dist

        fam = edge.family
        x = fam.parents.states
        values = self.parent_values(x)
        with fam.plates():
            total = 0
            if self.weights[0]:
                total = value_term(f"{fam.name}.value.hop0", values, family=fam.name, edge=None,
                                   weight=self.weights[0])
            index, site = edge.index, fam.name
            scores = _edge_log_posterior(fam)  # (*batch, H, C, P): row n = node n's edge
            for k, w in enumerate(self.weights[1:], start=1):
                if k > 1:  # the next step: a fresh edge from the node reached
                    site = f"{fam.name}.hop{k}"
                    step = dist.Categorical(logits=gather_parents(scores, index))
                    if fam.parents.size == 1:  # one node: the walk stays there surely
                        index = pyro.sample(site, step, obs=torch.zeros_like(index))
                    else:
                        index = pyro.sample(site, step, infer={"enumerate": "parallel"})
                total = total + value_term(f"{fam.name}.value.hop{k}", gather_parents(values, index),
                                           family=fam.name, edge=site, weight=w)
        return total

    def validate(self, family, children, parents):
        if children is not parents:
            raise ValueError(
                f"edge family {family!r}: a Hops value walks along edges, so children and parents "
                f"must be the same node set; got {children.name!r} and {parents.name!r}"
            )
        super().validate(family, children, parents)

    def describe(self) -> str:
        return f"Hops(weights={tuple(self.weights)}, heads={self.heads})"


def _edge_log_posterior(fam) -> torch.Tensor:
    """``log p(φ_n = j | x)`` up to a constant per row, ``(*batch, H, C, P)``: the prior's
    normalised log table plus ψ(x_j, x_n) of every declared potential, each evaluated with
    ``potential.at`` (as the family's ``pyro.factor`` sites are) at every candidate parent j.
    −∞ off the support. Costs one ``at`` call per potential on a ``(P, *batch, H, C)`` index."""
    xc, xp = fam.children.states, fam.parents.states
    log_prior, _ = declared_log_prior(fam)  # the prior as declared (Pyro's sites read it too)
    P, lead = fam.parents.size, len(fam.batch_shape) + 2  # (*batch, H, C)
    every_parent = torch.arange(P, device=xc.device).reshape(P, *(1,) * lead)
    total = log_prior
    for psi in fam.potentials:
        at = psi.at(xc, xp, every_parent)  # (P, *batch, H, C): ψ(x_j, x_n), j first
        total = total + at.movedim(0, -1)
    return total.expand(*fam.batch_shape, fam.heads, *total.shape[-2:])
