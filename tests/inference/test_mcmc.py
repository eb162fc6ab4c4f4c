"""NUTS on a conjugate toy: the posterior mean within Monte-Carlo error (ArviZ's effective
sample size), the edge draws Pyro's MCMC drops."""

import arviz as az
import torch

import structattn as sa

from .helpers import conjugate_toy


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
