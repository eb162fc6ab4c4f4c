"""Multihop attention: a weighted sum of matrix powers of the posterior."""

import pytest
import torch

import structattn as sa

from ..reference import heads_of, softmax_attention

TOL = 1e-6


def _x(*shape):
    return torch.randn(*shape, dtype=torch.float64)


@pytest.mark.parametrize("weights", [(0, 1, 1), (1 / 3, 1 / 3, 1 / 3), (0.5, -1, 0, 2)])
@pytest.mark.parametrize("causal", [False, True])
def test_multihop_is_a_sum_of_matrix_powers(weights, causal):
    m = sa.models.multihop_attention(6, d_k=3, heads=2, hop_weights=weights, causal=causal,
                                     dtype=torch.float64)
    x = _x(2, 4, 6)
    _, P = softmax_attention(m.W_q, m.W_k, m.W_v, None, x, x, 2, causal=causal)
    V = heads_of(x @ m.W_v.T, 2)
    ref = sum(w * torch.linalg.matrix_power(P, k) @ V for k, w in enumerate(weights))
    ref = ref.transpose(-3, -2).flatten(-2) @ m.W_o.T
    torch.testing.assert_close(sa.compile(m)(x), ref, atol=TOL, rtol=0)
    truth = sa.inference.exact(m, x)
    torch.testing.assert_close(truth.output, ref, atol=TOL, rtol=0)
    if len(weights) > 2:  # Pyro's marginal of the second hop is P²
        torch.testing.assert_close(truth.marginals["attn.hop2"], P @ P, atol=TOL, rtol=0)


def test_multihop_bad_input():
    with pytest.raises(ValueError, match=r"weights must be \(w_0, …, w_K\) with K ≥ 1"):
        sa.models.multihop_attention(6, hop_weights=(1.0,))
    W = torch.randn(2, 3)

    def program(q, k):
        a, b = sa.nodes("queries", q), sa.nodes("keys", k)
        phi = sa.edges("attn", a, b, sa.priors.Uniform())
        sa.potential(phi, sa.potentials.Bilinear(W, W))
        return sa.value(phi, sa.values.Hops(W))

    with pytest.raises(ValueError, match=r"edge family 'attn': a Hops value walks along edges.*"
                                         r"'queries' and 'keys'"):
        sa.compile(program)(torch.randn(1, 3, 3), torch.randn(1, 4, 3))


def test_multihop_with_a_single_token():
    m = sa.models.multihop_attention(5, d_k=2, heads=2, dtype=torch.float64)
    x = _x(2, 1, 5)
    assert sa.inference.compare(m, x).max_abs_diff < TOL
