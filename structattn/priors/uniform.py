"""Uniform prior: p(φ_i = j) = 1/|Φ_i| on the support Φ_i."""

from __future__ import annotations

import torch

from ..kinds.dense import AllParents, Causal, Mask
from ..kinds.edge_list import EdgeList
from ._registry import PriorEntry
from .base import Prior


def dense_support(causal: bool, mask: torch.Tensor | None):
    """j ≤ i and/or a mask as one support (every parent when neither restricts)."""
    parts = ([Causal()] if causal else []) + ([] if mask is None else [Mask(mask)])
    if not parts:
        return AllParents()
    return parts[0] if len(parts) == 1 else parts[0] & parts[1]


class Uniform(Prior):
    r"""$p(φ_i = j) = 1/\lvert Φ_i\rvert$ on the support $Φ_i$: all parents, optionally restricted.

    $Φ_i$ is every parent, $∩ \{j ≤ i\}$ with ``causal``, ∩ a dense mask (``support``) or ∩ a
    graph (``edge_index``, lowered to an O(E)-memory segment softmax, never a C×P matrix).
    Paper §3.2 (cross/self attention), Table 1 (graph/sparse attention).

    Args:
        causal (bool): Φ_i ∩ {j ≤ i}. Default False.
        support (torch.Tensor | None): Φ_i ∩ {j : support[…, i, j]}, a boolean mask
            ``(…, C, P)`` (batch and heads dims broadcast). None (default): no mask.
        edge_index (torch.Tensor | None): Φ_i ∩ the graph's edges, an int64 tensor ``(2, E)``
            (row 0 parents j, row 1 children i); not with ``support``. None (default): no
            graph.
        empty (str): a child with no allowed parent: ``"error"`` (default: refused with a
            ValueError while validating) or ``"zero"`` (a zero value and an all-zero
            posterior row).

    Raises:
        ValueError: ``support`` not a boolean tensor, ``edge_index`` not an int64 tensor,
            both given, or ``empty`` not ``"error"`` or ``"zero"``.
    """

    def __init__(self, *, causal: bool = False, support: torch.Tensor | None = None,
                 edge_index: torch.Tensor | None = None, empty: str = "error"):
        if support is not None:
            if not isinstance(support, torch.Tensor) or support.dtype != torch.bool:
                got = support.dtype if isinstance(support, torch.Tensor) else type(support).__name__
                raise ValueError(
                    f"Uniform prior: support must be a boolean tensor (…, children, parents); "
                    f"got {got}"
                )
        if edge_index is not None:
            if support is not None:
                raise ValueError("Uniform prior: give the support as a dense mask or as an "
                                 "edge_index, not both")
            if not isinstance(edge_index, torch.Tensor) or edge_index.dtype != torch.long:
                got = edge_index.dtype if isinstance(edge_index, torch.Tensor) \
                    else type(edge_index).__name__
                raise ValueError(f"Uniform prior: edge_index must be an int64 tensor (2, E); "
                                 f"got {got}")
        if empty not in ("error", "zero"):
            raise ValueError(f"Uniform prior: empty must be 'error' or 'zero'; got {empty!r}")
        self.causal = bool(causal)
        self.mask = support
        self.edge_index = edge_index
        self.empty = empty

    def support(self, num_children, num_parents):
        if self.edge_index is not None:
            return EdgeList(self.edge_index, causal=self.causal)
        return dense_support(self.causal, self.mask)

    def describe(self) -> str:
        return f"Uniform({self.short_support()})"


def _support_np(C, P, causal: bool, mask=None, edge_index=None):
    """A dense support as a numpy mask ``(C, P)``: j ≤ i (``causal``) ∩ ``mask`` ∩ the edges
    of ``edge_index`` (each None: no restriction)."""
    import numpy as np

    i, j = np.arange(C)[:, None], np.arange(P)[None, :]
    on = np.ones((C, P), dtype=bool) & ((j <= i) if causal else True)
    if mask is not None:
        on = on & mask.numpy()
    if edge_index is not None:
        edges = np.zeros((C, P), dtype=bool)
        parents, children = edge_index.numpy()
        edges[children, parents] = True
        on = on & edges
    return on


def _cases(C, P, g):
    mask = torch.rand(C, P, generator=g) < 0.6
    ring = torch.arange(min(C, P))
    edge_index = torch.stack([ring, ring.flip(0)])
    out = [Uniform(), Uniform(support=mask, empty="zero"),
           Uniform(edge_index=edge_index, empty="zero"),
           Uniform(edge_index=edge_index, causal=True, empty="zero")]
    return out + ([Uniform(causal=True)] if C <= P else [])


def _formula(prior, C, P):
    import numpy as np

    on = _support_np(C, P, prior.causal, prior.mask, prior.edge_index)
    return np.where(on, 0.0, -np.inf)[None]


ENTRY = PriorEntry(
    Uniform, _cases, _formula,
    bad={"empty must be 'error' or 'zero'": lambda: Uniform(empty="never"),
         "support must be a boolean tensor": lambda: Uniform(support=torch.ones(2, 2)),
         "edge_index must be an int64 tensor": lambda: Uniform(edge_index=torch.zeros(2, 3))})
