"""Cross attention (paper §3.2): each query picks one key, uniformly a priori."""

from __future__ import annotations

import torch

from structattn.checks import check_size
from structattn.nodes import nodes
from structattn.priors import Uniform

from ._catalogue import Entry, randn64
from ._projections import ProjectedAttention


class CrossAttention(ProjectedAttention):
    r"""$φ_i ∼ \mathrm{Uniform}(\text{keys})$; $ψ(k_j, q_i) = q_iᵀW_QᵀW_K k_j / τ$; $v = W_V k_j$;
    $y_i = W_O[\mathbb{E}\, v_i]_\text{heads}$.

    queries: ``(*batch, M, d_query)``, keys: ``(*batch, N, d_key)``
    → ``(*batch, M, d_out or heads·d_v)``. Cost O(M·N·heads·(d_k + d_v)).

    ::

        keys     k_1  k_2 … k_N
                   \   |   /      φ_i ∈ {1..N}
        queries      q_i

    Args:
        d_query (int): the queries' feature size, a positive int.
        d_key (int | None): the keys' feature size, a positive int; None, the default, takes
            d_query.
        d_k (int | None): the per-head size of the projected queries and keys, a positive
            int; None, the default, takes d_query // heads (then d_query must be divisible by
            heads).
        d_v (int | None): the per-head size of the values, a positive int; None, the default,
            takes d_k.
        heads (int): the number of heads, a positive int. Default 1.
        out_proj (bool): True (default) holds ``W_O: (d_out, heads·d_v)``; False leaves the
            merged heads, ``(*batch, M, heads·d_v)``.
        d_out (int | None): the output size with ``out_proj``, a positive int; None, the
            default, takes d_query. Unused without ``out_proj``.
        temperature (float | torch.Tensor | Sequence[float] | str | None): τ of the
            potential: a finite number > 0, a floating-point tensor of one element or one per
            head ``(heads,)`` (a list or tuple of heads numbers becomes one), ``"learned"``
            (τ = exp(log τ), a parameter initialised at √d_k) or None, the default (√d_k).
        device (torch.device | str | None): the device of the parameters.
        dtype (torch.dtype | None): the dtype of the parameters.
        name (str): the edge family's name, a non-empty string; distinct names let several
            layers share one model. Default ``"attn"``.
    """

    def __init__(self, d_query, d_key=None, *, d_k=None, d_v=None, heads=1, out_proj=True,
                 d_out=None, temperature=None, device=None, dtype=None, name="attn"):
        owner = type(self).__name__
        d_query = check_size(owner, "d_query", d_query)
        d_key = d_query if d_key is None else check_size(owner, "d_key", d_key)
        heads = check_size(owner, "heads", heads)
        if d_k is None and d_query % heads:
            raise ValueError(f"{owner}: d_query={d_query} is not divisible by "
                             f"heads={heads}; give d_k (the per-head size) explicitly")
        d_k = d_query // heads if d_k is None else d_k
        d_v = d_k if d_v is None else d_v
        if d_out is not None:
            d_out = check_size(owner, "d_out", d_out)
        out = (d_out or d_query) if out_proj else None
        super().__init__(d_query, d_key, d_k, d_v, heads, out, temperature, device, dtype, name)
        self.d_query, self.d_key = d_query, d_key

    def model(self, queries, keys):
        self.check_inputs(queries=queries, keys=keys)
        q = nodes("queries", queries, features=self.d_query)
        k = nodes("keys", keys, features=self.d_key)
        return self.attend(self.family_name, q, k, Uniform())

    def example_inputs(self, n=5, batch=1):
        return (self._randn(batch, n, self.d_query), self._randn(batch, n + 1, self.d_key))


def cross_attention(d_query, d_key=None, **kwargs) -> CrossAttention:
    """The cross-attention declaration; see ``CrossAttention``."""
    return CrossAttention(d_query, d_key, **kwargs)


def _case():
    m = cross_attention(7, 11, d_k=3, d_v=2, heads=3, dtype=torch.float64)
    return m, (randn64(2, 5, 7), randn64(2, 3, 11))


#: the catalogue's statement (structattn/models/_catalogue.py)
ENTRY = Entry(cross_attention, CrossAttention, case=_case,
              example=dict(d_query=8, heads=2),
              sizes=dict(d_query=1, d_key=1, heads=1, d_k=1, d_v=1, d_out=1))
