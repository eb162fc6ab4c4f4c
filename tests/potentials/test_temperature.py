"""One temperature per head: τ of shape ``(heads,)`` tempers head h's posterior by τ_h, in every
potential that takes a temperature, in Pyro's reading (``Potential.at``, the oracle) and in
the compiled fast paths (SDPA, edge list, band, the dense table, the CCCP/EM update)."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import structattn as sa

f64 = torch.float64


def _potential(kind, H, tau, d, g, sizes):
    """A potential of ``kind`` with per-head temperature ``tau`` on d features."""
    def randn(*shape):
        return torch.randn(*shape, dtype=f64, generator=g)

    dk = 2
    if kind == "bilinear":
        return sa.potentials.Bilinear(randn(H * dk, d), randn(H * dk, d), heads=H, temperature=tau)
    if kind == "dot":
        return sa.potentials.DotProduct(temperature=tau, heads=H)
    if kind == "squared":
        return sa.potentials.SquaredDistance(temperature=tau, heads=H)
    if kind == "positional":
        base = sa.potentials.Bilinear(randn(H * dk, d), randn(H * dk, d), heads=H,
                                      temperature=tau)
        return sa.potentials.Positional(base, randn(sizes[0], d), randn(sizes[1], d))
    if kind == "mapped":
        W = randn(d, d)
        return sa.potentials.Mapped(sa.potentials.DotProduct(temperature=tau, heads=H),
                                    children=lambda x: torch.tanh(x @ W.T))
    raise AssertionError(kind)


PRIORS = ["uniform", "causal", "mask", "edges", "categorical", "window"]


def _prior(kind, H, C, P, g):
    if kind == "uniform":
        return sa.priors.Uniform()
    if kind == "causal":
        return sa.priors.Uniform(causal=True)
    mask = torch.rand(C, P, generator=g) < 0.6
    mask[..., 0] = True
    if kind == "mask":
        return sa.priors.Uniform(support=mask)
    if kind == "edges":
        dst, src = mask.nonzero().T
        return sa.priors.Uniform(edge_index=torch.stack([src, dst]))
    if kind == "categorical":
        return sa.priors.Categorical(torch.randn(H, C, P, dtype=f64, generator=g))
    if kind == "window":  # the banded kernel: exact beta-geometric prior, windowed
        ab = torch.rand(2, H, generator=g, dtype=f64) * 2 + 0.5
        return sa.priors.BetaGeometric(ab[0], ab[1], prior_tol=0.3, block_size=2)
    raise AssertionError(kind)


@st.composite
def per_head_declarations(draw):
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    H = draw(st.integers(2, 3))
    d = H * draw(st.integers(1, 2))
    batch = tuple(draw(st.lists(st.sampled_from([1, 2]), max_size=2)))
    prior_kind = draw(st.sampled_from(PRIORS))
    same = prior_kind == "window" or draw(st.booleans())
    C = draw(st.integers(1, 5))
    P = C if same else draw(st.integers(1, 5))
    # "two": two potentials in one family (the dense table, not a fused kernel)
    kind = draw(st.sampled_from(["bilinear", "dot", "squared", "positional", "mapped", "two"]))
    tau = torch.rand(H, dtype=f64, generator=g) * 2.5 + 0.3
    if draw(st.booleans()):
        tau = tau.tolist()  # a list of floats: one per head
    pots = ([_potential("bilinear", H, tau, d, g, (C, P)), _potential("dot", H, tau, d, g, (C, P))]
            if kind == "two" else [_potential(kind, H, tau, d, g, (C, P))])
    prior = _prior(prior_kind, H, C, P, g)
    Wv = torch.randn(H * 2, d, dtype=f64, generator=g)
    x = torch.randn(*batch, C, d, dtype=f64, generator=g)
    y = torch.randn(*batch, P, d, dtype=f64, generator=g)

    def program(x, y):
        c = sa.nodes("x", x)
        p = c if same else sa.nodes("y", y)
        phi = sa.edges("attn", c, p, prior, heads=H)
        for psi in pots:
            sa.potential(phi, psi)
        return sa.merge_heads(sa.value(phi, sa.values.Linear(Wv, heads=H)))

    return program, (x, y), dict(H=H, prior=prior_kind, potential=kind)


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(per_head_declarations())
def test_per_head_temperature_matches_pyro(case):
    """Compiled (SDPA / edge list / band / dense table) vs Pyro's exact enumeration, whose ψ is
    each potential's definition divided by τ_h: output, posterior and E[v] to 1e-6."""
    program, inputs, info = case
    report = sa.inference.compare(program, *inputs, atol=1e-6)
    assert report.passed and report.max_abs_diff < 1e-6, (info, str(report))


