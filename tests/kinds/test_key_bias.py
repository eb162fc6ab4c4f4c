"""A log prior g_i + h_j on the CPU (``kinds/key_bias.py``): h as the fused kernel's mask,
and with gradients the compiled kernel's backward (h's gradient included). Checked against
softmax written out in float64 and its autograd, against the widened SDPA path (which serves
where the kernel is not built), and by gradcheck (also: tests/priors/test_separable.py and the
catalogue's gradcheck)."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import structattn as sa
from structattn.kinds import key_bias
from structattn.kinds.dense import with_parent_terms

f64 = torch.float64


def by_hand(a, b, u, h, scale, causal):
    """softmax_j(scale·⟨a_i, b_j⟩ + h_j) u_j over j ≤ i or every j, in float64."""
    s = scale * a @ b.transpose(-1, -2) + h.unsqueeze(-2)
    if causal:
        C, P = s.shape[-2:]
        s = s.masked_fill(torch.ones(C, P, dtype=torch.bool).triu(1), float("-inf"))
    return s.softmax(-1) @ u


def widened(a, b, u, h, scale, causal):
    a2, b2, u2 = with_parent_terms(a, b, u, h, scale)
    return F.scaled_dot_product_attention(a2, b2, u2, is_causal=causal, scale=scale)[..., :u.shape[-1]]


@settings(max_examples=30, deadline=None)
@given(C=st.integers(1, 9), extra=st.integers(0, 4), d_k=st.integers(1, 6), d_v=st.integers(1, 6),
       heads=st.integers(1, 3), batch=st.integers(1, 2), causal=st.booleans(),
       shared_h=st.booleans(), seed=st.integers(0, 10_000), scale=st.sampled_from([0.7, -0.7]))
def test_equals_softmax_written_out_and_the_widened_path(C, extra, d_k, d_v, heads, batch, causal,
                                                         shared_h, seed, scale):
    """(A negative scale too: the fused CPU kernel's first causal child was NaN under one.)"""
    g = torch.Generator().manual_seed(seed)
    P = C + extra
    a = torch.randn(batch, heads, C, d_k, generator=g, dtype=f64)
    b = torch.randn(batch, heads, P, d_k, generator=g, dtype=f64)
    u = torch.randn(batch, heads, P, d_v, generator=g, dtype=f64)
    h = -torch.rand(1 if shared_h else batch, heads, P, generator=g, dtype=f64).cumsum(-1) * 3
    out = key_bias.key_bias_attention(a, b, u, h, scale, causal)
    assert out.shape == (batch, heads, C, d_v)
    torch.testing.assert_close(out, by_hand(a, b, u, h, scale, causal), rtol=0, atol=1e-12)
    if scale > 0:  # (the public SDPA's causal reading has the same NaN under a negative one)
        torch.testing.assert_close(out, widened(a, b, u, h, scale, causal), rtol=0, atol=1e-12)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("lead", [(), (2,), (2, 3, 2)])
def test_any_leading_dims(causal, lead):
    """No leading dims, heads only, and batch dims before the heads (h per head, shared)."""
    torch.manual_seed(0)
    a, b = torch.randn(*lead, 6, 3, dtype=f64), torch.randn(*lead, 7, 3, dtype=f64)
    u = torch.randn(*lead, 7, 5, dtype=f64)
    h = -torch.rand(*lead[-1:], 7, dtype=f64).cumsum(-1)
    out = key_bias.key_bias_attention(a, b, u, h, 0.5, causal)
    torch.testing.assert_close(out, by_hand(a, b, u, h, 0.5, causal), rtol=0, atol=1e-12)


def test_taken_on_the_cpu_in_single_or_double_precision_with_gradients_where_built():
    x = torch.zeros(1, 1, 2, 2)
    w = x.clone().requires_grad_()
    assert key_bias.applies(x, x, x, x[0, 0, 0])
    assert key_bias.applies(x.double(), x.double(), x.double(), x[0, 0, 0])
    assert not key_bias.applies(x.bfloat16(), x.bfloat16(), x.bfloat16(), x[0, 0, 0])
    assert not key_bias.applies(x.to("meta"), x.to("meta"), x.to("meta"), x[0, 0, 0])
    assert key_bias.applies(x, w, x, x[0, 0, 0])  # a gradient is asked for: the kernel
    assert key_bias.applies(x, x, x, w[0, 0, 0])  # … of the prior's term too
    with sa.kernels.disabled():  # no kernel: only without gradients
        assert not key_bias.applies(x, w, x, x[0, 0, 0])
        assert not key_bias.applies(x, x, x, w[0, 0, 0])
        assert key_bias.applies(x, x, x, x[0, 0, 0])
        with torch.no_grad():
            assert key_bias.applies(x, w, x, x[0, 0, 0])


@settings(max_examples=30, deadline=None)
@given(C=st.integers(1, 300), extra=st.integers(0, 4), d_k=st.integers(1, 6),
       d_v=st.integers(1, 6), heads=st.integers(1, 3), batch=st.integers(1, 2),
       causal=st.booleans(), shared_h=st.booleans(), seed=st.integers(0, 10_000))
def test_gradients_equal_those_of_softmax_written_out(C, extra, d_k, d_v, heads, batch, causal,
                                                      shared_h, seed):
    """The kernel's backward (tiles of 128 children × 256 parents: sizes up to 300 cross
    them) against autograd through ``by_hand``: every factor's gradient and the prior's
    term's, float64, to 1e-12."""
    g = torch.Generator().manual_seed(seed)
    P = C + extra  # causal: j ≤ i, aligned at the first token, as the fused kernel's
    a = torch.randn(batch, heads, C, d_k, generator=g, dtype=f64)
    b = torch.randn(batch, heads, P, d_k, generator=g, dtype=f64)
    u = torch.randn(batch, heads, P, d_v, generator=g, dtype=f64)
    h = -torch.rand(1 if shared_h else batch, heads, P, generator=g, dtype=f64).cumsum(-1) / P
    dout = torch.randn(batch, heads, C, d_v, generator=g, dtype=f64)
    ins = [t.clone().requires_grad_() for t in (a, b, u, h)]
    out = key_bias.key_bias_attention(*ins, 0.7, causal)
    got = torch.autograd.grad(out, ins, dout)
    ref = [t.clone().requires_grad_() for t in (a, b, u, h)]
    want_out = by_hand(*ref, 0.7, causal)
    want = torch.autograd.grad(want_out, ref, dout)
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-12)
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-11)


