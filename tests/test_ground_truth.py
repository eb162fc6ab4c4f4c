"""Ground truth beyond enumeration: sampling, SVI, MCMC, predictive draws, ArviZ, verdicts.

Statistical tests state their seed and tolerance: chi-square tests at level 1e-3 per
test (Bonferroni over the rows tested), Monte-Carlo errors from ArviZ's effective sample
size.
"""

import math

import arviz as az
import pyro
import pyro.distributions as dist
import pytest
import torch
from scipy import stats

import structattn as sa

f64 = torch.float64


def chi_square_ok(counts: torch.Tensor, probs: torch.Tensor, alpha: float = 1e-3) -> bool:
    """Each row of ``counts`` (…, K) against ``probs`` (…, K), Bonferroni over the rows."""
    counts, probs = counts.reshape(-1, counts.shape[-1]), probs.reshape(-1, probs.shape[-1])
    level = alpha / counts.shape[0]
    for c, p in zip(counts, probs, strict=True):
        keep = p > 0
        assert c[~keep].sum() == 0  # never outside the support
        n = c.sum()
        if keep.sum() < 2:
            continue
        _, pval = stats.chisquare(c[keep].numpy(), (n * p[keep]).numpy())
        if pval < level:
            return False
    return True


def test_edge_draws_match_the_exact_marginals():
    torch.manual_seed(1)
    m = sa.models.self_attention(5, d_k=3, heads=2, causal=True, dtype=f64)
    x = torch.randn(2, 4, 5, dtype=f64)
    draws = sa.inference.sample(m, x, num_samples=400)
    exact = sa.inference.exact(m, x).marginals["attn"].detach()  # (2, 2, 4, 4)
    counts = torch.nn.functional.one_hot(draws.edges["attn"], 4).sum(0).double()
    assert chi_square_ok(counts, exact)


def test_prior_predictive_edge_frequencies_match_the_prior():
    logits = torch.randn(3, 5, dtype=f64)

    def program(x):
        n = sa.nodes("x", x)
        q = sa.nodes("q", x[..., :3, :])
        phi = sa.edges("read", q, n, sa.priors.Categorical(logits))
        sa.potential(phi, sa.potentials.DotProduct())
        return sa.value(phi, sa.values.Identity())

    x = torch.randn(1, 5, 2, dtype=f64)
    draws = sa.inference.predictive(program, x, num_samples=800, seed=3)
    counts = torch.nn.functional.one_hot(draws.edges["read"].reshape(-1, 3), 5).sum(0).double()
    assert chi_square_ok(counts, torch.softmax(logits, -1))
    idata = draws.to_arviz(group="prior")
    assert "prior" in idata.groups() and "read" in idata.prior


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


def conjugate_toy(s=1.5, tau=0.7):
    """z ~ N(0, s²) (d = 2); φ ~ Uniform(observed x_j); ψ = −‖z − x_j‖²/2τ. The posterior is a
    Gaussian mixture: weights w_j ∝ N(x_j; 0, (s² + τ)I), means x_j s²/(s² + τ)."""
    def program(x, z0):
        obs = sa.nodes("x", x)
        z = sa.latent("z", z0, scale=s)
        phi = sa.edges("pick", z, obs, sa.priors.Uniform())
        sa.potential(phi, sa.potentials.SquaredDistance(temperature=tau))
        return sa.infer(z)

    x = torch.tensor([[[-2.0, 0.5], [1.5, 1.0], [0.3, -1.8]]], dtype=f64)
    w = torch.softmax(-(x[0] ** 2).sum(-1) / (2 * (s * s + tau)), -1)
    mean = (w[:, None] * x[0] * s * s / (s * s + tau)).sum(0)
    return program, x, torch.zeros(1, 1, 2, dtype=f64), w, mean


