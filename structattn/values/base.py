"""Value functions v_i(x, φ_i = j): what child i predicts given its edge.

``parent_values(parents)`` — ``(*batch, H, P, d_v)`` — says the value depends
on the chosen parent only (v_i(x, j) = g(x_j)); then E[v_i] = Σ_j p_ij g(x_j)
is an SDPA call. ``at(children, parents, index)`` is the Pyro reading: the
value at the sampled/enumerated edge.
"""

from __future__ import annotations

import torch

from ..heads import gather_parents


class Value:
    heads: int = 1

    def parent_values(self, parents: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def at(self, children, parents, index):
        return gather_parents(self.parent_values(parents), index)

    def validate(self, family: str, children, parents) -> None:
        pass

    def describe(self) -> str:
        return type(self).__name__
