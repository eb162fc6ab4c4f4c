"""Posterior samples through Pyro's infer_discrete: edges follow the exact marginals (a
chi-square test at level 1e-3, Bonferroni over rows; 5 standard errors), ArviZ."""

import pytest
import torch

import structattn as sa

from .helpers import chi_square_ok

f64 = torch.float64


def test_edge_draws_match_the_exact_marginals():
    torch.manual_seed(1)
    m = sa.models.self_attention(5, d_k=3, heads=2, causal=True, dtype=f64)
    x = torch.randn(2, 4, 5, dtype=f64)
    draws = sa.inference.sample(m, x, num_samples=400)
    exact = sa.inference.exact(m, x).marginals["attn"].detach()  # (2, 2, 4, 4)
    counts = torch.nn.functional.one_hot(draws.flat(draws.edges)["attn"], 4).sum(0).double()
    assert chi_square_ok(counts, exact)


def _x(*shape):
    return torch.randn(*shape, dtype=torch.float64)


def test_sampled_edges_follow_the_exact_marginals():
    m = sa.models.self_attention(5, d_k=3, heads=2, causal=True, dtype=torch.float64)
    x = _x(2, 4, 5)
    S = 2000
    samples = sa.inference.sample(m, x, num_samples=S)
    assert samples.edges["attn"].shape == (1, S, 2, 2, 4)  # (chain, draw, batch, H, C)
    assert bool((samples.edges["attn"] <= torch.arange(4)).all())  # inside the causal support
    p = sa.inference.exact(m, x).marginals["attn"].detach()
    freq = torch.nn.functional.one_hot(samples.edges["attn"], 4).double().mean((0, 1))
    se = (p * (1 - p) / S).sqrt()
    assert bool(((freq - p).abs() <= 5 * se + 1e-12).all())


def test_to_arviz_summary():
    import arviz as az

    # non-causal: a causal child 0 has one parent, a constant ArviZ cannot diagnose
    m = sa.models.self_attention(4, d_k=2, heads=1, dtype=torch.float64)
    samples = sa.inference.sample(m, _x(1, 3, 4) * 0.1, num_samples=40, chains=4)
    idata = samples.to_arviz()
    assert idata.posterior["attn"].shape[:2] == (4, 10)
    summary = az.summary(idata, var_names=["attn"])
    assert len(summary) == 3


def test_sample_bad_input():
    m = sa.models.self_attention(4, d_k=2)
    with pytest.raises(ValueError, match=r"num_samples must be an int ≥ 2; got 1"):
        sa.inference.sample(m, torch.randn(1, 3, 4), num_samples=1)
    with pytest.raises(ValueError, match=r"chains must be a positive int dividing "
                                         r"num_samples=10; got 4"):
        sa.inference.sample(m, torch.randn(1, 3, 4), num_samples=10, chains=4)
