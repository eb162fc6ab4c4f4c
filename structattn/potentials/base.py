"""Edge potentials ψ(x_j, x_i): the log-likelihood of the edge x_j → x_i.

A potential offers up to three readings of itself:

- ``factors(children, parents)``: ψ_ij = scale · ⟨a_i, b_j⟩, the form
  ``scaled_dot_product_attention`` consumes (fast path, never forms C×P);
- ``pairwise(children, parents)``: the dense ``(*batch, H, C, P)`` table (the
  naive twin; derived from ``factors`` when it exists);
- ``at(children, parents, index)``: ψ at the parent each child picked, the
  Pyro reading's ``pyro.factor`` (derived from ``factors`` when it exists).
"""

from __future__ import annotations

import torch

from ..heads import gather_parents


class Potential:
    heads: int = 1

    @property
    def is_factorised(self) -> bool:
        """True when ``factors`` is implemented (the SDPA fast path applies)."""
        return type(self).factors is not Potential.factors

    def factors(self, children: torch.Tensor, parents: torch.Tensor):
        """``(a, b, scale)`` with a: (*batch, H, C, k), b: (*batch, H, P, k); or None."""
        return None

    def pairwise(self, children: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        """Dense ψ: ``(*batch, H, C, P)``."""
        f = self.factors(children, parents)
        if f is None:
            raise NotImplementedError(f"{type(self).__name__} must define factors or pairwise")
        a, b, scale = f
        return (a @ b.transpose(-1, -2)) * scale

    def at(self, children: torch.Tensor, parents: torch.Tensor, index: torch.Tensor):
        """ψ(x_{index_i}, x_i): ``broadcast(index)`` shaped, index broadcastable to (*batch, H, C)."""
        f = self.factors(children, parents)
        if f is None:
            table = self.pairwise(children, parents)
            from pyro.ops.indexing import Vindex

            return Vindex(table)[..., index]
        a, b, scale = f
        return (a * gather_parents(b, index)).sum(-1) * scale

    def validate(self, family: str, children, parents) -> None:
        pass

    def describe(self) -> str:
        return type(self).__name__
