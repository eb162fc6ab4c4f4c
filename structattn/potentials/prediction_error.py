"""Prediction-error potential of predictive coding: ψ(z_j, z_i) = −(k/2)(z_i − w_ij f(z_j) − b_i)²."""

from __future__ import annotations

import torch

from .._validation import shape_str
from ..heads import gather_parents
from .base import Potential
from .bilinear import check_temperature, check_temperature_value

ACTIVATIONS = {None: (lambda x: x, lambda x: torch.ones_like(x)),
               "tanh": (torch.tanh, lambda x: 1 - torch.tanh(x) ** 2)}


class PredictionError(Potential):
    """``ψ(z_j, z_i) = −(k/2)(z_i − w_ij f(z_j) − b_i)²`` between scalar units (node states
    ``(*batch, n, 1)``): unit i predicted from the one incoming unit j its edge chose, with
    weight w_ij (``W``: ``(children, parents)``), bias b_i (``bias``: ``(children,)`` or None),
    precision k > 0 and activation f ∈ {None (identity), "tanh"} (paper §4.4, appendix 7.2).
    Marginalising the choice puts a softmax over squared prediction errors where a standard
    predictive-coding network has fixed precisions.

    Expected gradients in closed form: −k(z_i − b_i − Σ_j p_ij w_ij f(z_j)) (children) and
    k f'(z_j) Σ_i p_ij w_ij (z_i − w_ij f(z_j) − b_i) (parents); curvature k for a child.
    Dense: O(children·parents) per evaluation.
    """

    heads = 1

    def __init__(self, W: torch.Tensor, bias: torch.Tensor | None = None, *, precision=1.0,
                 activation: str | None = None):
        if not isinstance(W, torch.Tensor) or W.dim() != 2:
            got = shape_str(W.shape) if isinstance(W, torch.Tensor) else type(W).__name__
            raise ValueError(f"PredictionError potential: W must be a matrix (children, parents); "
                             f"got {got}")
        if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != W.shape[:1]):
            got = shape_str(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
            raise ValueError(f"PredictionError potential: bias must have shape ({W.shape[0]},); "
                             f"got {got}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"PredictionError potential: activation must be one of "
                             f"{list(ACTIVATIONS)}; got {activation!r}")
        self.W, self.bias, self.activation = W, bias, activation
        self.precision = check_temperature(precision, "PredictionError potential (precision)")
        self.f, self.df = ACTIVATIONS[activation]

    def _errors(self, children, parents):
        """e_ij = z_i − w_ij f(z_j) − b_i: ``(*batch, 1, C, P)``."""
        pred = self.W * self.f(parents[..., 0]).unsqueeze(-2)  # (*batch, C, P)
        e = children - pred  # children (*batch, C, 1)
        if self.bias is not None:
            e = e - self.bias[:, None]
        return e.unsqueeze(-3)

    def pairwise(self, children, parents):
        return -0.5 * self.precision * self._errors(children, parents) ** 2

    def at(self, children, parents, index):
        """The Pyro reading at the chosen parents, from the states directly."""
        from pyro.ops.indexing import Vindex

        C = children.shape[-2]
        w = Vindex(self.W)[torch.arange(C, device=index.device), index]  # broadcast(index)
        zj = gather_parents(self.f(parents).unsqueeze(-3), index)[..., 0]
        e = children[..., 0].unsqueeze(-2) - w * zj
        if self.bias is not None:
            e = e - self.bias
        return -0.5 * self.precision * e ** 2

    def expected_gradient(self, side, op):
        post = op.posterior()  # (*batch, 1, C, P)
        xc, xp = op.family.children.states, op.family.parents.states
        k = self.precision
        if side == "children":  # −k (z_i − b_i − Σ_j p_ij w_ij f(z_j))
            pred = (post * self.W) @ self.f(xp).unsqueeze(-3)  # (*batch, 1, C, 1)
            e = xc - pred.squeeze(-3)
            if self.bias is not None:
                e = e - self.bias[:, None]
            return -k * e
        e = self._errors(xc, xp)  # (*batch, 1, C, P)
        s = (post * self.W * e).sum(-2).squeeze(-2)  # (*batch, P)
        return (k * s * self.df(xp[..., 0])).unsqueeze(-1)

    def expected_curvature(self, side, op):
        if side == "children":
            return self.precision
        if self.activation is not None:
            return None
        post = op.posterior()
        return self.precision * (post * self.W ** 2).sum(-2).squeeze(-2).unsqueeze(-1)

    def validate(self, family, children, parents):
        check_temperature_value(self.precision, family)
        for role, ns, n in (("children", children, self.W.shape[0]),
                            ("parents", parents, self.W.shape[1])):
            if ns.features != 1 or ns.size != n:
                raise ValueError(
                    f"edge family {family!r}: a PredictionError potential with W "
                    f"{shape_str(self.W.shape)} needs {role} {ns.name!r} of shape (*batch, {n}, 1) "
                    f"(scalar units); got {shape_str(ns.states.shape)}")
            if ns.states.dtype != self.W.dtype:
                raise ValueError(f"edge family {family!r}: {role} {ns.name!r} has dtype "
                                 f"{ns.states.dtype} but W has dtype {self.W.dtype}")

    def describe(self) -> str:
        return f"PredictionError(k, f={self.activation or 'identity'})"
