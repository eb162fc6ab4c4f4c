"""The Triton kernel of a generalised Gaussian over the distance (structattn/triton_kernels/
generalised_gaussian.py: BAM's prior −|(i − j − μ)·e^s|^β computed per block of scores), under
the interpreter where there is no GPU: equal to the dense reading in float64, in the output and
the gradients of a, b, u and of each row's (μ, s, β), causal and not, with a band per row, at
sizes crossing its blocks of 32; gradcheck through its autograd rule; a whole layer through it
equals Pyro's enumeration, its gradients (μ, s and log β included) the dense reading's, and
records the kernel's operator once in its plan with no N×N tensor."""

import pytest
import torch

import structattn as sa
from structattn import triton_kernels

from ..square import assert_no_square_tensor
from .layers import assert_layer_equals_pyro_and_dense_gradients, assert_one_node_of_a_plan

f64 = torch.float64
#: where the kernels run: the GPU where there is one, else the CPU under the interpreter
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
#: on a GPU, sizes crossing the GPU's wider blocks (64 and 128) and its head widths
GPU_SIZES = [(200, 300, 64, 64), (300, 300, 128, 128)] if DEVICE.type == "cuda" else []


def _gg():
    from structattn.triton_kernels import generalised_gaussian as gg
    return gg


def _dense(a, b, u, prior, scale, causal, window=None):
    """The reading with the (G, C, P) bias −|(i − j − μ)·e^s|^β built in full (0 where the
    argument is 0, as ``GeneralisedGaussian.log_at_distance``)."""
    C, P = a.shape[-2], b.shape[-2]
    d = (torch.arange(C, device=a.device)[:, None]
         - torch.arange(P, device=a.device)).to(a.dtype)
    mu, s, beta = (prior[:, k, None, None] for k in range(3))
    z = ((d - mu) * s.exp()).abs()
    zero = z == 0
    bias = -torch.where(zero, torch.zeros_like(z), torch.where(zero, 1.0, z) ** beta)
    scores = scale * a @ b.transpose(-1, -2) + bias
    if causal:
        scores = scores.masked_fill(d < 0, float("-inf"))
    if window is not None:  # row g reads i − window_g ≤ j only
        scores = scores.masked_fill(d > window.to(a.device)[:, None, None], float("-inf"))
    return torch.softmax(scores, -1) @ u


def _prior(G, dtype, generator=None):
    """Each row's (μ, s, β): μ off the integers and on one (z = 0 at d = μ), β below and above 1."""
    mu = torch.tensor([1.5, 3.0, -0.4, 0.0])[:G]
    s = torch.tensor([-1.0, -2.5, 0.3, -0.7])[:G]
    beta = torch.tensor([0.7, 2.0, 1.0, 1.6])[:G]
    return torch.stack([mu, s, beta], -1).to(dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype, atol", [(f64, 1e-12), (torch.float32, 2e-5)])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "all"])
@pytest.mark.parametrize("C, P, k, d", [(1, 1, 2, 3), (33, 33, 4, 5), (70, 70, 3, 17),
                                         (40, 65, 16, 16), *GPU_SIZES])
def test_triton_generalised_gaussian_equals_the_dense_reading(C, P, k, d, causal, dtype, atol):
    torch.manual_seed(C + P + k + causal)
    G = 4
    a, b, u = (torch.randn(G, n, w, dtype=dtype, device=DEVICE)
               for n, w in ((C, k), (P, k), (P, d)))
    prior = _prior(G, dtype)
    gg = _gg()
    out, lse = gg.forward(a, b, u, prior, 0.6, causal)
    leaves = [t.double().requires_grad_() for t in (a, b, u, prior)]
    want = _dense(*leaves, 0.6, causal)
    torch.testing.assert_close(out.double(), want, rtol=0, atol=atol)
    dout = torch.randn_like(out)
    got = gg.backward(dout, a, b, u, prior, out, lse, 0.6, causal)
    grads = torch.autograd.grad((want * dout.double()).sum(), leaves)
    for g, w in zip(got, grads, strict=True):
        torch.testing.assert_close(g.double(), w, rtol=0, atol=10 * atol * (1 + w.abs().max()))


@pytest.mark.parametrize("C, windows", [(70, [0, 69]), (97, [5, 40]), (70, [31, 32])])
def test_triton_generalised_gaussian_reads_a_band_per_row(C, windows):
    """A window per row g: children read i − w_g ≤ j ≤ i only, in the output and every
    gradient, at widths inside, on and across the blocks' edges."""
    torch.manual_seed(C + sum(windows))
    G, k, d = len(windows), 5, 7
    a, b, u = (torch.randn(G, C, w, dtype=f64, device=DEVICE) for w in (k, k, d))
    prior = _prior(G, f64)
    window = torch.tensor(windows, dtype=torch.int32, device=DEVICE)
    gg = _gg()
    out, lse = gg.forward(a, b, u, prior, 0.6, True, window)
    leaves = [t.clone().requires_grad_() for t in (a, b, u, prior)]
    want = _dense(*leaves, 0.6, True, window)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    dout = torch.randn_like(out)
    got = gg.backward(dout, a, b, u, prior, out, lse, 0.6, True, window)
    grads = torch.autograd.grad((want * dout).sum(), leaves)
    for g, w in zip(got, grads, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-10)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "all"])
