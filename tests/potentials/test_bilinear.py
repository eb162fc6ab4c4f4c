"""The bilinear potential's temperature: a tempered posterior, not a hack."""

import torch

import structattn as sa


def _x(*shape):
    return torch.randn(*shape, dtype=torch.float64)


def test_temperature_is_a_tempered_posterior():
    """p_τ(φ_i = j | x) ∝ p_1(φ_i = j | x)^(1/τ) under a uniform prior."""
    m1 = sa.models.self_attention(6, d_k=3, heads=2, temperature=1.0, dtype=torch.float64)
    m2 = sa.models.self_attention(6, d_k=3, heads=2, temperature=2.5, dtype=torch.float64)
    m2.load_state_dict(m1.state_dict())
    x = _x(2, 5, 6)
    _, p1 = sa.compile(m1)(x, return_posterior=True)
    _, p2 = sa.compile(m2)(x, return_posterior=True)
    tempered = p1 ** (1 / 2.5)
    torch.testing.assert_close(p2, tempered / tempered.sum(-1, keepdim=True), atol=1e-12, rtol=0)
