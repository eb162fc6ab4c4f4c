"""Absolute-position attention: positions enter the potential only."""

import math

import pytest
import torch

import structattn as sa

from ..reference import heads_of

TOL = 1e-6


def _x(*shape):
    return torch.randn(*shape, dtype=torch.float64)


@pytest.mark.parametrize("positions", ["learned", "sinusoidal"])
def test_absolute_positions_enter_the_potential_only(positions):
    m = sa.models.absolute_position_attention(6, max_len=9, positions=positions, d_k=3, heads=2,
                                              causal=True, dtype=torch.float64)
    x = _x(2, 5, 6)
    e = m.positions[:5]
    H = 2
    q, k = heads_of((x + e) @ m.W_q.T, H), heads_of((x + e) @ m.W_k.T, H)
    v = heads_of(x @ m.W_v.T, H)
    s = (q @ k.transpose(-1, -2) / math.sqrt(3)).masked_fill(
        ~torch.ones(5, 5, dtype=torch.bool).tril(), -math.inf)
    ref = (s.softmax(-1) @ v).transpose(-3, -2).flatten(-2) @ m.W_o.T
    torch.testing.assert_close(sa.compile(m)(x), ref, atol=TOL, rtol=0)
    assert sa.inference.compare(m, x).max_abs_diff < TOL


def test_absolute_positions_bad_input():
    m = sa.models.absolute_position_attention(6, max_len=4, d_k=3)
    with pytest.raises(ValueError, match=r"node set 'x' has 5 tokens .* max_len=4"):
        sa.compile(m)(torch.randn(1, 5, 6))
    with pytest.raises(ValueError, match=r"positions must be 'learned' or 'sinusoidal'"):
        sa.models.absolute_position_attention(6, positions="rotary")
    W = torch.randn(2, 3)

    def program(x):
        n = sa.nodes("x", x)
        phi = sa.edges("attn", n, n, sa.priors.Uniform())
        sa.potential(phi, sa.potentials.Positional(sa.potentials.Bilinear(W, W), torch.zeros(4, 3)))
        return sa.value(phi, sa.values.Linear(W))

    with pytest.raises(ValueError, match=r"edge family 'attn': positional encodings for children "
                                         r"'x' must have shape \(…, 5, 3\); got \(4, 3\)"):
        sa.compile(program)(torch.randn(1, 5, 3))
