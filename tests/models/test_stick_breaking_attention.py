"""Stick-breaking attention: compiled (the CPU kernel and the dense reading) == Pyro enumerating
the scan as written == a brute-force product in the test; the leftover mass; gradients through
the kernel; a constant β is the geometric prior with q = 1 − β; no N×N tensor forward or
backward; bad declarations refused."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import structattn as sa
from structattn import kernels
from structattn.compiling.lowering import operator_for
from structattn.kinds.stick_breaking import _ops, stick_breaking_table, stop_mass

from ..square import assert_no_square_tensor

f64 = torch.float64


def brute_force(scores: torch.Tensor, rows=None):
    """``(p, leftover)`` by the scan's product, written out: p_ij = σ(s_ij) Π_{j<l<i} σ(−s_il)
    for j < i. scores ``(C, P)``; ``rows``: only these children (the others stay zero)."""
    C, P = scores.shape
    p = torch.zeros(C, P, dtype=scores.dtype)
    left = torch.ones(C, dtype=scores.dtype)
    for i in range(C) if rows is None else rows:
        stick = torch.ones((), dtype=scores.dtype)
        for j in range(i - 1, -1, -1):
            beta = torch.sigmoid(scores[i, j])
            p[i, j] = beta * stick
            stick = stick * (1 - beta)
        left[i] = stick
    return p, left


def scores_of(m, x):
    """ψ per head ``(B, H, n, n)`` from the model's own parameters."""
    H, dk = m.heads, m.d_k
    q = (x @ m.W_q.T).unflatten(-1, (H, dk)).transpose(-2, -3)
    k = (x @ m.W_k.T).unflatten(-1, (H, dk)).transpose(-2, -3)
    return q @ k.transpose(-1, -2) / dk ** 0.5


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 7), heads=st.integers(1, 3), batch=st.integers(1, 2),
       seed=st.integers(0, 10_000))
def test_compiled_equals_pyro_enumerating_the_scan(n, heads, batch, seed):
    torch.manual_seed(seed)
    m = sa.models.stick_breaking_attention(6, heads=heads, d_k=2, dtype=f64)
    x = torch.randn(batch, n, 6, dtype=f64) * 2
    exact = sa.inference.exact(m, x)
    layer = sa.compile(m)
    y_kernel = layer(x)
    y, post, trace = layer(x, return_posterior=True, return_trace=True)
    with kernels.disabled():
        y_dense = sa.compile(m)(x)
    for got in (y_kernel, y, y_dense):
        torch.testing.assert_close(got, exact.output, rtol=0, atol=1e-10)
    torch.testing.assert_close(post, exact.marginals["attn"], rtol=0, atol=1e-10)
    # "no parent" keeps the rest: Pyro's marginals over the parents sum to 1 − leftover
    torch.testing.assert_close(trace.leftover["attn"], 1 - exact.marginals["attn"].sum(-1),
                               rtol=0, atol=1e-10)
    p, left = brute_force(scores_of(m, x)[0, 0])
    torch.testing.assert_close(post[0, 0], p, rtol=0, atol=1e-12)
    torch.testing.assert_close(trace.leftover["attn"][0, 0], left, rtol=0, atol=1e-12)


@pytest.mark.parametrize("reach", ["short", "long"])
def test_kernel_equals_the_product_across_blocks_and_chunks(reach):
    """600 tokens: several blocks of 64 children and chunks of 256 parents. Short reach (breaks
    likely): the kernel stops each block's scan early; long reach: it reads every pair. Either
    way it equals the brute-force product, and its leftover too."""
    torch.manual_seed(1)
    G, N, k, dv = 2, 600, 4, 3
    a, b = torch.randn(G, N, k, dtype=f64), torch.randn(G, N, k, dtype=f64)
    if reach == "long":
        a[..., 0], b[..., 0] = 1.0, -12.0  # β ≈ σ(−6): the stick outlasts 600 tokens
    v = torch.randn(G, N, dv, dtype=f64)
    ops = _ops()
    assert ops is not None, kernels.build_error()
    out, left, start = ops.forward(a, b, v, 0.5, stop_mass(f64))
    rows = [0, 1, 63, 64, 65, 255, 256, 257, 300, 511, 512, 513, 598, 599]
    p, want_left = brute_force((0.5 * a[1] @ b[1].T), rows)
    torch.testing.assert_close(out[1, rows], (p @ v[1])[rows], rtol=0, atol=1e-12)
    torch.testing.assert_close(left[1, rows], want_left[rows], rtol=0, atol=1e-12)
    if reach == "short":
        assert start[:, -1].min() > 0  # the last block never read back to the first token
    else:
        assert start.max() == 0
    # the backward (output and leftover) equals autograd through the dense reading
    dout, dleft = torch.randn_like(out), torch.randn_like(left)
    da, db, dv_ = ops.backward(dout, dleft, a, b, v, 0.5, out, left, start)
    leaves = [t.clone().requires_grad_() for t in (a, b, v)]
    allowed = torch.ones(N, N, dtype=torch.bool).tril(-1)
    p, left_dense = stick_breaking_table(0.5 * leaves[0] @ leaves[1].transpose(-1, -2), allowed)
    ((p @ leaves[2]) * dout).sum().add((left_dense * dleft).sum()).backward()
    for got, leaf in zip((da, db, dv_), leaves, strict=True):
        torch.testing.assert_close(got, leaf.grad, rtol=0, atol=1e-10)


