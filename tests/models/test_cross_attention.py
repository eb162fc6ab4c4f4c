"""Cross attention, any batch shape, against a hand-written reference and Pyro."""

import hypothesis.strategies as st
import torch
from hypothesis import given, settings

import structattn as sa

from ..conftest import PRIMES
from ..reference import softmax_attention

TOL = 1e-6
primes = st.sampled_from(PRIMES)


def _x(*shape):
    return torch.randn(*shape, dtype=torch.float64)


@settings(max_examples=20, deadline=None)
@given(batch=st.lists(primes, min_size=0, max_size=2), M=primes, N=primes, dq=primes,
       dk=primes, H=st.sampled_from([1, 2]), seed=st.integers(0, 2**16))
def test_cross_attention_any_batch_shape(batch, M, N, dq, dk, H, seed):
    torch.manual_seed(seed)
    m = sa.models.cross_attention(dq, dk, d_k=3, d_v=2, heads=H, dtype=torch.float64)
    q, k = _x(*batch, M, dq), _x(*batch, N, dk)
    y = sa.compile(m)(q, k)
    ref, _ = softmax_attention(m.W_q, m.W_k, m.W_v, m.W_o, q, k, H)
    assert y.shape == (*batch, M, dq)
    torch.testing.assert_close(y, ref, atol=TOL, rtol=0)
    truth = sa.inference.exact(m, q, k)
    torch.testing.assert_close(truth.output, ref, atol=TOL, rtol=0)
    assert truth.marginals["attn"].shape == (*batch, H, M, N)