def test_nuts_posterior_mean_within_monte_carlo_error():
    program, x, z0, w, mean = conjugate_toy()
    draws = sa.inference.mcmc(program, x, z0, num_samples=400, warmup_steps=200, num_chains=2,
                              progress=False, seed=0)
    idata = draws.to_arviz()
    summary = az.summary(idata, var_names=["z"])
    est = torch.tensor(summary["mean"].to_numpy())
    mcse = torch.tensor(summary["mcse_mean"].to_numpy())
    assert ((est - mean).abs() <= 4 * mcse + 1e-3).all(), (est, mean, mcse)
    assert (summary["r_hat"] < 1.05).all()
    # the edge draws that Pyro's MCMC drops: p(φ = j | x) = w_j after z is integrated out
    counts = torch.nn.functional.one_hot(draws.edges["pick"].reshape(-1), 3).sum(0).double()
    freq = counts / counts.sum()
    assert (freq - w).abs().max() < 0.08  # 800 correlated draws
    assert {"posterior", "sample_stats"} <= set(idata.groups())
    assert idata.posterior["pick"].dims == ("chain", "draw", "pick_batch_0", "pick_head",
                                            "pick_child")


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


def test_compare_fails_a_program_that_is_not_affine_in_its_values():
    """Exact enumeration evaluates the program at E[v]; only the sampled check sees that
    E[v²] ≠ E[v]²."""
    W = torch.randn(3, 3, dtype=f64)

    def squared(x):
        n = sa.nodes("x", x)
        phi = sa.edges("attn", n, n, sa.priors.Uniform())
        sa.potential(phi, sa.potentials.Bilinear(W, W, temperature=0.5))
        return sa.value(phi, sa.values.Linear(W)) ** 2

    x = 2 * torch.randn(1, 4, 3, dtype=f64)
    assert sa.inference.compare(squared, x).passed  # blind to it
    report = sa.inference.compare(squared, x, method="samples", num_samples=400)
    assert not report.passed and "FAIL" in str(report)
    assert any(c.kind == "z" and not c.passed for c in report.checks)


def test_compare_verdicts_and_plot(tmp_path):
    m = sa.models.cross_attention(4, 3, d_k=2, heads=2, dtype=f64)
    q, k = torch.randn(2, 3, 4, dtype=f64), torch.randn(2, 5, 3, dtype=f64)
    report = sa.inference.compare(m, q, k)
    assert report.passed and bool(report) and str(report).startswith("PASS (exact)")
    assert all(c.tolerance == 1e-6 for c in report.checks)
    report.plot(tmp_path / "cmp.png")
    assert (tmp_path / "cmp.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    strict = sa.inference.compare(m, q, k, atol=0.0)
    assert not strict.passed or strict.max_abs_diff == 0.0
    with pytest.raises(ValueError, match="method must be one of"):
        sa.inference.compare(m, q, k, method="vibes")
    with pytest.raises(ValueError, match="has none"):
        sa.inference.compare(m, q, k, method="mcmc")


def test_z_threshold_is_bonferroni():
    from structattn.inference.compare import z_threshold

    assert abs(z_threshold(1, 0.05) - 1.959964) < 1e-5
    assert abs(z_threshold(100, 0.01) - stats.norm.ppf(1 - 0.01 / 200)) < 1e-9


def test_a_model_too_big_to_enumerate_is_refused_before_running():
    m = sa.models.self_attention(8, heads=2)
    with pytest.raises(ValueError, match=r"needs at least .* GiB .* structattn.inference.sample"):
        sa.inference.exact(m, torch.randn(4, 64, 8), max_bytes=2**16)


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


def test_bad_arguments():
    program, x, z0, *_ = conjugate_toy()
    with pytest.raises(ValueError, match="guide must be"):
        sa.inference.svi(program, x, z0, guide="laplace")
    with pytest.raises(ValueError, match="num_steps"):
        sa.inference.svi(program, x, z0, num_steps=0)
    with pytest.raises(ValueError, match="num_chains"):
        sa.inference.mcmc(program, x, z0, num_chains=0)
    m = sa.models.self_attention(4, heads=1, dtype=f64)
    with pytest.raises(ValueError, match="no latent node set.*inference.sample"):
        sa.inference.mcmc(m, torch.randn(1, 3, 4, dtype=f64))
    flat = sa.models.predictive_coding([3, 2])
    with pytest.raises(ValueError, match="flat .*prior"):
        sa.inference.predictive(flat, torch.randn(2, 3))
    assert math.isfinite(float(sa.inference.svi(program, x, z0, num_steps=5,
                                                progress=False).losses[-1]))
