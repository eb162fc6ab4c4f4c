"""Small declarations shared by tests: one edge family over tokens ``x`` with a given prior."""

import math

import structattn as sa


def program(x, W, prior, heads=1, inference=None):
    n = sa.nodes("x", x)
    phi = sa.edges("attn", n, n, prior, heads=heads, inference=inference)
    sa.potential(phi, sa.potentials.Bilinear(W, W, heads=heads))
    return sa.value(phi, sa.values.Identity(heads=heads))


def scores_of(x, W, heads):
    """ψ_ij = ⟨W x_i, W x_j⟩_h / √d_k per head: ``(*batch, H, N, N)`` (the Bilinear potential)."""
    z = (x @ W.T).unflatten(-1, (heads, -1)).transpose(-2, -3)  # (*batch, H, N, d_k)
    return z @ z.transpose(-1, -2) / math.sqrt(z.shape[-1])


def history(trace, family="attn"):
    """The mean-field windows' history of ``family`` in a compiled module's ``Trace``."""
    return trace.mean_field[family]
