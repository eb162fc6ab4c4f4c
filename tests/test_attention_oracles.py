"""Compiled attention == hand-written softmax attention == Pyro enumeration (float64, 1e-6)."""

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

import structattn as sa

from .conftest import PRIMES
from .reference import random_support, softmax_attention

TOL = 1e-6
primes = st.sampled_from(PRIMES)


def _x(*shape):
    return torch.randn(*shape, dtype=torch.float64)


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


def test_exact_map_edges_are_the_posterior_argmax():
    m = sa.models.self_attention(5, d_k=3, heads=2, causal=True, dtype=torch.float64)
    x = _x(3, 7, 5) * 3
    truth = sa.inference.exact(m, x)
    _, post = sa.compile(m)(x, return_posterior=True)
    assert torch.equal(truth.map_edges["attn"], post.argmax(-1))
    torch.testing.assert_close(truth.marginals["attn"].sum(-1), torch.ones(3, 2, 7,
                               dtype=torch.float64))


def test_posterior_is_gradient_of_log_partition():
    """p(φ_i = · | x) = ∂ log Z_i / ∂ψ_i — autograd as an oracle (torch-struct's reading)."""
    m = sa.models.self_attention(5, d_k=3, heads=1, causal=True, dtype=torch.float64)
    x = _x(1, 6, 5)
    s = sa.trace_structure(m.model, x)
    fam = s.families["attn"]
    psi = fam.potentials[0].pairwise(x, x).detach().requires_grad_()
    log_prior = s.log_prior("attn")
    logZ = torch.logsumexp(psi + log_prior, -1).sum()
    (grad,) = torch.autograd.grad(logZ, psi)
    torch.testing.assert_close(grad, s.posterior("attn"), atol=1e-12, rtol=0)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("return_posterior", [False, True])
def test_gradcheck(causal, return_posterior):
    m = sa.models.self_attention(5, d_k=2, d_v=3, heads=2, causal=causal, dtype=torch.float64)
    layer = sa.compile(m)
    x = _x(2, 3, 5).requires_grad_()

    def f(x, W_q, W_k, W_v, W_o):
        weights = {"declaration.W_q": W_q, "declaration.W_k": W_k, "declaration.W_v": W_v,
                   "declaration.W_o": W_o}
        out = torch.func.functional_call(layer, weights, (x,),
                                         {"return_posterior": return_posterior})
        return out if not return_posterior else out[0] + out[1].sum()

    params = [p.detach().clone().requires_grad_() for p in (m.W_q, m.W_k, m.W_v, m.W_o)]
    assert torch.autograd.gradcheck(f, (x, *params))


def test_gradcheck_masked_and_bias():
    logits = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    support = random_support(4, 4, generator=torch.Generator().manual_seed(1))
    W = [torch.randn(6, 5, dtype=torch.float64, requires_grad=True) for _ in range(3)]

    def program(x, logits, W_q, W_k, W_v):
        n = sa.nodes("x", x)
        phi = sa.edges("attn", n, n, sa.priors.Categorical(logits, support=support), heads=2)
        sa.potential(phi, sa.potentials.Bilinear(W_q, W_k, heads=2))
        return sa.value(phi, sa.values.Linear(W_v, heads=2))

    x = _x(2, 4, 5).requires_grad_()
    layer = sa.compile(program)
    assert torch.autograd.gradcheck(lambda *a: layer(*a), (x, logits, *W))
