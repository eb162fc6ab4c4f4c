"""The Triton kernel of a log prior g_i + h_j (structattn/triton_kernels/key_bias.py: FoX,
ALiBi), under the interpreter where there is no GPU: equal to the dense reading and to the CPU
kernel, in the output and the gradients of a, b, u and h, causal and not, at sizes crossing its
blocks of 32; whole FoX and ALiBi layers through it equal Pyro's enumeration, and their
gradients — the forget gate's own parameters included — equal the dense reading's."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import structattn as sa
from structattn import triton_kernels
from structattn.kinds import key_bias

from .layers import assert_layer_equals_pyro_and_dense_gradients, assert_one_node_of_a_plan

f64 = torch.float64
#: where the kernels run: the GPU where there is one, else the CPU under the interpreter
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
#: on a GPU, sizes crossing the GPU's wider blocks (64 and 128) and its head widths
GPU_SIZES = [(200, 300, 64, 64), (300, 300, 128, 128)] if DEVICE.type == "cuda" else []


def _kb():
    from structattn.triton_kernels import key_bias as kb
    return kb


def _dense(a, b, u, h, scale, causal, window=None):
    s = scale * a @ b.transpose(-1, -2) + h.unsqueeze(-2)
    if causal:
        C, P = s.shape[-2:]
        s = s.masked_fill(~torch.ones(C, P, dtype=torch.bool, device=s.device).tril(),
                          float("-inf"))
    if window is not None:  # row g reads i − window_g ≤ j only
        i = torch.arange(s.shape[-2], device=s.device)[:, None]
        j = torch.arange(s.shape[-1], device=s.device)
        s = s.masked_fill(j < i - window.to(s.device)[:, None, None], float("-inf"))
    return torch.softmax(s, -1) @ u


@pytest.mark.parametrize("dtype, atol", [(f64, 1e-12), (torch.float32, 2e-5)])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "all"])
@pytest.mark.parametrize("C, P, k, d", [(1, 1, 2, 3), (33, 33, 4, 5), (70, 70, 3, 17),
                                         (40, 65, 16, 16), *GPU_SIZES])
def test_triton_key_bias_equals_the_dense_reading_and_the_cpu_kernel(C, P, k, d, causal, dtype,
                                                                      atol):
    torch.manual_seed(C + P + k + causal)
    G = 2
    a, b, u = (torch.randn(G, n, w, dtype=dtype, device=DEVICE)
               for n, w in ((C, k), (P, k), (P, d)))
    h = torch.randn(G, P, dtype=dtype, device=DEVICE)
    kb = _kb()
    out, lse = kb.forward(a, b, u, h, 0.6, causal)
    leaves = [t.double().requires_grad_() for t in (a, b, u, h)]
    want = _dense(*leaves, 0.6, causal)
    torch.testing.assert_close(out.double(), want, rtol=0, atol=atol)
    dout = torch.randn_like(out)
    got = kb.backward(dout, a, b, u, h, out, lse, 0.6, causal)
    grads = torch.autograd.grad((want * dout.double()).sum(), leaves)
    for g, w in zip(got, grads, strict=True):
        torch.testing.assert_close(g.double(), w, rtol=0, atol=10 * atol)
    if dtype == f64 and k == d and key_bias._ops() is not None:  # the CPU twin (one width)
        leaves = [t.cpu().requires_grad_() for t in (a, b, u, h)]
        q, kk, v, hh = (x.unsqueeze(0) for x in leaves)
        cpu = key_bias._ops().forward(q, kk, v, hh, 0.6, causal)[0][0]
        torch.testing.assert_close(out.cpu(), cpu, rtol=0, atol=1e-12)
        cpu_grads = torch.autograd.grad((cpu * dout.cpu()).sum(), leaves)
        for g, w in zip(got, cpu_grads, strict=True):
            torch.testing.assert_close(g.cpu(), w, rtol=0, atol=1e-10)


@pytest.mark.parametrize("C, windows, dtype, atol", [
    # float64 at 130 children (each case 9 s under the interpreter) with ``-m slow``
    pytest.param(C, windows, dtype, atol,
                 marks=(pytest.mark.slow,) if C == 130 and dtype == f64 else ())
    for C, windows in [(1, [0, 3]), (70, [0, 69]), (97, [5, 40]), (130, [31, 32]), (130, [33, 100])]
    for dtype, atol in [(f64, 1e-12), (torch.float32, 2e-5)]])
def test_triton_key_bias_reads_a_band_per_row(C, windows, dtype, atol):
    """A window per row g (a head's certified width): children read i − w_g ≤ j ≤ i only, in
    the output and every gradient, at widths inside, on and across the blocks' edges — the
    backward's blocks of parents read only the children whose window reaches them."""
    torch.manual_seed(C + sum(windows))
    G, k, d = len(windows), 5, 7
    a, b, u = (torch.randn(G, C, w, dtype=dtype, device=DEVICE) for w in (k, k, d))
    h = torch.randn(G, C, dtype=dtype, device=DEVICE)
    window = torch.tensor(windows, dtype=torch.int32, device=DEVICE)
    kb = _kb()
    out, lse = kb.forward(a, b, u, h, 0.6, True, window)
    leaves = [t.double().requires_grad_() for t in (a, b, u, h)]
    want = _dense(*leaves, 0.6, True, window)
    torch.testing.assert_close(out.double(), want, rtol=0, atol=atol)
    dout = torch.randn_like(out)
    got = kb.backward(dout, a, b, u, h, out, lse, 0.6, True, window)
    grads = torch.autograd.grad((want * dout.double()).sum(), leaves)
    for g, w in zip(got, grads, strict=True):
        torch.testing.assert_close(g.double(), w, rtol=0, atol=10 * atol)
    if dtype == f64:  # through the autograd rule, window and all
        leaves = [t.clone().requires_grad_() for t in (a, b, u, h)]
        y = kb.forward(*leaves, 0.6, True, window)[0]
        for g, w in zip(torch.autograd.grad((y * dout).sum(), leaves), got, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize("fast_mode", [True, pytest.param(False, marks=pytest.mark.slow)],
                         ids=["fast_mode", "every_entry"])
def test_triton_key_bias_gradcheck_through_the_autograd_rule(fast_mode):
    """Every entry of the Jacobian (``-m slow``: a few hundred launches under the
    interpreter), or a random projection of it (gradcheck's fast mode) by default."""
    torch.manual_seed(2)
    a, b, u = (torch.randn(1, 33, 1, dtype=f64, device=DEVICE, requires_grad=True) for _ in range(3))
    h = torch.randn(1, 33, dtype=f64, device=DEVICE, requires_grad=True)
    kb = _kb()
    assert torch.autograd.gradcheck(lambda a, b, u, h: kb.forward(a, b, u, h, 0.7, True)[0],
                                    (a, b, u, h), atol=1e-7, fast_mode=fast_mode)


def test_triton_key_bias_op_passes_torch_library_opcheck():
    torch.manual_seed(3)
    a, b, u = (torch.randn(2, 34, 3, dtype=f64, device=DEVICE) for _ in range(3))
    h = torch.randn(2, 34, dtype=f64, device=DEVICE)
    torch.library.opcheck(_kb().forward, (a, b, u, h, 0.7, True),
                          test_utils=("test_schema", "test_faketensor"))


@settings(max_examples=5, deadline=None)
@given(model=st.sampled_from(["forgetting_attention", "alibi_attention"]), n=st.integers(1, 6),
       heads=st.integers(1, 2), seed=st.integers(0, 10_000))
def test_triton_fox_and_alibi_layers_equal_pyro_and_the_dense_gradients(model, n, heads, seed):
    torch.manual_seed(seed)
    m = getattr(sa.models, model)(6, heads=heads, d_k=2, dtype=f64, device=DEVICE)
    x = torch.randn(1, n, 6, dtype=f64, device=DEVICE)
    assert_layer_equals_pyro_and_dense_gradients(m, x)


def test_triton_key_bias_is_one_node_of_a_plan_and_serves_half_precision():
    torch.manual_seed(4)
    m = sa.models.forgetting_attention(8, heads=2, d_k=4, dtype=f64, device=DEVICE)
    x = torch.randn(2, 40, 8, dtype=f64, device=DEVICE)
    cpu = assert_one_node_of_a_plan(m, x, "key_bias_forward")
    m16 = sa.models.forgetting_attention(8, heads=2, d_k=4, dtype=torch.bfloat16, device=DEVICE)
    m16.load_state_dict({k: v.to(torch.bfloat16) for k, v in m.state_dict().items()})
    with triton_kernels.on_cpu():
        y16 = sa.compile(m16)(x.to(torch.bfloat16))
    assert y16.dtype == torch.bfloat16
    torch.testing.assert_close(y16.double(), cpu, rtol=0, atol=0.1)


#: half precision against float64 on the same (rounded) inputs: outputs to 2⁻⁶ (bfloat16) or
#: 2⁻⁹ (float16) times (1 + their largest entry); gradients to 2⁻⁵ or 2⁻⁸ of their norm (each
#: ds_ij is rounded to the factors' dtype before its product with them, as FlashAttention's
#: are: a few entries of a gradient lose more than the rest, the whole no more)
HALF = [(torch.bfloat16, 2 ** -6, 2 ** -5), (torch.float16, 2 ** -9, 2 ** -8)]


@pytest.mark.parametrize("dtype, atol, grad_rtol", HALF)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "all"])
@pytest.mark.parametrize("C, P, k, d", [(70, 70, 16, 16), (40, 65, 3, 17), *GPU_SIZES])
def test_triton_key_bias_takes_half_precision_as_it_is(C, P, k, d, causal, dtype, atol,
                                                     grad_rtol):
    """bfloat16 and float16 factors reach the kernel unconverted (the tensor cores' dtype on a
    GPU); the output keeps their dtype, the statistics and h's gradient are float32."""
    torch.manual_seed(C + k)
    G = 2
    a, b, u = (torch.randn(G, n, w, device=DEVICE).to(dtype) for n, w in ((C, k), (P, k), (P, d)))
    h = torch.randn(G, P, device=DEVICE)
    kb = _kb()
    out, lse = kb.forward(a, b, u, h, 0.6, causal)
    assert (out.dtype, lse.dtype) == (dtype, torch.float32)
    leaves = [t.double().requires_grad_() for t in (a, b, u, h)]
    want = _dense(*leaves, 0.6, causal)
    torch.testing.assert_close(out.double(), want, rtol=0, atol=atol * (1 + want.abs().max().item()))
    dout = torch.randn_like(out)
    got = kb.backward(dout, a, b, u, h, out, lse, 0.6, causal)
    assert [g.dtype for g in got] == [dtype, dtype, dtype, torch.float32]
    grads = torch.autograd.grad((want * dout.double()).sum(), leaves)
    for g, w in zip(got, grads, strict=True):
        assert (g.double() - w).norm() <= grad_rtol * w.norm(), (g.dtype, g.shape)


