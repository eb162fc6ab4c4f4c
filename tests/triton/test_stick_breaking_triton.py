"""The Triton stick-breaking kernel (structattn/triton_kernels/stick_breaking.py), under the
interpreter where there is no GPU: equal to the CPU kernel, to the dense reading and to a
brute-force product, in outputs, leftover and every gradient, at sizes crossing its blocks of
32; early stopping reads the blocks the forward read; a whole layer through it equals Pyro's
enumeration; a plan records it as one node."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import structattn as sa
from structattn.kinds.stick_breaking import _ops, stick_breaking_table, stop_mass

from ..models.test_stick_breaking_attention import brute_force
from .layers import assert_layer_equals_pyro_and_dense_gradients, assert_one_node_of_a_plan

f64 = torch.float64
#: where the kernels run: the GPU where there is one, else the CPU under the interpreter
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
#: on a GPU, sizes crossing the GPU's wider blocks (64 and 128) and its head widths
GPU_SIZES = [(200, 300, 64, 64), (300, 300, 128, 128)] if DEVICE.type == "cuda" else []


def _sb():
    from structattn.triton_kernels import stick_breaking
    return stick_breaking


def _dense(a, b, v, scale):
    C, P = a.shape[1], b.shape[1]
    allowed = torch.ones(C, P, dtype=torch.bool, device=a.device).tril(-1)
    p, left = stick_breaking_table(scale * a @ b.transpose(-1, -2), allowed)
    return p @ v, left


@pytest.mark.parametrize("dtype, atol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
@pytest.mark.parametrize("C, P, k, d", [(1, 1, 2, 3), (33, 33, 4, 5), (70, 70, 3, 17),
                                         (40, 65, 16, 16), *GPU_SIZES])
def test_triton_equals_the_dense_reading_and_the_cpu_kernel(C, P, k, d, dtype, atol):
    """Outputs, leftover and the gradients of both (a, b, v) — float64 to 1e-12, float32 to
    2e-5 (the interpreter's float32 dot and exp against the dense reading's)."""
    torch.manual_seed(C + P + k)
    G = 2
    a, b, v = (torch.randn(G, n, w, dtype=dtype, device=DEVICE)
               for n, w in ((C, k), (P, k), (P, d)))
    sb = _sb()
    out, left, nread = sb.forward(a, b, v, 0.6, 0.0)
    want_out, want_left = _dense(a.double(), b.double(), v.double(), 0.6)
    torch.testing.assert_close(out.double(), want_out, rtol=0, atol=atol)
    torch.testing.assert_close(left.double(), want_left, rtol=0, atol=atol)
    if dtype == f64 and (ops := _ops()) is not None:  # the CPU twin
        cpu_out, cpu_left, _ = ops.forward(a.cpu(), b.cpu(), v.cpu(), 0.6, 0.0)
        torch.testing.assert_close(out.cpu(), cpu_out, rtol=0, atol=1e-12)
        torch.testing.assert_close(left.cpu(), cpu_left, rtol=0, atol=1e-12)
    dout, dleft = torch.randn_like(out), torch.randn_like(left)
    got = sb.backward(dout, dleft, a, b, v, 0.6, out, left, nread)
    leaves = [t.double().requires_grad_() for t in (a, b, v)]
    o, lft = _dense(*leaves, 0.6)
    want = torch.autograd.grad((o * dout.double()).sum() + (lft * dleft.double()).sum(), leaves)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w, rtol=0, atol=10 * atol)


@pytest.mark.parametrize("reach", ["short", "long"])
def test_triton_stops_where_every_stick_is_spent_and_the_backward_reads_the_same_blocks(reach):
    """Short reach (breaks likely): late blocks stop before the first token and still equal the
    brute-force product; long reach: every block is read."""
    torch.manual_seed(1)
    G, N, k, dv = 1, 200, 4, 3
    a, b = (torch.randn(G, N, k, dtype=f64, device=DEVICE) for _ in range(2))
    if reach == "long":
        a[..., 0], b[..., 0] = 1.0, -12.0
    else:
        a[..., 0], b[..., 0] = 1.0, 12.0  # β ≈ σ(6): a stick spent within a few tokens
    v = torch.randn(G, N, dv, dtype=f64, device=DEVICE)
    sb = _sb()
    out, left, nread = sb.forward(a, b, v, 0.5, stop_mass(f64))
    launch = sb._common(f64, k, dv)  # the blocks the forward and the backward read
    BM, BN = launch["BM"], launch["BN"]
    blocks = (torch.arange(nread.shape[1], device=DEVICE) * BM + BM - 1).clamp(max=N) \
        .add(BN - 1) // BN
    if reach == "short":
        assert (nread[0, 2:] < blocks[2:]).all()
    else:
        assert torch.equal(nread[0], blocks.to(nread.dtype))
    p, want_left = brute_force((0.5 * a[0] @ b[0].T).cpu())
    torch.testing.assert_close(out[0].cpu(), p @ v[0].cpu(), rtol=0, atol=1e-12)
    torch.testing.assert_close(left[0].cpu(), want_left, rtol=0, atol=1e-12)
    dout, dleft = torch.randn_like(out), torch.randn_like(left)
    got = sb.backward(dout, dleft, a, b, v, 0.5, out, left, nread)
    leaves = [t.clone().requires_grad_() for t in (a, b, v)]
    o, lft = _dense(*leaves, 0.5)
    want = torch.autograd.grad((o * dout).sum() + (lft * dleft).sum(), leaves)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-10)


@pytest.mark.parametrize("fast_mode", [True, pytest.param(False, marks=pytest.mark.slow)],
                         ids=["fast_mode", "every_entry"])
def test_triton_gradcheck_through_the_autograd_rule(fast_mode):
    """Every entry of the Jacobian (``-m slow``: a few hundred launches under the
    interpreter), or a random projection of it (gradcheck's fast mode) by default."""
    torch.manual_seed(2)
    a = torch.randn(1, 33, 1, dtype=f64, device=DEVICE, requires_grad=True)
    b = torch.randn(1, 33, 1, dtype=f64, device=DEVICE, requires_grad=True)
    v = torch.randn(1, 33, 1, dtype=f64, device=DEVICE, requires_grad=True)
    sb = _sb()
    assert torch.autograd.gradcheck(lambda a, b, v: sb.forward(a, b, v, 0.7, 0.0)[:2],
                                    (a, b, v), atol=1e-7, fast_mode=fast_mode)


def test_triton_op_passes_torch_library_opcheck():
    torch.manual_seed(3)
    a, b, v = (torch.randn(2, 34, 3, dtype=f64, device=DEVICE) for _ in range(3))
    torch.library.opcheck(_sb().forward, (a, b, v, 0.7, 0.0),
                          test_utils=("test_schema", "test_faketensor"))


@settings(max_examples=6, deadline=None)
@given(n=st.integers(1, 6), heads=st.integers(1, 2), seed=st.integers(0, 10_000))
def test_triton_layer_equals_pyro_enumerating_the_scan(n, heads, seed):
    """A whole compiled layer through the Triton kernel (``on_cpu``) equals Pyro's exact
    enumeration; its gradients in the input and every parameter equal the dense reading's."""
    torch.manual_seed(seed)
    m = sa.models.stick_breaking_attention(6, heads=heads, d_k=2, dtype=f64, device=DEVICE)
    x = torch.randn(1, n, 6, dtype=f64, device=DEVICE) * 2
    assert_layer_equals_pyro_and_dense_gradients(m, x)


def test_triton_kernel_is_one_node_of_a_plan():
    torch.manual_seed(4)
    m = sa.models.stick_breaking_attention(8, heads=2, d_k=4, dtype=f64, device=DEVICE)
    x = torch.randn(2, 40, 8, dtype=f64, device=DEVICE)
    assert_one_node_of_a_plan(m, x, "stick_breaking_forward")


#: half precision against float64 on the same (rounded) inputs: outputs to 2⁻⁶ (bfloat16) or
#: 2⁻⁹ (float16) times (1 + their largest entry); gradients to 2⁻⁵ or 2⁻⁸ of their norm (each
#: ds_ij is rounded to the factors' dtype before its product with them, as FlashAttention's
#: are: a few entries of a gradient lose more than the rest, the whole no more)
HALF = [(torch.bfloat16, 2 ** -6, 2 ** -5), (torch.float16, 2 ** -9, 2 ** -8)]


@pytest.mark.parametrize("dtype, atol, grad_rtol", HALF)
@pytest.mark.parametrize("C, P, k, d", [(70, 70, 16, 16), (40, 65, 3, 17), *GPU_SIZES])
def test_triton_takes_half_precision_as_it_is(C, P, k, d, dtype, atol, grad_rtol):
    """bfloat16 and float16 factors reach the kernel unconverted (the tensor cores' dtype on a
    GPU); the output and the leftover stick are float32, the gradients the factors' dtype."""
    torch.manual_seed(C + k)
    G = 2
    a, b, v = (torch.randn(G, n, w, device=DEVICE).to(dtype) for n, w in ((C, k), (P, k), (P, d)))
    sb = _sb()
    out, left, nread = sb.forward(a, b, v, 0.6, 0.0)
    assert (out.dtype, left.dtype) == (torch.float32, torch.float32)
    leaves = [t.double().requires_grad_() for t in (a, b, v)]
    want_out, want_left = _dense(*leaves, 0.6)
    torch.testing.assert_close(out.double(), want_out, rtol=0,
                               atol=atol * (1 + want_out.abs().max().item()))
    torch.testing.assert_close(left.double(), want_left, rtol=0, atol=atol)
    dout, dleft = torch.randn_like(out), torch.randn_like(left)
    got = sb.backward(dout, dleft, a, b, v, 0.6, out, left, nread)
    assert [g.dtype for g in got] == [dtype] * 3
    grads = torch.autograd.grad((want_out * dout.double()).sum()
                                + (want_left * dleft.double()).sum(), leaves)
    for g, w in zip(got, grads, strict=True):
        assert (g.double() - w).norm() <= grad_rtol * w.norm(), (g.dtype, g.shape)