@pytest.mark.parametrize("causal", [True, False])
def test_gradcheck(causal):
    torch.manual_seed(1)
    a, b, u = (torch.randn(2, 5, 3, dtype=f64, requires_grad=True) for _ in range(3))
    h = torch.randn(2, 5, dtype=f64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda *t: key_bias.key_bias_attention(*t, 0.6, causal), (a, b, u, h))


def test_the_kernel_refuses_what_it_cannot_read():
    ops = sa.kernels.key_bias()
    q = torch.randn(1, 4, 3, dtype=f64)
    with pytest.raises(RuntimeError, match=r"key_bias.backward: shapes"):
        ops.backward(torch.randn(1, 1, 4, 3, dtype=f64), q[None], torch.randn(1, 1, 5, 3, dtype=f64),
                     torch.randn(1, 1, 6, 3, dtype=f64), torch.randn(1, 1, 5, dtype=f64),
                     torch.randn(1, 1, 4, 3, dtype=f64), torch.randn(1, 1, 4, dtype=f64), 1.0, True)
    with pytest.raises(RuntimeError, match="key_bias.backward: float32 or float64"):
        z = torch.zeros(1, 1, 4, 3, dtype=torch.bfloat16)
        ops.backward(z, z, z, z, z[..., 0], z, z[..., 0], 1.0, True)


