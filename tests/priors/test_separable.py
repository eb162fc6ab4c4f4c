"""Priors whose log weights are a difference of per-token terms (``Prior.terms``): ALiBi under
j ≤ i and the forget gate (FoX). Their terms equal their log weights; the dense operator lowers
them as SDPA with one more key dimension, never a C×P bias, forward or backward; a constant
gate is ALiBi; bad gates are refused with the argument named."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import structattn as sa
from structattn.kinds.base import grid
from structattn.priors.alibi import alibi_slopes

from ..square import assert_no_square_tensor

f64 = torch.float64


def _gate(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.nn.functional.logsigmoid(torch.randn(*shape, generator=g, dtype=f64) * 2 + 1)


@settings(max_examples=25, deadline=None)
@given(C=st.integers(1, 9), extra=st.integers(0, 4), heads=st.integers(1, 3),
       seed=st.integers(0, 10_000))
def test_terms_are_the_log_weights_on_the_support(C, extra, heads, seed):
    P = C + extra
    priors = [sa.priors.ALiBi(heads, slopes=alibi_slopes(heads).to(f64), causal=True),
              sa.priors.ForgettingGate(_gate((2, heads, P), seed))]
    i, j = grid(C, P, "cpu")
    on = j <= i
    for prior in priors:
        g, h = prior.terms(C, P, "cpu")
        w = prior.log_weight(i, j, (C, P)).to(f64)
        sep = (g[..., :, None] + h[..., None, :]).to(f64)
        w, sep = torch.broadcast_tensors(w, sep)
        torch.testing.assert_close(sep[..., on], w[..., on], rtol=0, atol=1e-12)


def test_only_causal_alibi_separates():
    assert sa.priors.ALiBi(2, causal=False).terms(4, 4, "cpu") is None
    assert sa.priors.Uniform(causal=True).terms(4, 4, "cpu") is None


def _same_weights(src, dst):
    with torch.no_grad():
        for name in ("W_q", "W_k", "W_v", "W_o"):
            getattr(dst, name).copy_(getattr(src, name))


def test_a_constant_gate_is_alibi_with_slope_minus_log_f():
    torch.manual_seed(0)
    H, f = 3, torch.tensor([0.9, 0.5, 0.99], dtype=f64)
    fox = sa.models.forgetting_attention(12, heads=H, dtype=f64)
    alibi = sa.models.alibi_attention(12, heads=H, dtype=f64)
    _same_weights(fox, alibi)
    with torch.no_grad():
        fox.W_f.zero_()
        fox.b_f.copy_(torch.logit(f))
        alibi.slopes.copy_(-f.log())
    x = torch.randn(2, 9, 12, dtype=f64)
    y_fox, p_fox = sa.compile(fox)(x, return_posterior=True)
    y_alibi, p_alibi = sa.compile(alibi)(x, return_posterior=True)
    torch.testing.assert_close(y_fox, y_alibi, rtol=0, atol=1e-12)
    torch.testing.assert_close(p_fox, p_alibi, rtol=0, atol=1e-12)
    torch.testing.assert_close(sa.compile(fox)(x), y_fox, rtol=0, atol=1e-12)  # the SDPA path


@pytest.mark.parametrize("factory", ["forgetting_attention", "alibi_attention"])
def test_no_children_by_parents_tensor_forward_or_backward(factory):
    """N = 96 tokens: no tensor of the forward (a plan's recorded graph) nor any tensor saved
    for the backward has an N×N trailing shape — the prior rides in one more key dimension."""
    torch.manual_seed(0)
    N = 96
    m = getattr(sa.models, factory)(16, heads=2)
    x = torch.randn(1, N, 16, requires_grad=True)
    assert_no_square_tensor(sa.compile(m), x, N)
    assert m.W_q.grad is not None and x.grad is not None
    if factory == "forgetting_attention":
        assert m.W_f.grad is not None and m.b_f.grad.abs().sum() > 0


def test_float32_sdpa_path_matches_float64_at_two_thousand_tokens():
    """The per-parent term grows along the sequence (cumulative log gates); in float32 the
    logits carry its rounding, eps·|h_j|: the output stays within 1e-4 of float64."""
    torch.manual_seed(0)
    m = sa.models.forgetting_attention(32, heads=2, gate_bias=4.0, dtype=f64)
    x = torch.randn(1, 2048, 32, dtype=f64)
    with torch.no_grad():
        y64 = sa.compile(m)(x)
        y32 = sa.compile(m.float())(x.float())
    assert (y32.double() - y64).abs().max() < 1e-4


@pytest.mark.parametrize("log_f, match", [
    (torch.tensor([[-0.1, 0.2, -0.3]], dtype=f64),
     r"log_f must be finite and ≤ 0 .* 1 entries outside, e\.g\. 0\.2"),
    (torch.tensor([[-0.1, math.nan, -0.3]], dtype=f64),
     r"log_f must be finite and ≤ 0 .* 1 entries outside, e\.g\. nan"),
    (torch.tensor([[-0.1, -math.inf]], dtype=f64), r"finite and ≤ 0 .* e\.g\. -inf"),
    (torch.tensor([1, 2]), r"log_f must be a float tensor \(…, N\) .* got \(2,\)"),
    ("gates", r"log_f must be a float tensor .* got str"),
])
def test_bad_gates_are_refused(log_f, match):
    with pytest.raises(ValueError, match=match):
        sa.priors.ForgettingGate(log_f)


def test_gates_for_the_wrong_number_of_tokens_are_refused():
    m = sa.models.forgetting_attention(8, heads=2, dtype=f64)

    class Wrong(type(m)):
        def log_gates(self, x):
            return super().log_gates(x)[..., :-1]

    wrong = Wrong(8, heads=2, dtype=f64)
    with pytest.raises(ValueError, match=r"ForgettingGate has log_f for 4 tokens .* one per "
                                         r"parent \(5\)"):
        sa.compile(wrong)(torch.randn(1, 5, 8, dtype=f64))


def test_unchecked_gates_are_not_read():
    with sa.validation(False):
        prior = sa.priors.ForgettingGate(torch.tensor([0.5]))
    assert prior.log_f.item() == 0.5
