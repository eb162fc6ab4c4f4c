"""Edge potentials ψ(x_j, x_i): the log-likelihood of the edge x_j → x_i.

A potential offers up to three readings of itself:

- ``factors(children, parents)``: ψ_ij = scale · ⟨a_i, b_j⟩, the form
  ``scaled_dot_product_attention`` consumes (fast path, never forms C×P);
- ``pairwise(children, parents)``: the dense ``(*batch, H, C, P)`` table (the
  naive twin; derived from ``factors`` when it exists);
- ``at(children, parents, index)``: ψ at the parent each child picked, the Pyro reading's
  ``pyro.factor`` — the oracle. Every built-in potential computes it from its own
  definition, never from ``factors`` (so a wrong factorisation shows in ``compare``); a
  potential that does not define it falls back to ``pairwise`` (then to ``factors``).

A factorised potential may state its two halves separately, ``child_factor(x)`` and
``parent_factor(x)`` with ``factor_scale()``: the iterative engine then computes the half
on an observed node set once per forward, not once per step.

For latent node sets (the iterative engine) a potential may also give, in closed form,

- ``expected_gradient(side, op)``: E_{p(φ|x)}[∂ψ/∂x_side] summed over the edges of each
  node on ``side`` ("children" or "parents"), shaped like that node set's states — by
  Lemma 7.1 of the paper, the gradient of the family's log-partition;
- ``expected_curvature(side, op)``: E[−∂²ψ/∂x_side²] when it is a multiple of the identity
  (0 for potentials linear in that side), which makes the CCCP/EM update closed-form;
- ``expected_gradient_offset(side, op)``: for such a potential, the b of
  E[∂ψ/∂x_side] = b − c·x_side (c the curvature), computed without x_side's own term: the
  update is then EM's weighted mean (loc/scale² + Σ b)/H, not μ − ∇F/H (the same point,
  in fewer operations forward and backward).

Either may return None: the engine then differentiates the log-partition with autograd
(gradient) or refuses the closed-form update (curvature).
"""

from __future__ import annotations

import torch


class Potential:
    """Base class of edge potentials ψ(x_j, x_i), the log-likelihood of the edge x_j → x_i.

    A subclass states ``factors`` (or its halves ``child_factor`` and ``parent_factor``
    with ``factor_scale``) or ``pairwise``, and, for the Pyro reading, ``at`` from its own
    definition (module docstring); ``validate`` refuses node sets it cannot read, and the
    ``expected_*`` hooks serve latent node sets. The base class takes no constructor
    arguments.

    Attributes:
        heads (int): how many heads the potential scores, H in its tables
            ``(*batch, H, C, P)``; a class attribute or set by the constructor. Default 1.
    """

    heads: int = 1

    @property
    def is_factorised(self) -> bool:
        """True when ``factors`` is implemented (the SDPA fast path applies)."""
        return self.is_split or type(self).factors is not Potential.factors

    @property
    def is_split(self) -> bool:
        """True when the two halves of ``factors`` are given separately."""
        return type(self).child_factor is not Potential.child_factor

    def child_factor(self, children: torch.Tensor) -> torch.Tensor:
        """a: ``(*batch, H, C, k)`` from the children's states ``(*batch, C, d)``."""
        raise NotImplementedError

    def parent_factor(self, parents: torch.Tensor) -> torch.Tensor:
        """b: ``(*batch, H, P, k)`` from the parents' states ``(*batch, P, d)``."""
        raise NotImplementedError

    def factor_scale(self):
        """The scale of ⟨a, b⟩: a float, a 0-dim tensor, or one per head as an ``(H, 1, 1)``
        tensor (broadcasting against the factors ``(*batch, H, n, k)``)."""
        return 1.0

    def factors(self, children: torch.Tensor, parents: torch.Tensor):
        """``(a, b, scale)`` with a: (*batch, H, C, k), b: (*batch, H, P, k); or None."""
        if self.is_split:
            return self.child_factor(children), self.parent_factor(parents), self.factor_scale()
        return None

    def expected_gradient(self, side: str, op, weight=1.0) -> torch.Tensor | None:
        """``weight`` · E_{p(φ|x)}[∂ψ/∂x_side] per node of ``side``, shaped like its states;
        None: unknown. (The weight — a CCCP update's prior variance — is folded into the
        potential's own scale where it can: one multiplication, or none.)"""
        return None

    def expected_curvature(self, side: str, op):
        """E[−∂²ψ/∂x_side²] as a scalar multiple of the identity per node (a float or a tensor
        broadcastable to the states); None when it is not one."""
        return None

    def expected_gradient_offset(self, side: str, op) -> torch.Tensor | None:
        """b in E[∂ψ/∂x_side] = b − c·x_side, c = ``expected_curvature(side, op)``: the expected
        gradient without the side's own (linear) term, shaped like its states; None: not
        stated (the engine then takes μ − ∇F/H)."""
        return None

    def pairwise(self, children: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        """Dense ψ: ``(*batch, H, C, P)``."""
        f = self.factors(children, parents)
        if f is None:
            raise NotImplementedError(f"{type(self).__name__} must define factors or pairwise")
        a, b, scale = f
        if a.dtype in (torch.float16, torch.bfloat16):  # accumulate as the fused kernels do
            a, b = a.float(), b.float()
        if isinstance(scale, torch.Tensor):  # a learned 1/τ: 0-dim, or (H, 1, 1) per head
            scale = scale.to(a.dtype)
        return (a @ b.transpose(-1, -2)) * scale

    def at(self, children: torch.Tensor, parents: torch.Tensor, index: torch.Tensor):
        """ψ(x_{index_i}, x_i): ``broadcast(index)`` shaped, index broadcastable to (*batch, H, C).
        Built-in potentials compute it from their definition; this fallback reads the dense
        table (``pairwise``)."""
        from pyro.ops.indexing import Vindex

        return Vindex(self.pairwise(children, parents))[..., index]  # table (*batch, H, C, P)

    def validate(self, family: str, children, parents) -> None:
        pass

    def describe(self) -> str:
        return type(self).__name__
