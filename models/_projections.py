"""Shared parameters of the dot-product catalogue models: W_Q, W_K, W_V (and W_O)."""

from __future__ import annotations

import torch
from torch import nn

import structattn as sa
from structattn.potentials.bilinear import check_temperature


class ProjectedAttention(sa.Declaration):
    """Holds ``W_q: (H·d_k, d_child)``, ``W_k: (H·d_k, d_parent)``, ``W_v: (H·d_v, d_parent)``
    and optionally ``W_o: (d_out, H·d_v)``; subclasses say which node sets they connect."""

    def __init__(self, d_child, d_parent, d_k, d_v, heads, out_features, temperature,
                 device=None, dtype=None):
        super().__init__()
        for name, val in (("d_k", d_k), ("d_v", d_v), ("heads", heads)):
            if not isinstance(val, int) or val < 1:
                raise ValueError(
                    f"{type(self).__name__}: {name} must be a positive int; got {val!r}")
        if temperature is not None:
            check_temperature(temperature, type(self).__name__)
        kw = {"device": device, "dtype": dtype}
        self.heads, self.d_k, self.d_v = heads, d_k, d_v
        self.temperature = temperature
        self.W_q = nn.Parameter(torch.empty(heads * d_k, d_child, **kw))
        self.W_k = nn.Parameter(torch.empty(heads * d_k, d_parent, **kw))
        self.W_v = nn.Parameter(torch.empty(heads * d_v, d_parent, **kw))
        self.W_o = (nn.Parameter(torch.empty(out_features, heads * d_v, **kw))
                    if out_features else None)
        for p in self.parameters():
            nn.init.xavier_uniform_(p)

    def attend(self, name, children, parents, prior):
        """One multi-head edge family with a bilinear potential and linear value."""
        phi = sa.edges(name, children, parents, prior, heads=self.heads)
        sa.potential(phi, sa.potentials.Bilinear(self.W_q, self.W_k, heads=self.heads,
                                                 temperature=self.temperature))
        y = sa.merge_heads(sa.value(phi, sa.values.Linear(self.W_v, heads=self.heads)))
        return y if self.W_o is None else y @ self.W_o.T
