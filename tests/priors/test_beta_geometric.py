"""The geometric–Beta prior (SPEC.md §5.2), exact reading.

Oracles, none of which reads structattn's lowering:

- the beta-geometric pmf against Pyro's Beta and Geometric log-densities integrated
  numerically over q (scipy's adaptive quadrature);
- the exact posterior against a Pyro model written here, q_i enumerated over Gauss–Jacobi
  nodes (exact for the polynomial-in-q geometric likelihood) and the edges enumerated,
  marginals by ``TraceEnum_ELBO.compute_marginals``.

The mean-field reading is tested in tests/windows/test_windows.py."""

import contextlib
import math

import hypothesis.strategies as st
import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from hypothesis import given, settings
from pyro.infer import TraceEnum_ELBO
from pyro.ops.indexing import Vindex
from scipy import integrate, special

import structattn as sa

from ..programs import program, scores_of

f64 = torch.float64


@pytest.mark.parametrize("a,b", [(1.0, 1.0), (0.4, 2.5), (3.0, 0.7)])
def test_pmf_is_the_beta_integral_of_the_geometric(a, b):
    prior = sa.priors.BetaGeometric(a, b)
    d = torch.arange(1, 13)
    got = prior.log_pmf(d)[0].exp()
    beta = dist.Beta(torch.tensor(a, dtype=f64), torch.tensor(b, dtype=f64))
    for k, dk in enumerate(d.tolist()):
        def integrand(q, dk=dk):
            q = torch.tensor(q, dtype=f64)
            geo = dist.Geometric(probs=1 - q).log_prob(torch.tensor(dk - 1.0, dtype=f64))
            return float((beta.log_prob(q) + geo).exp())
        want, _ = integrate.quad(integrand, 0, 1, epsabs=1e-13, epsrel=1e-11, limit=200)
        assert float(got[k]) == pytest.approx(want, rel=1e-7, abs=1e-12)
    # the tail: P(φ > W) = 1 − Σ_{d ≤ W} p(d)
    assert float(prior.log_tail(12).exp()[0]) == pytest.approx(1 - float(got.sum()), abs=1e-12)


def pyro_oracle(s, a, b):
    """Edge marginals p(φ_i = j | x) ``(*batch, H, N, N)`` for scores ``s`` ``(*batch, H, N, N)``:
    q_i enumerated over Gauss–Jacobi nodes for the Beta(a, b) weight (exact: the likelihood of
    each φ_i is a polynomial of degree < N in q), φ_i over its past, enumerated."""
    *batch, H, N, _ = s.shape
    a, b = (torch.as_tensor(v, dtype=f64).reshape(-1) for v in (a, b))
    nodes, logw = [], []
    for h in range(H):  # per head: its own Beta weight
        ah, bh = float(a[h % len(a)]), float(b[h % len(b)])
        x, w = special.roots_jacobi(N + 1, bh - 1, ah - 1)  # weight (1 − x)^(b−1)(1 + x)^(a−1)
        nodes.append(torch.tensor((1 + x) / 2))
        logw.append(torch.log(torch.tensor(w / w.sum())))
    q_nodes, q_logw = torch.stack(nodes), torch.stack(logw)  # (H, K)
    dist_ij = torch.arange(N)[:, None] - torch.arange(N)[None, :]  # (N, N): i − j
    past = dist_ij >= 1

    def model():
        with contextlib.ExitStack() as plates:  # size-1 dims stay unplated (Pyro's rule)
            for name, size, dim in (("children", N - 1, -1), ("heads", H, -2),
                                    ("batch", int(np.prod(batch)) if batch else 1, -3)):
                if size > 1:
                    plates.enter_context(pyro.plate(name, size, dim=dim))
            k = pyro.sample("q", dist.Categorical(logits=q_logw[:, None, :].expand(
                H, N - 1, -1)), infer={"enumerate": "parallel"})  # (…, H, N−1)
            q = q_nodes[torch.arange(H)[:, None], k]  # (…, H, N−1)
            # φ_i | q: geometric over d = i − j ≥ 1, on the past (children 1..N−1)
            geo = dist.Geometric(probs=1 - q[..., None]).log_prob(
                (dist_ij[1:] - 1).clamp(min=0).to(f64))  # (…, H, N−1, N)
            logits = torch.where(past[1:], geo, torch.tensor(-math.inf, dtype=f64))
            # the mass the geometric puts beyond the start (φ_i > i) has no parent
            pyro.factor("past", torch.logsumexp(logits, -1))
            phi = pyro.sample("phi", dist.Categorical(logits=logits),
                              infer={"enumerate": "parallel"})
            flat = s.reshape(-1, H, N, N)[:, :, 1:, :]  # (B, H, N−1, N)
            pyro.factor("psi", Vindex(flat)[..., phi])

    marg = TraceEnum_ELBO(max_plate_nesting=3).compute_marginals(model, lambda: None)
    probs = marg["phi"].probs.detach() if hasattr(marg["phi"], "probs") else marg["phi"].logits.softmax(-1)
    probs = probs.expand(int(np.prod(batch)) if batch else 1, H, N - 1, N)
    out = torch.zeros(*batch, H, N, N, dtype=f64)
    out[..., 1:, :] = probs.reshape(*batch, H, N - 1, N)
    return out