def test_gradients_through_the_kernel_including_the_leftover():
    """gradcheck of the fused op (output and leftover) at 70 tokens — two blocks — and of the
    whole layer including its parameters (a learned temperature too)."""
    torch.manual_seed(2)
    ops = _ops()
    a = torch.randn(1, 70, 2, dtype=f64, requires_grad=True)
    b = torch.randn(1, 70, 2, dtype=f64)
    b[..., 0] = -3.0
    b.requires_grad_()
    v = torch.randn(1, 70, 2, dtype=f64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b, v: ops.forward(a, b, v, 0.7, 0.0)[:2],
                                    (a, b, v), atol=1e-7)
    m = sa.models.stick_breaking_attention(4, heads=2, d_k=2, temperature="learned", dtype=f64)
    x = torch.randn(1, 12, 4, dtype=f64, requires_grad=True)
    layer = sa.compile(m)
    params = [m.W_q, m.W_k, m.W_v, m.W_o, m.log_temperature]
    assert torch.autograd.gradcheck(lambda x, *ps: layer(x), (x, *params), atol=1e-7)


def test_a_constant_break_probability_is_the_geometric_prior_with_q_one_minus_beta():
    """ψ ≡ c (one constant feature): β = σ(c) for every pair, so p(φ_i = j) = β q^(i−1−j) with
    q = 1 − β — the geometric prior over distance, truncated at the first token, times the
    stick used, 1 − q^i. Checked against a softmax layer with that prior and no potential."""
    torch.manual_seed(3)
    n, c = 9, -0.8
    beta = torch.sigmoid(torch.tensor(c, dtype=f64))
    q = 1 - beta
    m = sa.models.stick_breaking_attention(3, d_k=1, temperature=1.0, out_proj=False,
                                           dtype=f64)
    with torch.no_grad():
        m.W_q.copy_(torch.tensor([[c, 0.0, 0.0]], dtype=f64))
        m.W_k.copy_(torch.tensor([[1.0, 0.0, 0.0]]))
    x = torch.randn(1, n, 3, dtype=f64)
    x[..., 0] = 1.0
    y, post, trace = sa.compile(m)(x, return_posterior=True, return_trace=True)

    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    logits = torch.where(j < i, (i - 1 - j) * q.log(), float("-inf")).to(f64)
    logits[0, 0] = 0.0  # the first token: no past; give the softmax one outcome

    class Geometric(sa.Declaration):
        def model(self, x):
            tok = sa.nodes("x", x, features=3)
            phi = sa.edges("attn", tok, tok, sa.priors.Categorical(logits))
            sa.potential(phi, sa.potentials.Bilinear(torch.zeros(1, 3, dtype=f64),
                                                     torch.zeros(1, 3, dtype=f64)))
            return sa.value(phi, sa.values.Linear(m.W_v))

    y_geo, post_geo = sa.compile(Geometric())(x, return_posterior=True)
    used = (1 - q ** torch.arange(n, dtype=f64))[:, None]  # 1 − leftover
    torch.testing.assert_close(post[0, 0, 1:], (post_geo[0, 0] * used)[1:], rtol=0, atol=1e-12)
    torch.testing.assert_close(y[0, 1:], (y_geo[0, 0] * used)[1:], rtol=0, atol=1e-12)
    torch.testing.assert_close(trace.leftover["attn"][0, 0], 1 - used[:, 0], rtol=0, atol=1e-12)
    assert y[0, 0].abs().max() == 0  # the first token has no parent: value zero


def test_no_children_by_parents_tensor_forward_or_backward():
    torch.manual_seed(0)
    N = 96
    m = sa.models.stick_breaking_attention(16, heads=2)
    x = torch.randn(1, N, 16, requires_grad=True)
    assert_no_square_tensor(sa.compile(m), x, N)
    assert m.W_q.grad.abs().sum() > 0 and m.W_k.grad.abs().sum() > 0 and x.grad is not None


