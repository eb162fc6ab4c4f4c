"""Posterior samples through Pyro's infer_discrete: edges follow the exact marginals, the mean
output estimates E[output], and a non-affine program is caught."""

import pytest
import torch

import structattn as sa


def _x(*shape):
    return torch.randn(*shape, dtype=torch.float64)


def test_sampled_edges_follow_the_exact_marginals():
    m = sa.models.self_attention(5, d_k=3, heads=2, causal=True, dtype=torch.float64)
    x = _x(2, 4, 5)
    S = 2000
    samples = sa.inference.sample(m, x, num_samples=S)
    assert samples.edges["attn"].shape == (S, 2, 2, 4)
    assert bool((samples.edges["attn"] <= torch.arange(4)).all())  # inside the causal support
    p = sa.inference.exact(m, x).marginals["attn"].detach()
    freq = torch.nn.functional.one_hot(samples.edges["attn"], 4).double().mean(0)
    se = (p * (1 - p) / S).sqrt()
    assert bool(((freq - p).abs() <= 5 * se + 1e-12).all())


def test_compare_with_samples_accepts_affine_programs():
    m = sa.models.multihop_attention(5, d_k=3, heads=2, dtype=torch.float64)
    report = sa.inference.compare(m, _x(1, 4, 5), samples=600)
    assert report.max_abs_diff < 1e-6
    assert report.sampled_z < 5, str(report)


def test_compare_with_samples_catches_a_non_affine_program():
    """tanh after the value: the layer computes tanh(E[v]), not E[tanh(v)]."""
    W = torch.randn(2, 5, dtype=torch.float64)

    def program(x):
        n = sa.nodes("x", x)
        phi = sa.edges("a", n, n, sa.priors.Uniform())
        sa.potential(phi, sa.potentials.Bilinear(W, W))
        return torch.tanh(2 * sa.value(phi, sa.values.Linear(W)))

    report = sa.inference.compare(program, _x(1, 4, 5), samples=400)
    assert report.max_abs_diff < 1e-6  # at E[v] everything agrees …
    assert report.sampled_z > 5  # … but E[output] does not


def test_to_arviz_summary():
    import arviz as az

    # non-causal: a causal child 0 has one parent, a constant ArviZ cannot diagnose
    m = sa.models.self_attention(4, d_k=2, heads=1, dtype=torch.float64)
    samples = sa.inference.sample(m, _x(1, 3, 4) * 0.1, num_samples=40)
    idata = samples.to_arviz(chains=4)
    assert idata.posterior["attn"].shape[:2] == (4, 10)
    summary = az.summary(idata, var_names=["attn"])
    assert len(summary) == 3


def test_sample_bad_input():
    m = sa.models.self_attention(4, d_k=2)
    with pytest.raises(ValueError, match=r"num_samples must be an int ≥ 2; got 1"):
        sa.inference.sample(m, torch.randn(1, 3, 4), num_samples=1)
