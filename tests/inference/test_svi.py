"""SVI: the MAP guide reaches the compiled fixed point; the mean-field guide and posterior
predictive draws."""

import torch

import structattn as sa

from .helpers import conjugate_toy

f64 = torch.float64


def test_svi_map_converges_to_the_compiled_fixed_point():
    m = sa.models.slot_attention(3, 4, recipe="collapsed", dtype=f64)
    x, z0 = torch.randn(1, 8, 4, dtype=f64), torch.randn(1, 3, 4, dtype=f64)
    with sa.iteration(steps=2000, tol=1e-12):
        fixed = sa.compile(m)(x, z0)
    fit = sa.inference.svi(m, x, z0, guide="map", num_steps=3000, lr=0.05, tol=1e-10,
                           progress=False)
    assert (fit.latents["slots"] - fixed).abs().max() < 1e-3
    assert fit.losses[-1] < fit.losses[0]
    truth = sa.inference.exact(m, x, z0, latents={"slots": fixed}).marginals["assign"]
    assert (fit.marginals["assign"] - truth).abs().max() < 1e-3


def test_mean_field_guide_and_posterior_predictive():
    program, x, z0, w, mean = conjugate_toy()
    fit = sa.inference.svi(program, x, z0, guide="normal", num_steps=1500, lr=0.02,
                           progress=False, seed=1)
    assert fit.marginals["pick"].shape == (1, 1, 1, 3)
    assert torch.allclose(fit.marginals["pick"].sum(-1), torch.ones(1, 1, 1, dtype=f64))
    post = sa.inference.predictive(program, x, z0, num_samples=40, posterior=fit, chains=2)
    assert post.latents["z"].shape == (2, 20, 1, 1, 2)
    idata = fit.to_arviz(num_samples=40, chains=2)
    assert "observed_data" in idata.groups() and "z" in idata.posterior