@pytest.mark.parametrize("precision, products", [("highest", "ieee"), ("high", "tf32"),
                                                 ("medium", "tf32")])
def test_float32_products_follow_torchs_matmul_precision(precision, products):
    """float32 blocks multiply as ``torch.set_float32_matmul_precision`` says: IEEE at
    "highest", TF32 at "high" and "medium" (half precision goes to the tensor cores either
    way); the interpreter takes either and multiplies in float32. On a GPU, TF32 keeps 10 bits
    of each factor: the output to ~2⁻¹⁰ of its scale."""
    from structattn.triton_kernels._tiles import settings

    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision(precision)
        assert settings(torch.float32, 16)["PRECISION"] == products
        assert settings(torch.bfloat16, 16)["PRECISION"] == "ieee"
        assert settings(f64, 16)["PRECISION"] == "ieee"
        torch.manual_seed(5)
        a, b, u = (torch.randn(2, 70, 16, device=DEVICE) for _ in range(3))
        h = torch.randn(2, 70, device=DEVICE)
        out = _kb().forward(a, b, u, h, 0.3, True)[0]
    finally:
        torch.set_float32_matmul_precision(before)
    want = _dense(*(t.double() for t in (a, b, u, h)), 0.3, True)
    tf32_on_gpu = products == "tf32" and DEVICE.type == "cuda"
    torch.testing.assert_close(out.double(), want, rtol=0, atol=5e-3 if tf32_on_gpu else 2e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal, windows", [(True, None), (False, None), (True, [5, 40])],
                         ids=["causal", "all", "band"])
