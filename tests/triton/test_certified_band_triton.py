"""A certified band per head where the Triton kernel serves (the GPU; here its interpreter):
ALiBi and FoX layers with ``tol`` read each head's own certified width through the key-bias
kernel's ``window`` — a head that needs all of its past (ALiBi's slow head) no longer holds the
others. Oracle: the dense float64 softmax of tests/certificates/test_certified_distance_priors.py
(the priors' weights from their formulas, nothing of the band or of ``certify`` reused),
restricted to each head's window and renormalised; the total variation from the whole past
within the reported bound; gradients through the autograd rule."""

import math

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

import structattn as sa
from structattn import triton_kernels

from ..certificates.test_certified_distance_priors import alibi_weights, dense_posterior, gate_weights
from ..certificates.test_certified_read_cpu import ATTACK, attack

f64 = torch.float64
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _heads(layer, x, W):
    return (x @ W.T).unflatten(-1, (layer.heads, -1)).transpose(-2, -3)


def _layer(factory, tol, n, device=DEVICE):
    torch.manual_seed(7)
    if factory == "alibi_attention":  # a sharp head and a uniform one (only the whole past)
        m = sa.models.alibi_attention(16, heads=2, tol=tol, block_size=16, dtype=f64,
                                      device=device)
        m.slopes.copy_(torch.tensor([1.0, 0.0], dtype=f64))
    else:  # forget gates near 1/2 (each head's gate its own)
        m = sa.models.forgetting_attention(16, heads=2, tol=tol, block_size=16, dtype=f64,
                                           device=device, gate_bias=0.0)
    torch.manual_seed(3)
    x = torch.randn(2, n, 16, dtype=f64, device=device)
    return m, x


@pytest.mark.parametrize("factory", ["alibi_attention", "forgetting_attention"])
@pytest.mark.parametrize("tol", [0.05, 1e-4])
@torch.no_grad()
def test_each_head_reads_its_own_certified_band(factory, tol):
    n = 150
    m, x = _layer(factory, tol, n)
    with triton_kernels.on_cpu():
        y, p, trace = sa.compile(m)(x, return_posterior=True, return_trace=True)
    c = trace.truncation[m.family_name]
    own = c.heads  # (batch, H): each head's width
    torch.testing.assert_close(own, c.window.amax(-1), rtol=0, atol=0)
    if factory == "alibi_attention":  # the uniform head reads everything, the sharp one little
        assert bool((own[:, 1] == n - 1).all()) and bool((own[:, 0] <= 32).all())
        assert c.width == n - 1 and 0.3 < c.skipped < 0.5  # half the heads skip
    assert c.certified and bool((c.bound <= tol).all()) and c.skipped > 0
    q, k, v = (_heads(m, x, W).cpu() for W in (m.W_q, m.W_k, m.W_v))
    log_w = (alibi_weights(m.slopes.cpu().numpy(), n) if factory == "alibi_attention"
             else gate_weights(m.log_gates(x).cpu().numpy(), n))
    whole = dense_posterior(q, k, 1 / math.sqrt(q.shape[-1]), log_w)
    d = torch.arange(n)[:, None] - torch.arange(n)[None, :]
    banded = whole * (d <= own.cpu()[..., None, None])
    banded = banded / banded.sum(-1, keepdim=True)
    torch.testing.assert_close(p.cpu(), banded, atol=1e-10, rtol=0)
    want = (banded @ v).transpose(-3, -2).flatten(-2) @ m.W_o.T.cpu()
    torch.testing.assert_close(y.cpu(), want, atol=1e-10, rtol=0)
    tv = (banded - whole).abs().sum(-1) / 2
    assert bool((tv <= c.bound.cpu() + 1e-12).all())