def test_fox_infers_and_trains_through_it():
    """A compiled FoX layer's plan holds the masked kernel as one node, without gradients
    (PyTorch's fused kernel) and with them (the custom operator around it, whose backward is
    the compiled kernel); without the kernel, training takes the widened path. All give the
    same output, and so does an export."""
    torch.manual_seed(0)
    m = sa.models.forgetting_attention(8, heads=2, dtype=f64)
    x = torch.randn(2, 11, 8, dtype=f64)

    def plan_targets():
        layer = sa.compile(m)
        for _ in range(3):
            y = layer(x)
        (plan,) = layer.plans.values()
        return y, [str(n.target) for n in plan.graph.graph.nodes if n.op == "call_function"]

    with torch.no_grad():
        y_inference, targets = plan_targets()
    assert any("flash_attention_for_cpu" in t for t in targets), targets
    y_training, targets = plan_targets()
    assert any("structattn_key_bias.forward" in t for t in targets), targets
    with sa.kernels.disabled():
        y_widened, targets = plan_targets()
    assert not any("flash_attention_for_cpu" in t or "key_bias" in t for t in targets), targets
    torch.testing.assert_close(y_inference, y_training, rtol=0, atol=1e-12)
    torch.testing.assert_close(y_inference, y_widened, rtol=0, atol=1e-12)
    with torch.no_grad():
        program = sa.export(m, x)
        torch.testing.assert_close(program.module()(x), y_inference, rtol=0, atol=1e-12)


@pytest.mark.parametrize("factory", ["forgetting_attention", "alibi_attention"])
def test_inference_equals_pyro_exact_enumeration(factory, monkeypatch):
    """The masked reading against the ground truth from the same declaration (Pyro's exact
    enumeration of every edge), float64, no gradients: the kernel is the one that ran."""
    calls = []
    flash = key_bias._flash
    monkeypatch.setattr(key_bias, "_flash", lambda *a, **k: calls.append(1) or flash(*a, **k))
    torch.manual_seed(0)
    m = getattr(sa.models, factory)(8, heads=2, dtype=f64)
    x = torch.randn(2, 9, 8, dtype=f64)
    with torch.no_grad():
        report = sa.inference.compare(m, x, atol=1e-10)
    assert calls, "the masked kernel did not run"
    assert report.passed, report
    assert report.max_abs_diff < 1e-10


@pytest.mark.parametrize("dtype", [torch.float32, f64])
@pytest.mark.parametrize("heads_view", [True, False])
def test_the_operators_pass_opcheck(dtype, heads_view):
    """The custom operators' schemas, fake (meta) kernels — the real outputs' shapes, strides
    and dtypes, for a projection's transposed heads and for contiguous tensors — and the
    forward's autograd rule, as ``torch.library.opcheck`` tests them."""
    torch.manual_seed(2)

    def heads(t):  # (B, N, H·d) → (B, H, N, d): a view, as a projection's heads are
        return t.view(2, 7, 3, 4).transpose(1, 2) if heads_view else \
            t.view(2, 7, 3, 4).transpose(1, 2).contiguous()
    q, k, v = (heads(torch.randn(2, 7, 12, dtype=dtype, requires_grad=False)) for _ in range(3))
    h = torch.randn(2, 3, 7, dtype=dtype)
    ops = sa.kernels.key_bias()
    key_bias._ops()  # the rules registered
    torch.library.opcheck(ops.forward, (q.requires_grad_(), k, v, h, 0.5, True))
    out, lse = ops.forward(q, k, v, h, 0.5, True)
    dout = torch.randn_like(out)
    torch.library.opcheck(ops.backward, (dout, q.detach(), k, v, h, out.detach(), lse, 0.5, True))


# -- a band per leading index: the compiled kernel's band_forward / band_backward -----------

def banded_by_hand(a, b, u, h, scale, window):
    """softmax_j(scale·⟨a_i, b_j⟩ + h_j) u_j over i − w ≤ j ≤ i, w per leading index."""
    s = scale * a @ b.transpose(-1, -2) + h.unsqueeze(-2)
    C, P = s.shape[-2:]
    i, j = torch.arange(C)[:, None], torch.arange(P)[None, :]
    off = (j > i) | (j < i - window[..., None, None])
    return s.masked_fill(off, float("-inf")).softmax(-1) @ u


@settings(max_examples=25, deadline=None)
@given(C=st.integers(1, 600), d_k=st.integers(1, 6), d_v=st.integers(1, 6),
       heads=st.integers(1, 3), batch=st.integers(1, 2), seed=st.integers(0, 10_000),
       dtype=st.sampled_from([torch.float32, f64]))