def test_triton_generalised_gaussian_gradcheck_through_the_autograd_rule(causal):
    """gradcheck (fast mode: a random projection of the Jacobian) of the op in a, b, u and
    the parameters (μ, s, β), in float64, across a block's edge."""
    torch.manual_seed(2)
    a, b, u = (torch.randn(2, 34, 2, dtype=f64, device=DEVICE, requires_grad=True)
               for _ in range(3))
    prior = _prior(2, f64).requires_grad_()
    gg = _gg()
    assert torch.autograd.gradcheck(
        lambda a, b, u, prior: gg.forward(a, b, u, prior, 0.7, causal)[0],
        (a, b, u, prior), atol=1e-7, fast_mode=True)


def test_triton_generalised_gaussian_op_passes_torch_library_opcheck():
    torch.manual_seed(3)
    a, b, u = (torch.randn(2, 34, 3, dtype=f64, device=DEVICE) for _ in range(3))
    torch.library.opcheck(_gg().forward, (a, b, u, _prior(2, f64), 0.7, True),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "all"])
@pytest.mark.parametrize("n", [1, 5])
def test_a_generalised_gaussian_layer_equals_pyro_and_the_dense_gradients(n, causal):
    """The layer through the kernel equals Pyro's enumeration; its gradients — x, the
    projections and the prior's loc, log_scale and log_shape — equal autograd through the
    dense bias."""
    torch.manual_seed(n + causal)
    m = sa.models.generalised_gaussian_attention(6, heads=2, d_k=2, causal=causal, width=2.0,
                                                 dtype=f64, device=DEVICE)
    with torch.no_grad():  # distinct heads, off-zero location and shape
        m.loc.copy_(torch.tensor([0.5, 1.7], dtype=f64))
        m.log_shape.copy_(torch.tensor([0.3, -0.4], dtype=f64))
    x = torch.randn(1, n, 6, dtype=f64, device=DEVICE)
    assert_layer_equals_pyro_and_dense_gradients(m, x)


def test_a_generalised_gaussian_layer_is_one_node_of_a_plan_without_an_n_by_n_tensor():
    """The compiled layer records the kernel's operator once, equals the dense reading on
    replay, and no op of the replayed plan (forward or backward) outputs an N×N tensor, nor
    is one saved for the backward: the dense reading's (heads, N, N) bias is never built."""
    torch.manual_seed(4)
    m = sa.models.generalised_gaussian_attention(8, heads=2, d_k=4, width=3.0, dtype=f64,
                                                 device=DEVICE)
    x = torch.randn(2, 40, 8, dtype=f64, device=DEVICE)
    assert_one_node_of_a_plan(m, x, "generalised_gaussian_forward")
    with triton_kernels.on_cpu():
        assert_no_square_tensor(sa.compile(m), x.clone().requires_grad_(), 40)