@settings(max_examples=8, deadline=None, derandomize=True)
@given(n=st.integers(2, 7), heads=st.sampled_from([1, 2]), batch=st.integers(1, 2),
       a=st.floats(0.3, 4.0), b=st.floats(0.3, 4.0), scale=st.floats(0.2, 2.0))
def test_exact_posterior_equals_pyro_with_q_enumerated(n, heads, batch, a, b, scale):
    g = torch.Generator().manual_seed(n * 7 + heads)
    d = 2 * heads
    x = torch.randn(batch, n, d, generator=g, dtype=f64) * scale
    W = torch.randn(d, d, generator=g, dtype=f64)
    prior = sa.priors.BetaGeometric(torch.tensor([a, b][:heads], dtype=f64),
                                    torch.tensor([b, a][:heads], dtype=f64))
    y, post = sa.compile(program)(x, W, prior, heads, return_posterior=True)
    want = pyro_oracle(scores_of(x, W, heads), prior.a, prior.b)
    torch.testing.assert_close(post, want, atol=1e-6, rtol=0)
    v = x.unflatten(-1, (heads, -1)).transpose(-2, -3)
    torch.testing.assert_close(y, want @ v, atol=1e-6, rtol=0)
    assert float(y[..., 0, :].abs().max()) == 0.0  # token 0 has no past: zero output


def test_prior_tail_cut_is_the_renormalised_window_and_reports_the_discarded_mass():
    torch.manual_seed(1)
    x, W = torch.randn(2, 40, 4, dtype=f64), torch.randn(4, 4, dtype=f64)
    full = sa.priors.BetaGeometric(2.0, 3.0)
    cut = sa.priors.BetaGeometric(2.0, 3.0, prior_tol=0.02, block_size=8)
    w = cut.window(40)
    assert 1 <= w < 39
    tail = 1 - full.log_pmf(torch.arange(1, w + 1))[0].exp().sum()
    assert float(cut.discarded_mass(40)[0]) == pytest.approx(float(tail), rel=1e-9)
    assert float(tail) < 0.02 <= 1 - float(full.log_pmf(torch.arange(1, w))[0].exp().sum())
    _, p_full = sa.compile(program)(x, W, full, return_posterior=True)
    y_cut, p_cut = sa.compile(program)(x, W, cut, return_posterior=True)
    i, j = torch.arange(40)[:, None], torch.arange(40)[None, :]
    inside = (i - j >= 1) & (i - j <= w)
    want = torch.where(inside, p_full, 0.0)
    want = want / want.sum(-1, keepdim=True).clamp(min=1e-300)
    torch.testing.assert_close(p_cut, want, atol=1e-12, rtol=0)
    # the fused banded path equals the dense reading
    torch.testing.assert_close(sa.compile(program)(x, W, cut), y_cut, atol=1e-12, rtol=0)