@pytest.mark.parametrize("kind", ["bilinear", "dot", "squared", "positional", "mapped"])
@pytest.mark.parametrize("prior", ["uniform", "edges", "window"])
def test_per_head_temperature_is_each_head_at_its_own_temperature(kind, prior):
    """Head h of a model with τ = (τ_0, …) is head h of the same model at the scalar τ_h —
    so a temperature applied to the wrong head (or to all heads) fails."""
    H, n, d = 3, 5, 6
    tau = torch.tensor([0.4, 1.0, 2.5], dtype=f64)

    def build(t):
        g = torch.Generator().manual_seed(1)  # the same weights for every τ
        psi = _potential(kind, H, t, d, g, (n, n))
        pr = _prior(prior, H, n, n, g)

        def program(x):
            c = sa.nodes("x", x)
            phi = sa.edges("attn", c, c, pr, heads=H)
            sa.potential(phi, psi)
            return sa.value(phi, sa.values.Identity(heads=H))
        return program

    x = torch.randn(2, n, d, dtype=f64)
    y, post = sa.compile(build(tau))(x, return_posterior=True)
    head = -2 if prior == "edges" else -3  # (*batch, H, E) for an edge list, else (…, H, C, P)
    for h in range(H):
        y_h, ref = sa.compile(build(float(tau[h])))(x, return_posterior=True)
        torch.testing.assert_close(post.select(head, h), ref.select(head, h), atol=1e-12, rtol=0)
        torch.testing.assert_close(y[..., h, :, :], y_h[..., h, :, :], atol=1e-12, rtol=0)
    truth = sa.inference.exact(build(tau), x).marginals["attn"]
    for h in range(H):
        ref = sa.inference.exact(build(float(tau[h])), x).marginals["attn"]
        torch.testing.assert_close(truth[..., h, :, :], ref[..., h, :, :], atol=1e-12, rtol=0)
    assert (truth[..., 0, :, :] - truth[..., 2, :, :]).abs().max() > 1e-3  # τ matters


@pytest.mark.parametrize("kind", ["dot", "squared", "bilinear-identity"])
def test_per_head_temperature_in_latent_iteration(kind):
    """A latent iterated by CCCP (linear potentials) or EM (squared distance) with τ per head:
    the compiled iteration vs Pyro at its final state (posteriors, values, free energy) and its
    fixed point vs Pyro's MAP."""
    H, d = 2, 4
    tau = torch.tensor([0.7, 1.9], dtype=f64)
    Wk = torch.randn(d, d, dtype=f64)

    def program(z0, x):
        obs = sa.nodes("x", x)
        lat = sa.latent("z", z0, scale=0.8, steps=200, tol=1e-12)
        phi = sa.edges("f", lat, obs, sa.priors.Uniform(), heads=H)
        if kind == "dot":
            psi = sa.potentials.DotProduct(temperature=tau, heads=H)
        elif kind == "squared":
            psi = sa.potentials.SquaredDistance(temperature=tau, heads=H)
        else:
            psi = sa.potentials.Bilinear(None, Wk, heads=H, temperature=tau)
        sa.potential(phi, psi)
        return sa.infer(lat)

    z0, x = torch.randn(2, 3, d, dtype=f64), torch.randn(2, 5, d, dtype=f64)
    report = sa.inference.compare(program, z0, x, atol=1e-6)
    assert report.passed and report.max_abs_diff < 1e-6, str(report)
    assert report.fixed_point is not None and max(report.fixed_point.values()) < 1e-4, str(report)


def _learned_program(kind, prior, H=2, d=4, n=4):
    g = torch.Generator().manual_seed(3)
    W = torch.randn(H * 2, d, dtype=f64, generator=g)
    pr = _prior(prior, H, n, n, g)

    def program(x, tau):
        c = sa.nodes("x", x)
        phi = sa.edges("attn", c, c, pr, heads=H)
        if kind == "bilinear":
            psi = sa.potentials.Bilinear(W, W, heads=H, temperature=tau)
        elif kind == "dot":
            psi = sa.potentials.DotProduct(temperature=tau, heads=H)
        else:
            psi = sa.potentials.SquaredDistance(temperature=tau, heads=H)
        sa.potential(phi, psi)
        return sa.merge_heads(sa.value(phi, sa.values.Linear(W, heads=H)))
    return program


