"""Prediction-error potential of predictive coding: ψ(z_j, z_i) = −(k/2)‖z_i − W_ij f(z_j) − b_i‖²."""

from __future__ import annotations

import torch

from ..checking._validation import check_like, shape_str
from ..heads import gather_parents
from .base import Potential
from .temperature import check_temperature, check_temperature_value

# f, and f' written in terms of f's value (f'(x) = g(f(x))): the activated states serve both
ACTIVATIONS = {None: (lambda x: x, lambda fx: torch.ones_like(fx)),
               "tanh": (torch.tanh, lambda fx: 1 - fx ** 2)}


class PredictionError(Potential):
    """``ψ(z_j, z_i) = −(k/2)‖z_i − W_ij f(z_j) − b_i‖²``: node i predicted from the one
    incoming node j its edge chose (paper §4.4, appendix 7.2), with precision k > 0 and
    activation f. Marginalising the choice puts a softmax over squared prediction errors
    where a standard predictive-coding network has fixed precisions.

    ``W`` takes two shapes (Args): scalar units (the paper's derivation) and blocks of units
    competing (the paper's suggestion, "similar to multidimensional token
    representations"). Expected gradients in closed form: −k(z_i − b_i − Σ_j p_ij
    W_ij f(z_j)) (children) and k f'(z_j) ⊙ Σ_i p_ij W_ijᵀ(z_i − W_ij f(z_j) − b_i)
    (parents); curvature k for a child. Dense: O(children · parents · d_child · d_parent)
    per evaluation. One head.

    Args:
        W (torch.Tensor): the edge weights: a matrix ``(children, parents)``, one weight
            w_ij per edge, for scalar node states ``(*batch, n, 1)``; or a tensor
            ``(children, parents, d_child, d_parent)``, one matrix per edge, for node states
            ``(*batch, n, d)``. The node sets' sizes and widths must match it (checked when
            the family is declared).
        bias (torch.Tensor | None): b_i, ``(children,)`` for a matrix ``W``, ``(children,
            d_child)`` for blocks. None (default): no bias.
        precision (float | torch.Tensor): k, a finite float > 0 or a one-element
            floating-point tensor (learnable; its value checked > 0 when the family is
            declared). Default 1.
        activation (str | None): f, None (default: the identity) or ``"tanh"``.

    Raises:
        ValueError: ``W`` not a tensor of 2 or 4 dims, ``bias`` of the wrong shape, an
            unknown ``activation``, or a ``precision`` float that is not finite and > 0.
    """

    heads = 1

    def __init__(self, W: torch.Tensor, bias: torch.Tensor | None = None, *, precision=1.0,
                 activation: str | None = None):
        if not isinstance(W, torch.Tensor) or W.dim() not in (2, 4):
            got = shape_str(W.shape) if isinstance(W, torch.Tensor) else type(W).__name__
            raise ValueError(f"PredictionError potential: W must be a matrix (children, parents) "
                             f"or a tensor (children, parents, d_child, d_parent); got {got}")
        blocks = W.dim() == 4
        bias_shape = (W.shape[0], W.shape[2]) if blocks else W.shape[:1]
        if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != bias_shape):
            got = shape_str(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
            raise ValueError(f"PredictionError potential: bias must have shape "
                             f"{shape_str(bias_shape)}; got {got}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"PredictionError potential: activation must be one of "
                             f"{list(ACTIVATIONS)}; got {activation!r}")
        self.W, self.bias, self.activation = W, bias, activation
        # one matrix per edge, (C, P, d_child, d_parent), and a bias (C, d_child)
        self._W = W if blocks else W[..., None, None]
        self._b = None if bias is None else (bias if blocks else bias[:, None])
        self.precision = check_temperature(precision, "PredictionError potential (precision)")
        self.f, self.df_of_f = ACTIVATIONS[activation]
        self._memo = None  # (children, parents, errors) of the last states seen
        self._f_memo = []  # (states, f(states)) of the last few

    @property
    def child_features(self) -> int:
        return self._W.shape[2]

    @property
    def parent_features(self) -> int:
        return self._W.shape[3]

    def _errors(self, children, parents):
        """e_ij = z_i − W_ij f(z_j) − b_i: ``(*batch, C, P, d_child)``; the last one is kept
        for the same state tensors (a step's posterior and expected gradients share it)."""
        memo = self._memo
        if memo is not None and memo[0] is children and memo[1] is parents:
            return memo[2]
        e = self._compute_errors(children, parents)
        self._memo = (children, parents, e)
        return e

    def _activated(self, states):
        """f(states), kept for the last few state tensors (an observed layer's once per
        forward, not once per step)."""
        memo = self._f_memo
        for t, fz in memo:
            if t is states:
                return fz
        fz = self.f(states)
        memo.insert(0, (states, fz))
        del memo[3:]
        return fz

    def _compute_errors(self, children, parents):
        if self._W.shape[2:] == (1, 1):  # scalar units: a broadcast product, no matmul
            pred = (self.W * self._activated(parents)[..., 0].unsqueeze(-2)).unsqueeze(-1)
        else:
            pred = torch.einsum("cpkd,...pd->...cpk", self._W, self._activated(parents))
        e = children.unsqueeze(-2) - pred  # children (*batch, C, 1, d_child)
        if self._b is not None:
            e = e - self._b[:, None, :]
        return e

    def pairwise(self, children, parents):
        return (-0.5 * self.precision * (self._errors(children, parents) ** 2).sum(-1)).unsqueeze(-3)

    def at(self, children, parents, index):
        """The Pyro reading at the chosen parents, from the states directly."""
        from pyro.ops.indexing import Vindex

        C = children.shape[-2]
        w = Vindex(self._W)[torch.arange(C, device=index.device), index]  # (…, C, d_c, d_p)
        zj = gather_parents(self.f(parents).unsqueeze(-3), index)  # (…, C, d_p)
        e = children.unsqueeze(-3) - (w @ zj.unsqueeze(-1)).squeeze(-1)  # (…, C, d_c)
        if self._b is not None:
            e = e - self._b
        return -0.5 * self.precision * (e ** 2).sum(-1)

    def expected_gradient(self, side, op, weight=1.0):
        g = self._expected_gradient(side, op)
        return g if isinstance(weight, float) and weight == 1.0 else weight * g

    def _expected_gradient(self, side, op):
        post = op.dense_posterior()[..., 0, :, :]  # (*batch, C, P)
        xc, xp = op.family.children.states, op.family.parents.states
        k = self.precision
        e = self._errors(xc, xp)  # (*batch, C, P, d_c)
        if side == "children":  # −k (z_i − b_i − Σ_j p_ij W_ij f(z_j)) = −k Σ_j p_ij e_ij
            return -k * (post.unsqueeze(-2) @ e).squeeze(-2)  # (*batch, C, d_c)
        if self._W.shape[2:] == (1, 1):
            s = (post * self.W * e[..., 0]).sum(-2).unsqueeze(-1)  # (*batch, P, 1)
        else:
            s = torch.einsum("cpkd,...cpk->...pd", self._W, post.unsqueeze(-1) * e)
        return k * s * self.df_of_f(self._activated(xp))

    def expected_curvature(self, side, op):
        if side == "children":
            return self.precision
        if self.activation is not None or self.parent_features != 1:
            return None  # not a multiple of the identity
        post = op.dense_posterior()[..., 0, :, :]  # (*batch, C, P)
        w2 = (self._W ** 2).sum((-2, -1))  # (C, P): W_ijᵀW_ij for a scalar parent
        return self.precision * (post * w2).sum(-2).unsqueeze(-1)

    def validate(self, family, children, parents):
        check_temperature_value(self.precision, family)
        C, P, dc, dp = self._W.shape
        for role, ns, n, d in (("children", children, C, dc), ("parents", parents, P, dp)):
            if ns.features != d or ns.size != n:
                raise ValueError(
                    f"edge family {family!r}: a PredictionError potential with W "
                    f"{shape_str(self.W.shape)} needs {role} {ns.name!r} of shape (*batch, {n}, "
                    f"{d}); got {shape_str(ns.states.shape)}")
            check_like(f"edge family {family!r}: {role} node set {ns.name!r}", ns.states, self.W,
                       "potential W")

    def describe(self) -> str:
        return f"PredictionError(k, f={self.activation or 'identity'})"