@pytest.mark.filterwarnings("ignore:Attempting to run cuBLAS")  # the backward's thread, on CUDA
def test_gradients_through_a_band_per_head():
    torch.manual_seed(8)
    m = sa.models.alibi_attention(4, heads=2, d_k=2, tol=0.05, block_size=16, dtype=f64,
                                  device=DEVICE)
    m.slopes.copy_(torch.tensor([2.0, 0.0], dtype=f64))
    x = torch.randn(1, 40, 4, dtype=f64, device=DEVICE, requires_grad=True)
    layer = sa.compile(m)
    with triton_kernels.on_cpu():
        _, trace = layer(x, return_trace=True)
        own = trace.truncation[m.family_name].heads
        assert int(own[0, 0]) < 39 == int(own[0, 1])
        assert torch.autograd.gradcheck(lambda xx, wq: layer(xx), (x, m.W_q), fast_mode=True)


def test_without_a_band_kernel_the_shared_window_reads_as_before():
    """Where no kernel reads a band per head (compiled kernels off), one width for every
    head: here the uniform head's, all of the past — the per-head certificate is asked only
    for a kernel."""
    m, x = _layer("alibi_attention", 1e-3, 64, device="cpu")
    with sa.kernels.disabled():
        _, trace = sa.compile(m)(x, return_trace=True)
    c = trace.truncation[m.family_name]
    assert c.width == 63 and c.skipped == 0.0 and c.heads is None


# -- the certificate read from the kernel's own log-sums (structattn/certificates/certified_read.py) -------
@pytest.mark.parametrize("factory", ["alibi_attention", "forgetting_attention"])
@pytest.mark.parametrize("tol, n", [(0.05, 150), (1e-4, 300)])
@torch.no_grad()
def test_the_read_certificate_chooses_the_cpu_paths_widths_and_never_scores_the_band(
        factory, tol, n, monkeypatch):
    """Where the Triton kernel reads the band per head, its certificate's evidence is the
    kernel's own log-sums: the band is never scored outside it (``band.scores`` and
    ``certify``'s scoring refuse here), at most three readings run, each head's width is the
    one the CPU path's ``certify`` (scoring the band in float64) chooses, the output equals
    the CPU path's and every bound is at most the CPU's (its evidence is the width's own)."""
    from structattn.certificates import certified
    from structattn.kinds import certificate_costs
    from structattn.operators import band
    from structattn.triton_kernels import key_bias as kb

    monkeypatch.setattr(certificate_costs, "band_pays", lambda *args: True)  # (the CPU's rule)
    m, x = _layer(factory, tol, n, device="cpu")
    y_cpu, trace_cpu = sa.compile(m)(x, return_trace=True)
    calls = []
    forward = kb.forward

    def counted(*args):
        calls.append(args[-1])
        return forward(*args)

    def refuse(*args, **kwargs):
        raise AssertionError("the band was scored outside the kernel")

    monkeypatch.setattr(kb, "forward", counted)
    monkeypatch.setattr(band, "scores", refuse)
    monkeypatch.setattr(certified._Evidence, "log_inside", refuse)
    with triton_kernels.on_cpu():
        y, trace = sa.compile(m)(x, return_trace=True)
    assert 1 <= len(calls) <= 3 and all(w is not None for w in calls)
    c, c_cpu = trace.truncation[m.family_name], trace_cpu.truncation[m.family_name]
    torch.testing.assert_close(c.heads, c_cpu.heads, rtol=0, atol=0)
    assert c.width == c_cpu.width and c.skipped == c_cpu.skipped
    assert c.certified and bool((c.bound <= tol).all())
    assert bool((c.bound <= c_cpu.bound + 1e-12).all())
    torch.testing.assert_close(y, y_cpu, rtol=0, atol=1e-10)


@settings(max_examples=12, deadline=None)
@given(n=st.integers(2, 90), **ATTACK)
def test_the_read_certificate_never_leaves_out_more_than_its_bound(n, **kw):
    """The attack of tests/certificates/test_certified_read_cpu.py on the Triton kernel's
    certificate."""
    attack(None, DEVICE, n // 2, n, **kw)
