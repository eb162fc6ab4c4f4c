"""The certificate read from the CPU's compiled kernels (``certified_read`` with
``key_bias.band_rows``): a band per head certified by the band kernel's own log-sums, never
scored apart. Oracle: a dense float64 softmax of the same inputs (nothing of the band, the
kernels or the certificate reused); the true posterior mass beyond each head's width never
exceeds the child's bound, in float64 and float32, and the output is that softmax restricted
to the width and renormalised."""

import math

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

import structattn as sa
from structattn.certificates.certified_read import certified_band_attention
from structattn.kinds.key_bias import band_applies, band_rows

f64 = torch.float64
pytestmark = pytest.mark.skipif(not band_applies(torch.zeros(1, 2, 1), torch.zeros(1, 2, 1)),
                                reason="the compiled CPU kernels are not built here")


def causal_softmax(a, b, h, scale):
    """p(φ_i = j) ∝ e^{scale·⟨a_i, b_j⟩ + h_j} over j ≤ i, float64, ``(G, N, N)``."""
    n = a.shape[-2]
    s = scale * a.double() @ b.double().transpose(-1, -2) + h.double()[..., None, :]
    past = torch.ones(n, n, dtype=torch.bool, device=a.device).tril()
    return torch.softmax(s.masked_fill(~past, float("-inf")), -1)


#: an attack on the certificate read from a kernel's log-sums (the sizes apart)
ATTACK = dict(heads=st.integers(1, 3), k=st.integers(1, 6), sharp=st.floats(0.1, 3.0),
              slope=st.floats(0.0, 2.0), gated=st.booleans(),
              scale=st.floats(-2.0, 2.0).filter(lambda s: abs(s) > 1e-3),
              eps_exp=st.integers(1, 6), dtype=st.sampled_from([f64, torch.float32]),
              seed=st.integers(0, 2**31 - 1), planted=st.booleans())


