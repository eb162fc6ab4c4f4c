"""One ArviZ convention for every result (``inference/_arviz.py``): ``to_arviz()`` on sample,
exact, map_estimate, svi, mcmc and predictive; leading (chain, draw) dims, named dims
``<family>_batch_k / _head / _child (/ _parent / _feature)``, ``<z>_batch_k / _node /
_feature``, ``output_dim_k``; point results as one chain of one draw."""

import warnings

import arviz as az
import pytest
import torch

import structattn as sa

from .helpers import conjugate_toy

f64 = torch.float64
EDGE = ("chain", "draw", "attn_batch_0", "attn_head", "attn_child")


def _groups(data) -> set:
    """Group names, arviz 0.x (InferenceData) or 1.x (DataTree)."""
    return set(data.groups()) if hasattr(data, "groups") and callable(data.groups) \
        else set(data.children)


def _values(data, group, name):
    return torch.as_tensor(data[group][name].values)


@pytest.fixture
def attention():
    torch.manual_seed(0)
    m = sa.models.self_attention(4, d_k=2, heads=2, dtype=f64)
    return m, torch.randn(2, 3, 4, dtype=f64)


def test_sample_to_arviz_names_dims_and_keeps_one_chain(attention):
    """Independent draws are one chain (no 'More chains (4) than draws (2)' at 8 samples), the
    edge dims are the documented names, and the values are the draws."""
    m, x = attention
    draws = sa.inference.sample(m, x, num_samples=8)
    assert draws.edges["attn"].shape == (1, 8, 2, 2, 3)  # (chain, draw, batch, H, C)
    assert draws.outputs.shape == (1, 8, 2, 3, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        data = draws.to_arviz()
    assert not [w for w in caught if "chain" in str(w.message)], [str(w.message) for w in caught]
    assert data["posterior"]["attn"].dims == EDGE
    assert data["posterior"]["output"].dims == ("chain", "draw", "output_dim_0", "output_dim_1",
                                                "output_dim_2")
    assert torch.equal(_values(data, "posterior", "attn"), draws.edges["attn"])
    torch.testing.assert_close(_values(data, "posterior", "output"), draws.outputs)


def test_sample_chains_deal_the_draws(attention):
    m, x = attention
    draws = sa.inference.sample(m, x, num_samples=8, chains=2)
    assert draws.edges["attn"].shape == (2, 4, 2, 2, 3)
    assert draws.num_chains == 2 and draws.num_draws == 4
    assert draws.flat(draws.edges)["attn"].shape == (8, 2, 2, 3)
    assert draws.to_arviz()["posterior"]["attn"].shape[:2] == (2, 4)


def test_exact_to_arviz_is_one_draw_of_the_exact_posterior(attention):
    m, x = attention
    truth = sa.inference.exact(m, x)
    data = truth.to_arviz()
    post = data["posterior"]
    assert post["attn"].dims == EDGE
    assert post["attn_posterior"].dims == (*EDGE, "attn_parent")
    assert post["attn_value"].dims == (*EDGE, "attn_feature")
    assert post["output"].dims == ("chain", "draw", "output_dim_0", "output_dim_1", "output_dim_2")
    assert torch.equal(_values(data, "posterior", "attn")[0, 0], truth.map_edges["attn"])
    torch.testing.assert_close(_values(data, "posterior", "attn_posterior")[0, 0],
                               truth.marginals["attn"].detach(), atol=0, rtol=0)
    torch.testing.assert_close(_values(data, "posterior", "attn_value")[0, 0],
                               truth.expectations["attn"].detach(), atol=0, rtol=0)
    torch.testing.assert_close(_values(data, "posterior", "output")[0, 0], truth.output.detach(),
                               atol=0, rtol=0)
    assert _values(data, "sample_stats", "free_energy").shape == (1, 1)
    assert float(_values(data, "sample_stats", "free_energy")) == pytest.approx(
        float(truth.free_energy), abs=1e-12)


def test_map_estimate_to_arviz():
    program, x, z0, _, _ = conjugate_toy()
    found = sa.inference.map_estimate(program, x, z0)
    data = found.to_arviz()
    assert data["posterior"]["z"].dims == ("chain", "draw", "z_batch_0", "z_node", "z_feature")
    torch.testing.assert_close(_values(data, "posterior", "z")[0, 0], found.latents["z"],
                               atol=0, rtol=0)
    assert float(_values(data, "sample_stats", "free_energy")) == pytest.approx(
        float(found.free_energy), abs=1e-12)


def test_mcmc_draws_have_chain_and_draw_dims():
    """mcmc(...).latents/edges/outputs lead with (chain, draw), as to_arviz does."""
    program, x, z0, _, _ = conjugate_toy()
    draws = sa.inference.mcmc(program, x, z0, num_samples=12, warmup_steps=10, num_chains=2,
                              progress=False)
    assert draws.latents["z"].shape == (2, 12, *z0.shape)
    assert draws.edges["pick"].shape == (2, 12, 1, 1, 1)
    assert draws.stats["diverging"].shape == (2, 12)
    data = draws.to_arviz()
    assert data["posterior"]["z"].dims == ("chain", "draw", "z_batch_0", "z_node", "z_feature")
    assert data["posterior"]["pick"].dims == ("chain", "draw", "pick_batch_0", "pick_head",
                                              "pick_child")
    assert {"posterior", "sample_stats"} <= _groups(data)
    torch.testing.assert_close(_values(data, "posterior", "z"), draws.latents["z"])


def test_svi_and_predictive_to_arviz():
    program, x, z0, _, _ = conjugate_toy()
    fit = sa.inference.svi(program, x, z0, guide="normal", num_steps=50, progress=False)
    data = fit.to_arviz(num_samples=6)
    assert data["posterior"]["z"].shape[:2] == (1, 6)  # independent guide draws: one chain
    assert data["posterior"]["pick"].dims == ("chain", "draw", "pick_batch_0", "pick_head",
                                              "pick_child")
    assert "observed_data" in _groups(data)
    prior = sa.inference.predictive(program, x, z0, num_samples=6).to_arviz(group="prior")
    assert "prior" in _groups(prior)
    assert prior["prior"]["z"].dims == ("chain", "draw", "z_batch_0", "z_node", "z_feature")


def test_arviz_summary_reads_the_convention(attention):
    m, x = attention
    data = sa.inference.sample(m, x * 0.1, num_samples=40, chains=2).to_arviz()
    summary = az.summary(data, var_names=["attn"])
    assert len(summary) == 2 * 2 * 3  # one row per (batch, head, child)