@pytest.mark.parametrize("kwargs,match", [
    (dict(a=0.0), "a must be finite and > 0"), (dict(b=-1.0), "b must be finite and > 0"),
    (dict(a=torch.tensor([1.0, -0.5])), "a must be finite and > 0"),
    (dict(b=float("nan")), "b must be finite"),
    (dict(tol=0.0), r"tol .* must be in \(0, 1\)"), (dict(tol=1.0), r"must be in \(0, 1\)"),
    (dict(prior_tol=-0.1), r"prior_tol .* must be in \(0, 1\)"),
    (dict(tol=0.1, prior_tol=0.1), "give tol .* or prior_tol .*, not both"),
    (dict(max_window=0), "max_window must be an int ≥ 1"),
    (dict(block_size=0), "block_size must be an int ≥ 1"),
])
def test_bad_prior_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sa.priors.BetaGeometric(**kwargs)


@pytest.mark.parametrize("kwargs,match", [
    # the mean-field options are the family's inference scheme's (MeanFieldWindows), not the
    # prior's: a TypeError names the first one and where it lives now (structattn.checking.renamed)
    (dict(inference="mean_field"), r"inference= is no longer an argument; use "
                                   r"sa\.edges\(\.\.\., inference=sa\.MeanFieldWindows"),
    (dict(window_rule="edge", grad="last"),
     r"window_rule= is no longer an argument; use "
     r"sa\.edges\(\.\.\., inference=sa\.MeanFieldWindows\(window_rule="),
])
def test_mean_field_options_are_not_the_priors(kwargs, match):
    with pytest.raises(TypeError, match=match):
        sa.priors.BetaGeometric(**kwargs)


def test_unknown_prior_argument_is_a_type_error():
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'windw'"):
        sa.priors.BetaGeometric(windw=3)


@pytest.mark.parametrize("kwargs,match", [
    (dict(tol=0.0), r"MeanFieldWindows: tol .* must be in \(0, 1\); got 0.0"),
    (dict(tol=1.0), r"tol .* must be in \(0, 1\); got 1.0"),
    (dict(max_window=0), "MeanFieldWindows: max_window must be an int ≥ 1; got 0"),
    (dict(max_iters=0), "MeanFieldWindows: max_iters must be an int ≥ 1; got 0"),
    (dict(converge_tol=0.0), "MeanFieldWindows: converge_tol must be a finite number > 0"),
    (dict(expectation="mode"), r"MeanFieldWindows: expectation must be one of \('digamma', "
                               r"'plug_in'\); got 'mode'"),
    (dict(update="sum"), r"MeanFieldWindows: update must be one of \('conjugate', "
                         r"'accumulate'\); got 'sum'"),
    (dict(window_rule="tail"), r"MeanFieldWindows: window_rule must be a "
                               r"structattn.windows.WindowRule or one of \('certified', "
                               r"'predictive', 'edge', 'evidence'\); got 'tail'"),
    (dict(initial_window=0), "MeanFieldWindows: initial_window must be an int ≥ 1; got 0"),
    (dict(grad="implicit"), r"MeanFieldWindows: grad must be one of \('unroll', 'last'\); "
                            r"got 'implicit'"),
])
def test_bad_mean_field_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sa.MeanFieldWindows(**kwargs)


def test_mean_field_windows_read_only_a_beta_geometric_prior():
    def prog(x):
        t = sa.nodes("x", x)
        phi = sa.edges("attn", t, t, sa.priors.Uniform(causal=True),
                       inference=sa.MeanFieldWindows())
        sa.potential(phi, sa.potentials.DotProduct())
        return sa.value(phi, sa.values.Identity())

    with pytest.raises(ValueError, match=r"edge family 'attn': MeanFieldWindows infers the "
                                         r"geometric–Beta prior's per-child windows; the family's "
                                         r"prior is Uniform"):
        sa.compile(prog)(torch.randn(1, 5, 3))
    with pytest.raises(ValueError, match=r"edge family 'attn': inference must be a structattn "
                                         r"inference scheme .* got str"):
        t = sa.nodes("x", torch.randn(1, 5, 3))
        sa.edges("attn", t, t, sa.priors.BetaGeometric(), inference="mean_field")
