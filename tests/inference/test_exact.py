"""Exact enumeration (inference/exact.py): MAP edges, size limits, raw Pyro sites, latents."""


import pyro
import pyro.distributions as dist
import pytest
import torch

import structattn as sa


def _x(*shape):
    return torch.randn(*shape, dtype=torch.float64)


def test_exact_map_edges_are_the_posterior_argmax():
    m = sa.models.self_attention(5, d_k=3, heads=2, causal=True, dtype=torch.float64)
    x = _x(3, 7, 5) * 3
    truth = sa.inference.exact(m, x)
    _, post = sa.compile(m)(x, return_posterior=True)
    assert torch.equal(truth.map_edges["attn"], post.argmax(-1))
    torch.testing.assert_close(truth.marginals["attn"].sum(-1), torch.ones(3, 2, 7,
                               dtype=torch.float64))


def test_a_model_too_big_to_enumerate_is_refused_before_running():
    m = sa.models.self_attention(8, heads=2)
    with pytest.raises(ValueError, match=r"needs at least .* GiB .* structattn.inference.sample"):
        sa.inference.exact(m, torch.randn(4, 64, 8), max_bytes=2**16)


f64 = torch.float64


def test_raw_pyro_sites_are_refused_with_what_to_use_instead():
    def raw(x):
        n = sa.nodes("x", x)
        pyro.sample("noise", dist.Normal(0.0, 1.0))
        phi = sa.edges("attn", n, n, sa.priors.Uniform())
        sa.potential(phi, sa.potentials.DotProduct())
        return sa.value(phi, sa.values.Identity())

    def raw_factor(x):
        n = sa.nodes("x", x)
        pyro.factor("bonus", x.sum())
        phi = sa.edges("attn", n, n, sa.priors.Uniform())
        sa.potential(phi, sa.potentials.DotProduct())
        return sa.value(phi, sa.values.Identity())

    x = torch.randn(1, 3, 2, dtype=f64)
    with pytest.raises(ValueError, match=r"'noise' is a raw pyro.sample.*structattn.latent"):
        sa.inference.exact(raw, x)
    with pytest.raises(ValueError, match=r"'bonus' is a raw pyro.factor.*structattn.energy"):
        sa.inference.compare(raw_factor, x)


def test_exact_on_a_latent_model_asks_for_latent_states():
    m = sa.models.hopfield(4, iteration=sa.IterationOptions(steps=2), dtype=f64)
    r, Y = torch.randn(1, 2, 4, dtype=f64), torch.randn(1, 3, 4, dtype=f64)
    with pytest.raises(ValueError, match="pass latents="):
        sa.inference.exact(m, r, Y)
    with pytest.raises(ValueError, match="not latent node sets"):
        sa.inference.exact(m, r, Y, latents={"nope": r})
