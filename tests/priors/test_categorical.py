"""The categorical prior: −∞ logits exclude parents (also under torch.compile); empty="zero"."""

import pytest
import torch

import structattn as sa

from ..programs import one_family_program
from ..reference import softmax_attention

TOL = 1e-6


def _x(*shape):
    return torch.randn(*shape, dtype=torch.float64)


def test_neg_inf_logits_exclude_parents_under_torch_compile():
    logits = torch.randn(6, 6, dtype=torch.float64)
    logits[:, 0] = float("-inf")
    logits[0, 0] = 0.0  # child 0 keeps parent 0
    program, W = one_family_program(lambda: sa.priors.Categorical(logits))
    layer = sa.compile(program)
    x = _x(2, 6, 4)
    allowed = ~logits.isneginf()
    ref, _ = softmax_attention(W[0], W[1], W[2], None, x, x, 1,
                               bias=logits.masked_fill(~allowed, 0), mask=allowed)
    torch.testing.assert_close(layer(x)[:, 0], ref, atol=TOL, rtol=0)
    compiled = torch.compile(layer, fullgraph=True)
    torch.testing.assert_close(compiled(x)[:, 0], ref, atol=TOL, rtol=0)


f64 = torch.float64


def _categorical_program(logits, empty):
    W = torch.randn(4, 4, dtype=f64, generator=torch.Generator().manual_seed(0))

    def program(q, k):
        phi = sa.edges("a", sa.nodes("q", q), sa.nodes("k", k),
                       sa.priors.Categorical(logits, empty=empty))
        sa.potential(phi, sa.potentials.Bilinear(W, W))
        return sa.value(phi, sa.values.Linear(W))
    return program


def test_categorical_takes_empty_zero_and_both_paths_agree_unchecked():
    logits = torch.randn(3, 5, dtype=f64)
    logits[1] = float("-inf")  # child 1 has no allowed parent
    q, k = torch.randn(2, 3, 4, dtype=f64), torch.randn(2, 5, 4, dtype=f64)
    zero = _categorical_program(logits, "zero")
    out, post = sa.compile(zero)(q, k, return_posterior=True)
    assert out[:, :, 1].abs().max() == 0 and post[:, :, 1].abs().max() == 0
    assert sa.inference.compare(zero, q, k).passed
    refused = _categorical_program(logits, "error")
    with pytest.raises(ValueError, match="empty support"):
        sa.compile(refused)(q, k)
    with sa.validation(False):  # unchecked: zeros on both paths, never NaN on one of them
        plain = sa.compile(refused)(q, k)
        dense, post = sa.compile(refused)(q, k, return_posterior=True)
    assert torch.isfinite(post).all() and torch.isfinite(dense).all()
    torch.testing.assert_close(plain, dense)
    with pytest.raises(ValueError, match="empty must be"):
        sa.priors.Categorical(logits, empty="skip")
