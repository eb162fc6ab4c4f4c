"""ALiBi attention: a relative-position prior with fixed slopes."""

import torch

import structattn as sa

TOL = 1e-6


def _x(*shape):
    return torch.randn(*shape, dtype=torch.float64)


def test_alibi_is_a_relative_position_prior_with_fixed_slopes():
    m = sa.models.alibi_attention(8, d_k=2, heads=4, causal=True, dtype=torch.float64)
    n = 5
    slopes = torch.tensor([2 ** (-8 * (h + 1) / 4) for h in range(4)], dtype=torch.float64)
    logits = -slopes[:, None] * torch.arange(-(n - 1), n, dtype=torch.float64).abs()
    x = _x(2, n, 8)
    y = sa.compile(m)(x)
    rel = sa.models.relative_position_attention(8, max_distance=n - 1, d_k=2, heads=4, causal=True,
                                                dtype=torch.float64)
    rel.load_state_dict({**m.state_dict(), "position_logits": logits}, strict=False)
    torch.testing.assert_close(y, sa.compile(rel)(x), atol=TOL, rtol=0)
    assert sa.inference.compare(m, x).max_abs_diff < TOL
    assert not any(p is m.slopes for p in m.parameters())  # fixed, a buffer
