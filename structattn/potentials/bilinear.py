"""Bilinear potential ψ(x_j, x_i) = x_iᵀ W_Qᵀ W_K x_j / τ, one per head."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..checking._validation import check_like, shape_str
from ..heads import gather_parents, merge_heads, split_heads
from .base import Potential
from .temperature import (
    check_temperature,
    check_temperature_value,
    describe_temperature,
    inverse,
    per_head,
    weighted,
)


class Bilinear(Potential):
    """``ψ_h(x_j, x_i) = (W_Q^h x_i)ᵀ (W_K^h x_j) / τ_h`` for each head h.

    The temperature tempers the posterior. Paper §3.2, Table 1; §4.2 (Hopfield). Linear in
    each side, so for a latent side the expected gradient is one attention call,
    E[∂ψ/∂x_i] = W_Qᵀ Σ_j p_ij W_K x_j / τ (children) or W_Kᵀ Σ_i p_ij W_Q x_i / τ (parents),
    and the curvature is zero (the CCCP update is closed-form).

    Args:
        W_q (torch.Tensor | None): the query projection, a matrix ``(heads*d_k, d_child)``;
            None: the identity (the children's states are already ``heads*d_k`` features,
            e.g. a Hopfield state ξ).
        W_k (torch.Tensor | None): the key projection, a matrix ``(heads*d_k, d_parent)``
            with as many rows as ``W_q``; None: the identity, as for ``W_q`` (not both None).
        heads (int): the number of heads H, a positive int dividing the rows. Default 1.
        temperature (float | torch.Tensor | None): τ > 0: a finite float, a (learnable)
            scalar tensor, or one per head, a floating-point tensor ``(heads,)`` (a list of
            floats becomes one); a tensor's values are checked when the family is declared.
            None (default): √d_k.

    Raises:
        ValueError: ``heads`` not a positive int, ``W_q`` or ``W_k`` not a matrix or None,
            both None, rows that differ or are not a multiple of ``heads``, or a
            ``temperature`` that is not a finite number > 0, a scalar tensor or one per head.
    """

    def __init__(self, W_q: torch.Tensor | None, W_k: torch.Tensor | None, *, heads: int = 1,
                 temperature: float | torch.Tensor | None = None):
        if not isinstance(heads, int) or heads < 1:
            raise ValueError(f"Bilinear potential: heads must be a positive int; got {heads!r}")
        for name, W in (("W_q", W_q), ("W_k", W_k)):
            if W is not None and (not isinstance(W, torch.Tensor) or W.dim() != 2):
                got = shape_str(W.shape) if isinstance(W, torch.Tensor) else type(W).__name__
                raise ValueError(
                    f"Bilinear potential: {name} must be a matrix (heads*d_k, features) or None "
                    f"(identity); got {got}"
                )
        if W_q is None and W_k is None:
            raise ValueError("Bilinear potential: W_q and W_k cannot both be None; use "
                             "DotProduct(heads=…) for ψ = x_iᵀx_j / τ")
        rows = [W.shape[0] for W in (W_q, W_k) if W is not None]
        if len(set(rows)) > 1 or rows[0] % heads:
            raise ValueError(
                f"Bilinear potential: W_q and W_k must both have heads*d_k rows with heads="
                f"{heads}; got W_q {None if W_q is None else shape_str(W_q.shape)} and W_k "
                f"{None if W_k is None else shape_str(W_k.shape)}"
            )
        self.W_q, self.W_k, self.heads = W_q, W_k, heads
        self.d_k = rows[0] // heads
        if temperature is None:
            temperature = math.sqrt(self.d_k)
        self.temperature = check_temperature(temperature, "Bilinear potential", heads)

    def child_factor(self, children):
        q = children if self.W_q is None else F.linear(children, self.W_q)
        return split_heads(q, self.heads)  # (*batch, H, C, d_k)

    def parent_factor(self, parents):
        k = parents if self.W_k is None else F.linear(parents, self.W_k)
        return split_heads(k, self.heads)  # (*batch, H, P, d_k)

    def factor_scale(self):
        return inverse(self.temperature)

    def at(self, children, parents, index):
        """The Pyro reading, from the definition: ψ_h = x_iᵀ (W_Q^h)ᵀ W_K^h x_{φ_i} / τ_h."""
        H = self.heads

        def project(x, W):  # (*batch, n, d) → (*batch, H, n, d_k)
            y = x if W is None else torch.einsum("...nd,hkd->...hnk", x, W.reshape(H, -1, W.shape[-1]))
            return y if W is not None else y.reshape(*y.shape[:-1], H, -1).movedim(-2, -3)
        q, k = project(children, self.W_q), project(parents, self.W_k)
        psi = (q * gather_parents(k, index)).sum(-1)  # (…, H, C)
        return psi / per_head(self.temperature, psi, 1)

    def expected_gradient(self, side, op, weight=1.0):
        a, b, _ = op.factors(self)
        if side == "children":  # Σ_j p_ij ∂ψ_ij/∂x_i = W_Qᵀ (P b)_i / τ_h
            g, W = op.attend(b), self.W_q
        else:  # Σ_i p_ij ∂ψ_ij/∂x_j = W_Kᵀ (Pᵀ a)_j / τ_h
            g, W = op.adjoint(a), self.W_k
        g = merge_heads(weighted(g, weight, self.temperature))
        return g if W is None else g @ W

    def expected_gradient_offset(self, side, op):
        return self.expected_gradient(side, op)  # linear in each side: no own term

    def expected_curvature(self, side, op):
        return 0.0  # linear in each side

    def validate(self, family, children, parents):
        for role, nodes, W, wname in (("children", children, self.W_q, "W_q"),
                                      ("parents", parents, self.W_k, "W_k")):
            x = nodes.states
            if W is None:
                if x.shape[-1] != self.heads * self.d_k:
                    raise ValueError(
                        f"edge family {family!r}: {role} node set {nodes.name!r} must have shape "
                        f"(*batch, n, heads*d_k={self.heads * self.d_k}) for a Bilinear potential "
                        f"with {wname}=None (identity); got {shape_str(x.shape)}"
                    )
                continue
            if x.shape[-1] != W.shape[1]:
                raise ValueError(
                    f"edge family {family!r}: {role} node set {nodes.name!r} must have shape "
                    f"(*batch, n, {W.shape[1]}) to match potential {wname} {shape_str(W.shape)}; "
                    f"got {shape_str(x.shape)}"
                )
            check_like(f"edge family {family!r}: {role} node set {nodes.name!r}", x, W,
                       f"potential {wname}")
        check_temperature_value(self.temperature, family, self.heads)

    def describe(self) -> str:
        t = describe_temperature(self.temperature)
        return f"Bilinear(heads={self.heads}, d_k={self.d_k}, τ={t})"