def test_float32_and_bfloat16_follow_float64():
    torch.manual_seed(4)
    m = sa.models.stick_breaking_attention(16, heads=2, dtype=f64)
    x = torch.randn(2, 300, 16, dtype=f64)
    with torch.no_grad():
        y64 = sa.compile(m)(x)
        y32 = sa.compile(m.float())(x.float())
        y16 = sa.compile(m.bfloat16())(x.bfloat16())
    assert (y32.double() - y64).abs().max() < 1e-5
    assert (y16.double() - y64).abs().max() < 0.1


def test_a_second_potential_is_refused():
    m = sa.models.stick_breaking_attention(4, dtype=f64)

    class Two(sa.Declaration):
        def model(self, x):
            tok = sa.nodes("x", x, features=4)
            phi = sa.edges("attn", tok, tok, sa.priors.StickBreaking())
            sa.potential(phi, sa.potentials.Bilinear(m.W_q, m.W_k))
            sa.potential(phi, sa.potentials.Bilinear(m.W_q, m.W_k))
            return sa.value(phi, sa.values.Linear(m.W_v))

    with pytest.raises(ValueError, match=r"edge family 'attn': a StickBreaking prior takes at "
                                         r"most 1 potential.*got another, Bilinear"):
        sa.compile(Two())(torch.randn(1, 3, 4, dtype=f64))


def test_more_children_than_parents_is_refused():
    class Cross(sa.Declaration):
        def model(self, x, z):
            c, p = sa.nodes("c", x, features=2), sa.nodes("p", z, features=2)
            phi = sa.edges("attn", c, p, sa.priors.StickBreaking())
            sa.potential(phi, sa.potentials.DotProduct())
            return sa.value(phi, sa.values.Identity())

    with pytest.raises(ValueError, match=r"edge family 'attn': a StickBreaking prior scans .* "
                                         r"got 5 children and 3 parents"):
        sa.compile(Cross())(torch.randn(1, 5, 2, dtype=f64), torch.randn(1, 3, 2, dtype=f64))


def test_a_stick_breaking_family_has_no_log_partition():
    m = sa.models.stick_breaking_attention(4, dtype=f64)
    x = torch.randn(1, 3, 4, dtype=f64)
    structure = sa.trace_structure(m.model, x)
    op = operator_for(structure.families["attn"])
    with pytest.raises(NotImplementedError, match=r"reads its potential as break logits"):
        op.log_partition()


def test_tol_bounds_what_the_kernel_leaves_unread():
    """Long reach (ψ ≈ −5: the stick lasts hundreds of tokens), 1,200 tokens: with tol=1e-2 a
    scan stops once its stick is ≤ 1e-2, so the output moves from the whole-past reading
    (tol=0) — by at most the unread mass (≤ the stick at the stop ≤ tol) times max|v| through
    W_O; the leftover reported is then that stick, an upper bound of the true one."""
    torch.manual_seed(5)
    n = 1200
    layers = {}
    for tol in (0.0, 1e-2, None):
        torch.manual_seed(5)
        m = sa.models.stick_breaking_attention(4, d_k=2, temperature=1.0, tol=tol, dtype=f64)
        with torch.no_grad():
            m.W_q[0] = torch.tensor([-5.0, 0, 0, 0], dtype=f64)
            m.W_k[0] = torch.tensor([1.0, 0, 0, 0], dtype=f64)
        layers[tol] = m
    x = torch.randn(1, n, 4, dtype=f64)
    x[..., 0] = 1.0
    with torch.no_grad():
        y0, t0 = sa.compile(layers[0.0])(x, return_trace=True)
        y1, t1 = sa.compile(layers[1e-2])(x, return_trace=True)
        y_default = sa.compile(layers[None])(x)
        m = layers[0.0]
        v = x @ m.W_v.T
    bound = 1e-2 * v.abs().max() * m.W_o.abs().sum(-1).max()
    assert 1e-6 < (y1 - y0).abs().max() <= bound
    left0, left1 = t0.leftover["attn"], t1.leftover["attn"]
    moved = left1 != left0
    assert moved.any() and (left1[moved] <= 1e-2).all() and (left1 >= left0).all()
    torch.testing.assert_close(y_default, y0, rtol=0, atol=1e-13)  # default: rounding level


@pytest.mark.parametrize("tol", [-0.1, 1.0, "small", True])
def test_a_bad_tol_is_refused(tol):
    with pytest.raises(ValueError, match=r"StickBreaking prior: tol must be None .* got"):
        sa.models.stick_breaking_attention(4, tol=tol)
