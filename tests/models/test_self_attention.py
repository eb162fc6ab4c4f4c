"""Self attention == hand-written softmax attention == Pyro enumeration (float64, 1e-6)."""

import hypothesis.strategies as st
import torch
from hypothesis import given, settings

import structattn as sa

from ..conftest import PRIMES
from ..reference import random_support, softmax_attention

TOL = 1e-6
primes = st.sampled_from(PRIMES)


@settings(max_examples=25, deadline=None)
@given(B=primes, N=primes, d=primes, d_k=primes, d_v=primes, H=st.sampled_from([1, 2, 3]),
       causal=st.booleans(), masked=st.booleans(), out_proj=st.booleans(),
       seed=st.integers(0, 2**16))
def test_self_attention_matches_reference_and_pyro(B, N, d, d_k, d_v, H, causal, masked,
                                                   out_proj, seed):
    g = torch.Generator().manual_seed(seed)
    m = sa.models.self_attention(d, d_k=d_k, d_v=d_v, heads=H, causal=causal,
                                 out_proj=out_proj, dtype=torch.float64)
    x = torch.randn(B, N, d, generator=g, dtype=torch.float64)
    mask = None
    if masked:
        mask = random_support(N, N, generator=g)
        if causal:  # keep a parent for every child under j ≤ i as well
            mask[:, 0] = True
    layer = sa.compile(m)
    args = (x,) if mask is None else (x, mask)
    y, post = layer(*args, return_posterior=True)
    y_fast = layer(*args)
    ref, p_ref = softmax_attention(m.W_q, m.W_k, m.W_v, m.W_o, x, x, H, mask=mask,
                                   causal=causal)
    assert y.shape == (B, N, d if out_proj else H * d_v)
    assert post.shape == (B, H, N, N)
    torch.testing.assert_close(y_fast, ref, atol=TOL, rtol=0)
    torch.testing.assert_close(y, ref, atol=TOL, rtol=0)
    torch.testing.assert_close(post, p_ref, atol=TOL, rtol=0)
    report = sa.inference.compare(m, *args)
    assert report.max_abs_diff < TOL, str(report)