@pytest.mark.parametrize("kind", ["bilinear", "dot", "squared"])
@pytest.mark.parametrize("prior", ["uniform", "causal", "edges", "window"])
def test_gradcheck_learned_per_head_temperature(kind, prior):
    """∂(output, posterior)/∂τ per head through each fused path, against finite differences;
    and the compiled gradient equals the gradient of Pyro's exact E[v] (the oracle)."""
    program = _learned_program(kind, prior)
    layer = sa.compile(program)
    x = torch.randn(2, 4, 4, dtype=f64)
    tau = torch.tensor([0.6, 1.7], dtype=f64, requires_grad=True)

    def f(t):
        y, post = layer(x, t, return_posterior=True)
        return y, post

    assert torch.autograd.gradcheck(f, (tau,))
    y = layer(x, tau)
    w = torch.randn_like(y)
    (g_compiled,) = torch.autograd.grad((y * w).sum(), tau)
    truth = sa.inference.exact(program, x, tau)
    (g_pyro,) = torch.autograd.grad((truth.output * w).sum(), tau)
    torch.testing.assert_close(g_compiled, g_pyro, atol=1e-8, rtol=0)
    assert g_compiled.abs().min() > 0  # each head's τ reaches the output


def test_learned_per_head_temperature_trains():
    """An nn.Parameter of shape (heads,) as a model's temperature is learned per head."""
    m = sa.models.self_attention(6, d_k=3, heads=2, temperature=torch.nn.Parameter(
        torch.tensor([1.0, 2.0], dtype=f64)), dtype=f64)
    assert any(p is m.temperature for p in m.parameters())
    x = torch.randn(2, 5, 6, dtype=f64)
    sa.compile(m)(x).square().sum().backward()
    assert m.temperature.grad is not None and m.temperature.grad.shape == (2,)
    report = sa.inference.compare(m, x)
    assert report.passed and report.max_abs_diff < 1e-6, str(report)


# -- bad temperatures -----------------------------------------------------------------------

@pytest.mark.parametrize("make, where", [
    (lambda t: sa.potentials.Bilinear(torch.randn(4, 3), torch.randn(4, 3), heads=2,
                                      temperature=t), "Bilinear potential"),
    (lambda t: sa.potentials.DotProduct(temperature=t, heads=2), "DotProduct potential"),
    (lambda t: sa.potentials.SquaredDistance(temperature=t, heads=2), "SquaredDistance potential"),
    (lambda t: sa.models.self_attention(6, d_k=3, heads=2, temperature=t), "SelfAttention"),
])
def test_temperature_of_the_wrong_shape_is_refused(make, where):
    with pytest.raises(ValueError, match=rf"{where}: temperature must be a scalar or one per "
                                         rf"head, shape \(2,\) for heads=2; got shape \(3,\)"):
        make(torch.ones(3))
    with pytest.raises(ValueError, match=rf"{where}: temperature must be a scalar or one per "
                                         rf"head, shape \(2,\) for heads=2; got shape \(2, 1\)"):
        make(torch.ones(2, 1))
    with pytest.raises(ValueError, match=rf"{where}: temperature must be a floating-point tensor; "
                                         rf"got torch.int64"):
        make(torch.ones(2, dtype=torch.long))
    with pytest.raises(ValueError, match=rf"{where}: temperature must be a finite number > 0; "
                                         rf"got -0.5"):
        make([1.0, -0.5])


@pytest.mark.parametrize("bad, shown", [([0.5, -1.0], r"\[0.5, -1\]"), ([0.0, 2.0], r"\[0, 2\]"),
                                        ([float("nan"), 1.0], r"\[nan, 1\]")])
def test_per_head_temperature_not_positive_is_refused_at_run_time(bad, shown):
    """A tensor τ may change while learning: its values are checked when used (validating)."""
    layer = sa.compile(_learned_program("bilinear", "uniform"))
    x = torch.randn(1, 4, 4, dtype=f64)
    assert layer(x, torch.tensor([0.5, 2.0], dtype=f64)).shape == (1, 4, 4)
    with pytest.raises(ValueError, match=rf"edge family 'attn': temperature must be > 0; got "
                                         rf"{shown}"):
        layer(x, torch.tensor(bad, dtype=f64))


def test_per_head_temperature_is_drawn():
    psi = sa.potentials.Bilinear(torch.randn(4, 3), torch.randn(4, 3), heads=2,
                                 temperature=torch.tensor([0.5, 2.0]))
    assert psi.describe() == "Bilinear(heads=2, d_k=2, τ=[0.5, 2])"
