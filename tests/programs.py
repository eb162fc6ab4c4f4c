"""Small declarations shared by tests: one edge family over tokens ``x`` with a given prior."""

import math

import torch

import structattn as sa


def program(x, W, prior, heads=1, inference=None):
    n = sa.nodes("x", x)
    phi = sa.edges("attn", n, n, prior, heads=heads, inference=inference)
    sa.potential(phi, sa.potentials.Bilinear(W, W, heads=heads))
    return sa.value(phi, sa.values.Identity(heads=heads))


def one_family_program(prior_fn, heads=1, d=4, value=None):
    """``(program, W)``: one self-attention family over ``x`` with the prior ``prior_fn(*extra)``
    (``program(x, *extra)``), a Bilinear potential and a linear value (or ``value(W_v, heads)``),
    on three fixed float64 weights ``W`` ``(heads·2, d)``."""
    g = torch.Generator().manual_seed(7)
    W = [torch.randn(heads * 2, d, generator=g, dtype=torch.float64) for _ in range(3)]

    def program(x, *extra):
        n = sa.nodes("x", x)
        phi = sa.edges("attn", n, n, prior_fn(*extra), heads=heads)
        sa.potential(phi, sa.potentials.Bilinear(W[0], W[1], heads=heads))
        v = sa.values.Linear(W[2], heads=heads) if value is None else value(W[2], heads)
        return sa.value(phi, v)
    return program, W


def scores_of(x, W, heads):
    """ψ_ij = ⟨W x_i, W x_j⟩_h / √d_k per head: ``(*batch, H, N, N)`` (the Bilinear potential)."""
    z = (x @ W.T).unflatten(-1, (heads, -1)).transpose(-2, -3)  # (*batch, H, N, d_k)
    return z @ z.transpose(-1, -2) / math.sqrt(z.shape[-1])


def history(trace, family="attn"):
    """The mean-field windows' history of ``family`` in a compiled module's ``Trace``."""
    return trace.mean_field[family]
