"""Relative-position attention: a clipped offset table as the log prior."""

import pytest
import torch

import structattn as sa

from ..reference import softmax_attention

TOL = 1e-6


def _x(*shape):
    return torch.randn(*shape, dtype=torch.float64)


@pytest.mark.parametrize("causal", [False, True])
def test_relative_position_bias_is_clipped_offset_table(causal):
    m = sa.models.relative_position_attention(7, max_distance=2, d_k=3, heads=2, causal=causal,
                                              dtype=torch.float64)
    with torch.no_grad():
        m.position_logits.normal_()
    n = 6
    bias = torch.empty(2, n, n, dtype=torch.float64)
    for h in range(2):
        for i in range(n):
            for j in range(n):
                bias[h, i, j] = m.position_logits[h, max(-2, min(2, i - j)) + 2]
    x = _x(3, n, 7)
    ref, p_ref = softmax_attention(m.W_q, m.W_k, m.W_v, m.W_o, x, x, 2, bias=bias, causal=causal)
    y, post = sa.compile(m)(x, return_posterior=True)
    torch.testing.assert_close(sa.compile(m)(x), ref, atol=TOL, rtol=0)
    torch.testing.assert_close(post, p_ref.expand_as(post), atol=TOL, rtol=0)
    assert sa.inference.compare(m, x).max_abs_diff < TOL
    sa.compile(m)(x).sum().backward()
    assert m.position_logits.grad.abs().sum() > 0


def test_relative_and_alibi_bad_input():
    with pytest.raises(ValueError, match=r"RelativePosition prior: logits must be .*\(2K\+1,\).*"
                                         r"\(2, 4\)"):
        sa.priors.RelativePosition(torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"ALiBi prior: slopes must be .* m ≥ 0"):
        sa.priors.ALiBi(2, slopes=torch.tensor([0.5, -1.0]))
    with pytest.raises(ValueError, match=r"max_distance must be an int ≥ 0"):
        sa.models.relative_position_attention(4, max_distance=-1)
    m = sa.models.relative_position_attention(4, max_distance=1, heads=2, d_k=2)
    with pytest.raises(ValueError, match=r"node set 'x'.*\(\*batch, n, 4\)"):
        sa.compile(m)(torch.randn(1, 3, 5))