def test_half_precision_h_gradient_sums_to_zero_as_the_softmax_says(dtype, causal, windows):
    """Σ_j ∂L/∂h_j = Σ_ij ds_ij = 0 (each row's softmax is invariant to a shift of h): in half
    precision the backward's Δ_i is its own Σ_j p_ij dout_i·u_j, not dout_i·out_i with out
    rounded, so the sum stays at float32's rounding — a cumulative prior's gradient (FoX's
    gates, Σ_{j<l} ∂L/∂h_j) does not drift along the sequence."""
    torch.manual_seed(6)
    G, C, k = 2, 70, 16
    a, b, u = (torch.randn(G, C, k, device=DEVICE).to(dtype) for _ in range(3))
    h = torch.randn(G, C, device=DEVICE)
    window = None if windows is None else torch.tensor(windows, dtype=torch.int32,
                                                       device=DEVICE)
    kb = _kb()
    out, lse = kb.forward(a, b, u, h, 0.6, causal, window)
    dout = torch.randn_like(out)
    dh = kb.backward(dout, a, b, u, h, out, lse, 0.6, causal, window)[3]
    assert dh.dtype == torch.float32
    assert (dh.sum(-1).abs() <= 1e-5 * dh.abs().sum(-1)).all(), (dh.sum(-1), dh.abs().sum(-1))