def test_a_band_per_head_equals_softmax_written_out(C, d_k, d_v, heads, batch, seed, dtype):
    """Outputs and the gradients of a, b, u and h, each head its own width (0, inside a block
    of 128 children, across the 256 parents of a tile, the whole past), in both dtypes."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(batch, heads, C, d_k, generator=g, dtype=dtype, requires_grad=True)
    b = torch.randn(batch, heads, C, d_k, generator=g, dtype=dtype, requires_grad=True)
    u = torch.randn(batch, heads, C, d_v, generator=g, dtype=dtype, requires_grad=True)
    h = torch.randn(batch, heads, C, generator=g, dtype=dtype, requires_grad=True)
    window = torch.randint(0, C + 2, (batch, heads), generator=g)
    got = key_bias.key_bias_attention(a, b, u, h, 0.7, True, window)
    leaves = [t.detach().double().requires_grad_() for t in (a, b, u, h)]
    want = banded_by_hand(*leaves, 0.7, window)
    tol = 1e-12 if dtype == f64 else 2e-5
    torch.testing.assert_close(got.double(), want, rtol=0, atol=tol)
    dout = torch.randn(got.shape, generator=g, dtype=dtype)
    for x, y in zip(torch.autograd.grad((got * dout).sum(), (a, b, u, h)),
                    torch.autograd.grad((want * dout.double()).sum(), leaves), strict=True):
        torch.testing.assert_close(x.double(), y, rtol=0, atol=20 * tol)


def test_a_band_per_head_gradcheck_and_opcheck():
    torch.manual_seed(3)
    a, b, u = (torch.randn(1, 2, 9, 3, dtype=f64, requires_grad=True) for _ in range(3))
    h = torch.randn(1, 2, 9, dtype=f64, requires_grad=True)
    window = torch.tensor([[2, 5]])
    assert torch.autograd.gradcheck(
        lambda *t: key_bias.key_bias_attention(*t, 0.6, True, window), (a, b, u, h))
    ops = sa.kernels.key_bias()
    key_bias._ops()  # the rules registered
    q, k, v = (t.detach() for t in (a, b, u))
    torch.library.opcheck(ops.band_forward, (q.requires_grad_(), k, v, h.detach(), window, 0.5))
    out, lse = ops.band_forward(q, k, v, h.detach(), window, 0.5)
    torch.library.opcheck(ops.band_backward, (torch.randn_like(out), q.detach(), k, v, h.detach(),
                                              out.detach(), lse, window, 0.5))


def test_a_band_per_head_refuses_what_it_cannot_read():
    ops = sa.kernels.key_bias()
    q = torch.randn(1, 2, 4, 3, dtype=f64)
    with pytest.raises(RuntimeError, match=r"key_bias: window \(B, H\)"):
        ops.band_forward(q, q, q, q[..., 0], torch.tensor([3]), 1.0)
    with pytest.raises(RuntimeError, match="key_bias: windows ≥ 0"):
        ops.band_forward(q, q, q, q[..., 0], torch.tensor([[3, -1]]), 1.0)
    with pytest.raises(ValueError, match="a window per leading index needs is_causal"):
        key_bias.key_bias_attention(q, q, q, q[..., 0], 1.0, False, torch.tensor([[3, 1]]))


def test_h_is_folded_into_factors_only_where_their_products_run_in_single_or_double():
    """``folds_terms``: h rides in one more key dimension of float32 or float64 factors only —
    not half precision, nor float32 that autocast on their device sends to half precision
    (h_j's rounding, eps·|h_j|, would enter every logit); float64 is not autocast's."""
    x = torch.randn(3, 4)
    assert key_bias.folds_terms(x, x.double())
    assert not key_bias.folds_terms(x, x.bfloat16())
    assert not key_bias.folds_terms(x.half())
    for dtype in (torch.bfloat16, torch.float16):
        with torch.autocast(x.device.type, dtype):
            assert key_bias.computes_in(x) == dtype
            assert not key_bias.folds_terms(x)
            assert key_bias.folds_terms(x.double())


def test_parent_terms_stay_float32_in_half_precision():
    """h comes in float32 at least whatever the states' dtype: the kernels read it so."""
    prior = sa.priors.ForgettingGate(F.logsigmoid(torch.randn(2, 9)))
    tables = prior.tables(9, 9, "cpu")
    for dtype, want in ((torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                        (torch.float32, torch.float32), (torch.float64, torch.float64)):
        assert tables.parent_terms(dtype).dtype == want
