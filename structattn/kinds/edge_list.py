"""Edge-list supports — a graph given as ``edge_index`` ``(2, E)`` — and their operator, a
softmax over each child's incoming edges (``structattn.operators.segment``): O(E) memory, never C×P.

Cost: attend, adjoint, mass O(E·(k + d)) time, O(E + (C + P)·d) memory; the posterior per
edge ``(*batch, H, E)``.
"""

from __future__ import annotations

import torch

from .base import Operator, Support


class EdgeListOperator(Operator):
    """Segment softmax over each child's incoming edges (module docstring), for an
    ``EdgeList`` support; the posterior is per edge, ``(*batch, H, E)``, aligned with
    ``family.tables.edges()``. Needs exactly one factorised potential.

    Args:
        family (EdgeFamily): the edge family whose posterior it reads (``Operator``).
        cache (dict | None): what an iterating reader keeps across steps (``Operator``).
            None (default): a new, empty one.
    """

    reading_name = "edge list"

    kind_name = "an edge-list"

    def __init__(self, family, cache=None):
        super().__init__(family, cache)
        self._p = None

    def _run(self, u):
        """``P u``, keeping the per-edge posterior (the kernel stores it for its backward
        anyway: O(E))."""
        from ..operators.segment import segment_attention

        f = self.family
        src, dst = f.tables.edges()
        a, b, scale = self.fused_factors()
        out, p = segment_attention(a, b, u, src, dst, f.children.size, scale,
                                   return_posterior=True, empty=f.prior.empty,
                                   bias=f.tables.edge_bias(a.dtype), checked=True)
        if self._p is None:
            self._p = p
        return out

    def posterior(self) -> torch.Tensor:
        """p(φ_i = src_e | x) per edge e: ``(*batch, H, E)``."""
        if self._p is None:
            b = self.fused_factors()[1]
            self._run(b.new_zeros(*b.shape[:-1], 1))
        return self._p

    def dense_posterior(self):
        p = self.posterior()
        src, dst = self.family.tables.edges()
        f = self.family
        dense = p.new_zeros(*p.shape[:-1], f.children.size, f.parents.size)
        return _scatter(dense, p, dst, src)

    def layout(self, dense):
        src, dst = self.family.tables.edges()
        return dense[..., dst, src]

    def attend(self, u):
        return self._run(u)

    def adjoint(self, u):
        """Pᵀu: ``(Pᵀu)_j = Σ_{e: src_e = j} p_e u[dst_e]``, O(E·d)."""
        src, dst = self.family.tables.edges()
        p = self.posterior()
        terms = p[..., None] * u[..., dst, :]  # (*batch, H, E, d)
        out = terms.new_zeros(*terms.shape[:-2], self.family.parents.size, terms.shape[-1])
        return out.index_add(-2, src, terms)

    def mass(self):
        src, _ = self.family.tables.edges()
        p = self.posterior()
        out = p.new_zeros(*p.shape[:-1], self.family.parents.size)
        return out.index_add(-1, src, p)[..., None]



def _scatter(dense, p, dst, src):
    """``dense[..., dst_e, src_e] = p[..., e]`` out of place (differentiable)."""
    C, P = dense.shape[-2:]
    flat = dense.flatten(-2).index_add(-1, dst * P + src, p)
    return flat.unflatten(-1, (C, P))


class EdgeList(Support):
    """Φ_i = {src_e : dst_e = i}: the parents of the graph's edges into child i, lowered by
    ``EdgeListOperator`` in O(E) memory.

    Args:
        edge_index (torch.Tensor): the graph, ``(src, dst)``, a long tensor ``(2, E)``: row 0
            the parents j, row 1 the children i; not checked here (``Uniform`` checks its
            dtype).
        causal (bool): keep only the edges with j ≤ i. Default False.
    """

    operator = EdgeListOperator  # its lowering: a segment softmax over the edges

    def __init__(self, edge_index: torch.Tensor, *, causal: bool = False):
        self.edge_index, self.causal = edge_index, bool(causal)

    def contains(self, child, parent):
        src, dst = self.edge_index.to(child.device)
        i, j = torch.broadcast_tensors(child, parent)
        # pair (i, j) ↦ i·n + j, n above every parent index: O(pairs + E), not pairs × E
        n = 1 + max(int(j.max()) if j.numel() else 0, int(src.max()) if src.numel() else 0)
        hit = torch.isin(i * n + j, dst * n + src)
        return hit & (j <= i) if self.causal else hit

    def dense(self, num_children, num_parents, device):
        src, dst = self.edges(device)
        mask = torch.zeros(num_children, num_parents, dtype=torch.bool, device=device)
        mask[dst, src] = True
        return mask

    def edges(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(src, dst)`` on ``device``: parents and children, only j ≤ i when causal."""
        src, dst = self.edge_index.to(device)
        if self.causal:
            keep = src <= dst
            src, dst = src[keep], dst[keep]
        return src, dst

    def describe(self):
        causal = " ∧ j ≤ i" if self.causal else ""
        return f"graph, {self.edge_index.shape[1]} edges{causal}"
