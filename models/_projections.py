"""Shared parameters of the dot-product catalogue models: W_Q, W_K, W_V (and W_O)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from structattn.checks import check_size
from structattn.declaration import Declaration
from structattn.family import edges, potential
from structattn.family import value as expect
from structattn.heads import merge_heads
from structattn.nodes import nodes
from structattn.potentials import Bilinear, Positional, Rotary
from structattn.potentials.bilinear import check_temperature
from structattn.values import Linear


class ProjectedAttention(Declaration):
    """Holds ``W_q: (H·d_k, d_child)``, ``W_k: (H·d_k, d_parent)``, ``W_v: (H·d_v, d_parent)``
    and optionally ``W_o: (d_out, H·d_v)``; subclasses say which node sets they connect."""

    def __init__(self, d_child, d_parent, d_k, d_v, heads, out_features, temperature,
                 device=None, dtype=None, name="attn"):
        super().__init__()
        if not isinstance(name, str) or not name:
            raise ValueError(f"{type(self).__name__}: name must be a non-empty string; got {name!r}")
        self.family_name = name  # the edge family's name: distinct names let layers share a model
        owner = type(self).__name__
        d_k, d_v, heads = (check_size(owner, n, v) for n, v in
                           (("d_k", d_k), ("d_v", d_v), ("heads", heads)))
        if out_features is not None:
            out_features = check_size(owner, "d_out", out_features)
        learned = isinstance(temperature, str)
        if learned and temperature != "learned":
            raise ValueError(f"{type(self).__name__}: temperature must be a number > 0, a tensor, "
                             f"None (√d_k) or 'learned'; got {temperature!r}")
        if temperature is not None and not learned:  # a tensor: one, or one per head (heads,)
            temperature = check_temperature(temperature, type(self).__name__, heads)
        kw = {"device": device, "dtype": dtype}
        self.heads, self.d_k, self.d_v = heads, d_k, d_v
        self.rope_base = self.rope_dims = None  # rotary positions (TokenAttention's rope_base)
        # a learned temperature is τ = exp(log τ) > 0, initialised at √d_k
        self.log_temperature = (nn.Parameter(torch.full((), 0.5 * math.log(d_k), **kw))
                                if learned else None)
        self._temperature = None if learned else temperature
        self.W_q = nn.Parameter(torch.empty(heads * d_k, d_child, **kw))
        self.W_k = nn.Parameter(torch.empty(heads * d_k, d_parent, **kw))
        self.W_v = nn.Parameter(torch.empty(heads * d_v, d_parent, **kw))
        self.W_o = (nn.Parameter(torch.empty(out_features, heads * d_v, **kw))
                    if out_features else None)
        for p in (self.W_q, self.W_k, self.W_v, self.W_o):
            if p is not None:
                nn.init.xavier_uniform_(p)

    @property
    def temperature(self):
        """τ of the tempered posterior: fixed (float/None = √d_k) or learned (exp(log τ))."""
        return self._temperature if self.log_temperature is None else self.log_temperature.exp()

    def attend(self, name, children, parents, prior, *, value=None, positions=None,
               inference=None):
        """One multi-head edge family: bilinear potential (on x + positions, if given) and a
        value (default: linear W_V x_j); heads merged, then W_O. ``inference``: the family's
        inference scheme (None: read exactly)."""
        phi = edges(name, children, parents, prior, heads=self.heads, inference=inference)
        if self.rope_base is None:
            psi = Bilinear(self.W_q, self.W_k, heads=self.heads, temperature=self.temperature)
        else:  # rotary positions: queries and keys rotated by their positions
            psi = Rotary(self.W_q, self.W_k, heads=self.heads, temperature=self.temperature,
                         base=self.rope_base, dims=self.rope_dims)
        if positions is not None:
            psi = Positional(psi, positions)
        potential(phi, psi)
        value = Linear(self.W_v, heads=self.heads) if value is None else value
        y = merge_heads(expect(phi, value))
        return y if self.W_o is None else F.linear(y, self.W_o)


class TokenAttention(ProjectedAttention):
    """Attention among one set of tokens x ``(*batch, n, d_model)`` (children = parents):
    d_k defaults to d_model/heads, d_v to d_k, and W_O maps back to d_model. ``rope_base``
    (e.g. 10000.0) puts rotary positions on the potential (``potentials.Rotary``; ``rope_dims``
    of each head's d_k dimensions rotated, default all), under any prior.

    Args:
        d_model (int): the tokens' feature size, a positive int; x is ``(*batch, n, d_model)``.
        d_k (int | None): the per-head size of queries and keys, a positive int; None, the
            default, takes d_model // heads (then d_model must be divisible by heads).
        d_v (int | None): the per-head size of the values, a positive int; None, the default,
            takes d_k.
        heads (int): the number of heads, a positive int. Default 1.
        causal (bool): True restricts each token's parents to itself and its past (j ≤ i),
            as the subclass's prior reads it. Default False.
        out_proj (bool): True (default) holds ``W_O: (d_model, heads·d_v)``, so the output
            is ``(*batch, n, d_model)``; False leaves the merged heads ``(*batch, n,
            heads·d_v)``.
        temperature (float | torch.Tensor | Sequence[float] | str | None): τ of the
            potential: a finite number > 0, a floating-point tensor of one element or one per
            head ``(heads,)`` (a list or tuple of heads numbers becomes one), ``"learned"``
            (τ = exp(log τ), a parameter initialised at √d_k) or None, the default (√d_k).
        rope_base (float | None): the base of the rotary frequencies base^(−2k/rope_dims), a
            finite number > 1 (e.g. 10000.0); None, the default, puts no rotary positions on
            the potential.
        rope_dims (int | None): how many of each head's d_k dimensions rotate, an even int
            ≤ d_k; None, the default, rotates all d_k. Needs ``rope_base``.
        device (torch.device | str | None): the device of the parameters.
        dtype (torch.dtype | None): the dtype of the parameters.
        name (str): the edge family's name, a non-empty string; distinct names let several
            layers share one model. Default ``"attn"``.
    """

    def __init__(self, d_model, *, d_k=None, d_v=None, heads=1, causal=False, out_proj=True,
                 temperature=None, rope_base=None, rope_dims=None, device=None, dtype=None,
                 name="attn"):
        owner = type(self).__name__
        d_model, heads = check_size(owner, "d_model", d_model), check_size(owner, "heads", heads)
        if d_k is None and d_model % heads:
            raise ValueError(f"{owner}: d_model={d_model} is not divisible by "
                             f"heads={heads}; give d_k (the per-head size) explicitly")
        d_k = d_model // heads if d_k is None else d_k
        d_v = d_k if d_v is None else d_v
        super().__init__(d_model, d_model, d_k, d_v, heads, d_model if out_proj else None,
                         temperature, device, dtype, name)
        self.d_model, self.causal = d_model, causal
        if rope_base is None and rope_dims is not None:
            raise ValueError(f"{owner}: rope_dims={rope_dims!r} needs rope_base (rotary "
                             f"positions are on with rope_base, e.g. 10000.0)")
        if rope_base is not None:  # checked as the potential checks them
            Rotary(self.W_q, self.W_k, heads=self.heads, base=rope_base, dims=rope_dims)
            self.rope_base = float(rope_base)
            self.rope_dims = self.d_k if rope_dims is None else int(rope_dims)

    def tokens(self, x):
        self.check_inputs(x=x)
        return nodes("x", x, features=self.d_model)

    def example_inputs(self, n=5, batch=1):
        return (self._randn(batch, n, self.d_model),)