def attack(read, device, widest, n, heads, k, sharp, slope, gated, scale, eps_exp, dtype, seed,
           planted):
    """Random factors (a strong match planted far back), ALiBi-like or gate-like h, float64
    and float32, read by ``read`` (``certified_band_attention``'s) on ``device``: the true
    posterior mass beyond each head's width — a dense float64 softmax of the same (rounded)
    inputs — never exceeds the child's bound, every bound is ≤ eps, and the output is that
    softmax restricted to the width and renormalised."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(heads, n, k, generator=g, dtype=f64) * sharp
    b = torch.randn(heads, n, k, generator=g, dtype=f64)
    if planted and n > 4:  # a strong match far back for the last token
        b[:, 1] = a[:, -1] * 3 * math.copysign(1.0, scale)
    u = torch.randn(heads, n, 3, generator=g, dtype=f64)
    if gated:  # h_j = −Σ_{l ≤ j} log f_l: FoX's
        h = -torch.nn.functional.logsigmoid(torch.randn(heads, n, generator=g, dtype=f64) * 2
                                            + 4 / max(slope, 0.1)).cumsum(-1)
    else:  # h_j = m·j: ALiBi's
        h = slope * torch.rand(heads, 1, generator=g, dtype=f64) * torch.arange(n, dtype=f64)
    a, b, u, h = (t.to(device, dtype) for t in (a, b, u, h))
    eps = 10.0 ** -eps_exp
    out, c = certified_band_attention(a, b, u, scale, h, eps, block=16, widest=widest, read=read)
    assert c.certified and bool((c.bound <= eps).all())
    p = causal_softmax(a, b, h, scale)
    d = torch.arange(n, device=device)[:, None] - torch.arange(n, device=device)
    outside = d > c.heads[:, None, None]  # (H, N, N)
    true = (p * outside).sum(-1)
    assert bool((true <= c.bound * (1 + 1e-9) + 1e-300).all()), float((true - c.bound).max())
    kept = p.masked_fill(outside, 0.0)
    want = (kept / kept.sum(-1, keepdim=True)) @ u.double()
    # (float32: the logits s + h reach ~600 here, each rounded by up to u·|logit|, which
    # moves an output by at most 2·max|δ|·max|u| — the softmax's derivative)
    top = float((scale * a.double() @ b.double().transpose(-1, -2) + h.double()[..., None, :])
                .abs().max())
    atol32 = max(1e-5, 2 * 2.0 ** -24 * top * float(u.abs().max()))
    torch.testing.assert_close(out.double(), want, rtol=0 if dtype == f64 else 2e-4,
                               atol=1e-10 if dtype == f64 else atol32)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(2, 300), **ATTACK)
def test_the_cpu_read_certificate_never_leaves_out_more_than_its_bound(n, **kw):
    attack(band_rows, "cpu", 2 * n // 5, n, **kw)


def test_a_sharp_prior_reads_a_band_and_a_flat_one_all_of_the_past():
    """A FoX layer on the CPU: fast gates certify a band that skips most pairs; gates at 1
    certify none, and the whole past is read at once (bound 0), as the exact layer reads it."""
    torch.manual_seed(0)
    x = torch.randn(1, 600, 16, dtype=f64)
    sharp = sa.models.forgetting_attention(16, heads=2, gate_bias=-1.0, tol=1e-4, dtype=f64)
    with torch.no_grad():
        _, trace = sa.compile(sharp)(x, return_trace=True)
    c = trace.truncation[sharp.family_name]
    assert c.certified and c.skipped > 0.5 and bool((c.heads < 300).all())
    flat = sa.models.forgetting_attention(16, heads=2, gate_bias=30.0, tol=1e-4, dtype=f64)
    exact = sa.models.forgetting_attention(16, heads=2, gate_bias=30.0, dtype=f64)
    exact.load_state_dict(flat.state_dict())
    with torch.no_grad():
        y, trace = sa.compile(flat)(0.01 * x, return_trace=True)
        c = trace.truncation[flat.family_name]
        assert c.skipped == 0 and bool((c.bound == 0).all()) and bool((c.heads == 599).all())
        torch.testing.assert_close(y, sa.compile(exact)(0.01 * x), rtol=0, atol=1e-12)


def test_gradients_through_the_cpu_band():
    torch.manual_seed(8)
    m = sa.models.alibi_attention(4, heads=2, d_k=2, tol=0.05, block_size=16, dtype=f64)
    m.slopes.copy_(torch.tensor([2.0, 0.0], dtype=f64))
    x = torch.randn(1, 40, 4, dtype=f64, requires_grad=True)
    layer = sa.compile(m)
    _, trace = layer(x, return_trace=True)
    assert int(trace.truncation[m.family_name].heads[0, 0]) < 39  # a band, read by the kernel
    assert torch.autograd.gradcheck(lambda xx, wq: layer(xx), (x, m.W_q))


@pytest.mark.parametrize("slopes", [(2.0, 0.0), (0.0, 0.0)])
def test_gradients_through_every_reading(slopes):
    """A band per head, and all of the past read at once where no band could be certified:
    each differentiable (gradcheck), and equal to the exact layer's gradient where nothing
    is skipped."""
    torch.manual_seed(9)
    m = sa.models.alibi_attention(4, heads=2, d_k=2, tol=0.05, block_size=16, dtype=f64)
    m.slopes.copy_(torch.tensor(slopes, dtype=f64))
    x = torch.randn(1, 40, 4, dtype=f64, requires_grad=True)
    layer = sa.compile(m)
    assert torch.autograd.gradcheck(lambda xx, wq: layer(xx), (x, m.W_q))
    if slopes == (0.0, 0.0):  # uniform heads: the whole past, the exact layer's gradient
        exact = sa.models.alibi_attention(4, heads=2, d_k=2, block_size=16, dtype=f64)
        exact.load_state_dict(m.state_dict())
        g = torch.autograd.grad(layer(x).sum(), (x, m.W_q))
        want = torch.autograd.grad(sa.compile(exact)(x).sum(), (x, exact.W_q))
        for got, w in zip(g, want, strict=True):
            torch.testing.assert_close(got, w, rtol=0, atol=1e-12)
