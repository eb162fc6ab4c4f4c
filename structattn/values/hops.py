"""Multihop value: what a child predicts from a walk along its edges (paper §5.1)."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import torch

from .._validation import shape_str
from ..heads import gather_parents, split_heads
from .base import Value, value_term


class Hops(Value):
    """``v_i(x, φ) = Σ_k w_k W_V x_{φ^k(i)}``, φ^0(i) = i, φ^k(i) = φ_{φ^{k−1}(i)}: the value of
    a walk of k steps along the edges ⇒ E[v] = Σ_k w_k P^k (V X).

    weights ``w = (w_0, …, w_K)``: the paper's (P + P²)VX is ``(0, 1, 1)`` (the default);
    the authors' code uses ``(⅓, ⅓, ⅓)``. Compiled, P^k is never formed: attention is
    applied to the values k times (K SDPA calls). Children and parents must be one node set.

    The Pyro reading draws each hop afresh from the posterior edge of the node reached,
    φ^k_i ~ p(φ_{φ^{k−1}_i} | x) (a random walk on the attention graph), for which
    Σ_k w_k P^k V X is exact; ground truth enumerates the walk (φ^1_i, …, φ^K_i) jointly.
    """

    single_edge = False

    def __init__(self, W_v: torch.Tensor, weights=(0.0, 1.0, 1.0), *, heads: int = 1):
        if not isinstance(W_v, torch.Tensor) or W_v.dim() != 2 or W_v.shape[0] % heads:
            got = shape_str(W_v.shape) if isinstance(W_v, torch.Tensor) else type(W_v).__name__
            raise ValueError(f"Hops value: W_v must be (heads*d_v, features); got {got}")
        weights = [float(w) for w in weights]
        if len(weights) < 2:
            raise ValueError(f"Hops value: weights must be (w_0, …, w_K) with K ≥ 1; got {weights}")
        self.W_v, self.heads, self.weights = W_v, heads, weights

    def parent_values(self, parents):
        return split_heads(parents @ self.W_v.T, self.heads)

    def expectation(self, attend, children, parents):
        u = self.parent_values(parents)  # (*batch, H, P, d_v): V X
        out = self.weights[0] * u if self.weights[0] else 0
        for w in self.weights[1:]:
            u = attend(u)  # P^k V X, one attention call per hop
            out = out + w * u
        return out

    def pyro_value(self, edge):
        fam = edge.family
        x = fam.parents.states
        values = self.parent_values(x)
        with fam.plates():
            total = 0
            if self.weights[0]:
                total = value_term(f"{fam.name}.value.hop0", values, family=fam.name, edge=None,
                                   weight=self.weights[0])
            index, site = edge.index, fam.name
            scores = fam.scores()  # (*batch, H, C, P): row n = log posterior of node n's edge
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
        if parents.states.dtype != self.W_v.dtype or parents.states.device != self.W_v.device:
            raise ValueError(
                f"edge family {family!r}: node set {parents.name!r} ({parents.states.dtype}, "
                f"{parents.states.device}) and Hops W_v ({self.W_v.dtype}, {self.W_v.device}) must "
                f"share dtype and device"
            )
        if parents.features != self.W_v.shape[1]:
            raise ValueError(
                f"edge family {family!r}: node set {parents.name!r} must have shape "
                f"(*batch, n, {self.W_v.shape[1]}) to match W_v; got {shape_str(parents.states.shape)}"
            )

    def describe(self) -> str:
        return f"Hops(weights={tuple(self.weights)}, heads={self.heads})"
