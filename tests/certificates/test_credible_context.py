"""Credible context lengths under the geometric–Beta prior (``sa.windows.credible_context``):
the interval's ends are the quantiles of p(q_i | x) computed here by quadrature of the joint
as written (q explicit, no conjugacy), and NUTS on a Pyro model with q explicit — φ
enumerated — covers them at their level."""

import math

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import MCMC, NUTS

import structattn as sa

f64 = torch.float64


def _case(n=6, seed=0):
    torch.manual_seed(seed)
    m = sa.models.expanding_attention(2, inference=None, a=2.0, b=1.5, out_proj=False,
                                      dtype=f64)
    x = torch.randn(1, n, 2, dtype=f64)
    x[0, 1] = x[0, n - 1] = torch.tensor([1.5, 0.0], dtype=f64)  # a match 4 back from the last
    return m, x


def _scores(m, x):
    q, k = x[0] @ m.W_q.T, x[0] @ m.W_k.T
    return (q @ k.T / m.temperature if m.temperature is not None else
            q @ k.T / math.sqrt(m.d_k)).detach()


def _posterior_cdf(m, x, i, qs):
    """p(q_i ≤ qs | x) by quadrature of Beta(q; a, b) Σ_{d ≤ i} q^(d−1)(1 − q) e^ψ(i, i−d)."""
    a, b = float(m.a.detach()), float(m.b.detach())
    psi = _scores(m, x)[i]
    grid = np.linspace(1e-9, 1 - 1e-9, 400_001)
    d = np.arange(1, i + 1)[:, None]
    lik = (np.exp(psi[i - d[:, 0]].numpy())[:, None] * grid ** (d - 1) * (1 - grid)).sum(0)
    dens = grid ** (a - 1) * (1 - grid) ** (b - 1) * lik
    cdf = np.cumsum(dens)
    cdf /= cdf[-1]
    return np.interp(qs, grid, cdf)


def test_interval_ends_are_the_posterior_quantiles_by_quadrature():
    m, x = _case()
    ctx = sa.windows.credible_context(sa.compile(m), x, level=0.8)
    n = x.shape[1]
    for i in range(1, n):
        lo, hi = float(ctx.q_low[0, 0, i]), float(ctx.q_high[0, 0, i])
        assert _posterior_cdf(m, x, i, [lo, hi]) == pytest.approx([0.1, 0.9], abs=2e-4)
    torch.testing.assert_close(ctx.length_high, 1 / (1 - ctx.q_high))
    # the first token has no past: the prior's interval
    from scipy.stats import beta
    lo, hi = beta(float(m.a.detach()), float(m.b.detach())).ppf([0.1, 0.9])
    assert float(ctx.q_low[0, 0, 0]) == pytest.approx(lo, abs=1e-8)
    assert float(ctx.q_high[0, 0, 0]) == pytest.approx(hi, abs=1e-8)


def test_nuts_on_the_model_with_q_explicit_covers_the_intervals():
    m, x = _case()
    n = x.shape[1]
    psi = _scores(m, x)
    a, b = float(m.a.detach()), float(m.b.detach())
    i = torch.arange(1, n)[:, None]  # tokens with a past
    d = torch.arange(1, n)[None, :]  # their distances

    def model():
        with pyro.plate("tokens", n - 1):
            q = pyro.sample("q", dist.Beta(torch.tensor(a, dtype=f64), torch.tensor(b, dtype=f64)))
            logits = torch.where(d <= i, (d - 1) * q.log()[:, None] + torch.log1p(-q)[:, None],
                                 torch.tensor(-math.inf, dtype=f64))
            # Categorical renormalises over d ≤ i by 1 − q^i; the model does not
            pyro.factor("truncation", torch.log1p(-q ** i[:, 0].to(f64)))
            phi = pyro.sample("phi", dist.Categorical(logits=logits),
                              infer={"enumerate": "parallel"})
            rows = i[:, 0]
            pyro.factor("psi", psi[rows, (rows - 1 - phi).clamp(min=0)])

    pyro.set_rng_seed(0)
    run = MCMC(NUTS(model, max_plate_nesting=1), num_samples=500, warmup_steps=200,
               disable_progbar=True)
    run.run()
    draws = run.get_samples()["q"]  # (draws, n − 1)
    ctx = sa.windows.credible_context(sa.compile(m), x, level=0.8)
    inside = ((draws >= ctx.q_low[0, 0, 1:]) & (draws <= ctx.q_high[0, 0, 1:])).to(f64)
    per_token = inside.mean(0)
    assert (per_token - 0.8).abs().max() < 0.1, per_token
    assert abs(float(per_token.mean()) - 0.8) < 0.05, per_token


def test_mean_field_gives_its_q_factors_interval():
    torch.manual_seed(1)
    m = sa.models.expanding_attention(4, heads=2, dtype=f64)
    x = torch.randn(2, 30, 4, dtype=f64)
    ctx = sa.windows.credible_context(sa.compile(m), x, level=0.9)
    assert ctx.q_low.shape == (2, 2, 30)
    assert (ctx.q_low[..., 1:] < ctx.q_high[..., 1:]).all()
    assert (ctx.length_low >= 1).all()


@pytest.mark.parametrize("level", [0, 1, -0.5, "wide", True])
def test_a_bad_level_is_refused(level):
    m, x = _case()
    with pytest.raises(ValueError, match=r"level must be a number in \(0, 1\)"):
        sa.windows.credible_context(sa.compile(m), x, level=level)


def test_a_declaration_instead_of_a_layer_is_refused():
    m, x = _case()
    with pytest.raises(ValueError, match=r"layer must be a compiled layer .* got ExpandingAttention"):
        sa.windows.credible_context(m, x)
