"""The exponential-family view: measures, their log-normalisers, dynamics, InfoNCE, GPB2.

Oracles: autograd (∇G, ∇²G), Monte Carlo (seeded, 5 standard errors), the Hopfield
model's free energy, torch's cross-entropy, brute-force moment matching.
"""

import math

import pytest
import torch

import structattn as sa
from structattn.measures import Empirical, Gaussian, GaussianMixture

f64 = torch.float64


def random_pd(*shape, d, generator=None):
    A = torch.randn(*shape, d, d, dtype=f64, generator=generator)
    return A @ A.transpose(-1, -2) / d + 0.5 * torch.eye(d, dtype=f64)


def measures():
    g = torch.Generator().manual_seed(0)
    d = 3
    pts = torch.randn(2, 7, d, dtype=f64, generator=g)
    return {
        "empirical": Empirical(pts),
        "empirical-weighted": Empirical(pts, torch.randn(2, 7, dtype=f64, generator=g)),
        "gaussian": Gaussian(torch.randn(2, d, dtype=f64, generator=g), random_pd(2, d=d, generator=g)),
        "mixture": GaussianMixture(torch.randn(2, 4, dtype=f64, generator=g),
                                   torch.randn(2, 4, d, dtype=f64, generator=g),
                                   random_pd(2, d=d, generator=g)),
    }


@pytest.mark.parametrize("name", ["empirical", "empirical-weighted", "gaussian", "mixture"])
def test_mean_and_covariance_are_the_derivatives_of_the_log_normaliser(name):
    h = measures()[name]
    eta = 0.7 * torch.randn(2, 5, 3, dtype=f64)
    e = eta.clone().requires_grad_()
    (grad,) = torch.autograd.grad(h.log_normaliser(e).sum(), e)
    assert (h.mean(eta) - grad).abs().max() < 1e-10
    for b in range(2):
        for m in range(5):
            hess = torch.autograd.functional.hessian(
                lambda v, b=b, m=m: h.log_normaliser(
                    torch.cat([eta[:, :m], v[None, None].expand(2, 1, 3), eta[:, m + 1:]], 1))[b, m],
                eta[b, m])
            cov = h.covariance(eta)[b, m]
            assert (cov - hess).abs().max() < 1e-10
            assert torch.linalg.eigvalsh(cov).min() > -1e-12  # positive semi-definite


@pytest.mark.parametrize("name", ["empirical", "empirical-weighted", "gaussian", "mixture"])
def test_sampling_the_tilted_distribution_gives_the_mean(name):
    torch.manual_seed(3)
    h = measures()[name]
    eta = 0.5 * torch.randn(2, 4, 3, dtype=f64)
    p = h.distribution(eta)
    x = p.sample((20000,))  # (S, 2, 4, 3)
    se = x.std(0) / math.sqrt(x.shape[0])
    assert ((x.mean(0) - h.mean(eta)).abs() <= 5 * se + 1e-12).all()
    assert torch.isfinite(p.log_prob(x[:5])).all()


def test_the_empirical_mean_is_softmax_attention():
    pts, eta = torch.randn(2, 6, 4, dtype=f64), torch.randn(2, 3, 4, dtype=f64)
    ref = torch.softmax(eta @ pts.transpose(-1, -2), -1) @ pts
    assert (Empirical(pts).mean(eta) - ref).abs().max() < 1e-12


def test_hopfield_energy_is_minus_the_empirical_log_normaliser():
    """F(ξ) of the Hopfield declaration = Σ_i [β/2 ‖ξ_i‖² + const − G_emp(β ξ_i)]: the same
    free energy from the edge family and from the measure; and a declaration whose energy is
    −G (``structattn.energy``, no edge family) reaches the same fixed point."""
    beta = 0.8
    m = sa.models.hopfield(4, projections=False, beta=beta, iteration=sa.IterationOptions(steps=6),
                           dtype=f64)
    r, Y = torch.randn(2, 3, 4, dtype=f64), torch.randn(2, 5, 4, dtype=f64)
    out, trace = sa.compile(m)(r, Y, return_trace=True)
    h = Empirical(Y)
    for t, xi in enumerate(trace.states["state"]):
        gauss = (0.5 * beta * (xi * xi).sum(-1) + 2 * math.log(2 * math.pi / beta)).sum(-1)
        F = gauss - h.log_normaliser(beta * xi).sum(-1)
        assert (F - trace.free_energy[t]).abs().max() < 1e-10

    def energy_model(queries, stored):
        xi = sa.latent("state", queries, scale=beta ** -0.5, update="gradient", step_size=0.2,
                       steps=4000, tol=1e-13)
        sa.nodes("stored", stored)
        sa.energy("minus G", lambda s: -Empirical(stored).log_normaliser(beta * s).sum(-1), xi)
        return sa.infer(xi)

    with sa.iteration(steps=4000, tol=1e-13):
        fixed = sa.compile(m)(r, Y, return_trace=True)[1].states["state"][-1]
    assert (sa.compile(energy_model)(r, Y) - fixed).abs().max() < 1e-8


@pytest.mark.parametrize("renorm", [None, "layernorm", "batchnorm", "sphere"])
def test_residual_dynamics_follow_their_definition(renorm):
    x = torch.randn(2, 6, 3, dtype=f64)
    path = sa.measures.residual_dynamics(x, 4, renorm=renorm, beta=0.5)
    assert path.shape == (5, 2, 6, 3)
    eta = x
    for t in range(4):
        a = torch.softmax(0.5 * eta @ eta.transpose(-1, -2), -1) @ eta
        eta = sa.measures.renormalise(eta + a, renorm)
        assert (path[t + 1] - eta).abs().max() < 1e-12
    if renorm == "sphere":
        assert torch.allclose(path[-1].norm(dim=-1), torch.full((2, 6), math.sqrt(3), dtype=f64))
    fixed = Gaussian(torch.zeros(3, dtype=f64), torch.eye(3, dtype=f64))
    cross = sa.measures.residual_dynamics(x, 2, renorm=None, measure=fixed)
    assert (cross[1] - (x + x)).abs().max() < 1e-12  # ∇G = μ + Ση = η


def test_info_nce_equals_the_usual_cross_entropy():
    q, k = torch.randn(3, 8, 5, dtype=f64), torch.randn(3, 8, 5, dtype=f64)
    ours = sa.measures.info_nce(q, k, temperature=0.3)
    logits = q @ k.transpose(-1, -2) / 0.3
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, 8), torch.arange(8).repeat(3))
    assert abs(float(ours - ref)) < 1e-12


def test_gpb2_collapse_with_attention_switches_is_attention():
    """The draft's Eq. 14: switch probabilities = the attention weights ⇒ the collapsed mean of
    each target is Σ_i A_ij H_i W_V."""
    M, d, dv = 5, 4, 3
    H = torch.randn(M, d, dtype=f64)
    Wq, Wk, Wv = (torch.randn(d, d, dtype=f64) for _ in range(2)), None, torch.randn(d, dv, dtype=f64)
    Wq, Wk = list(Wq)
    scores = (H @ Wq) @ (H @ Wk).T  # scores[j, i]: target j attends to source i
    A = torch.softmax(scores, -1)  # rows j sum to one
    covs = random_pd(M, d=d)
    m, S, w = sa.measures.gpb2_collapse(H, covs, A.T, Wv.T)
    assert (m - A @ H @ Wv).abs().max() < 1e-12
    # the covariance is the mixture's second moment (brute force)
    for j in range(M):
        mu = H @ Wv  # (M, dv)
        second = sum(A[j, i] * (Wv.T @ covs[i] @ Wv + torch.outer(mu[i], mu[i])) for i in range(M))
        assert (S[j] - (second - torch.outer(m[j], m[j]))).abs().max() < 1e-10


@pytest.mark.parametrize("build,match", [
    (lambda: Gaussian(torch.zeros(3), -torch.eye(3)), "positive definite"),
    (lambda: Gaussian(torch.zeros(3), torch.eye(2)), r"shape \(…, 3, 3\)"),
    (lambda: Gaussian(torch.zeros(2), torch.tensor([[1.0, 2.0], [0.0, 1.0]])), "symmetric"),
    (lambda: Empirical(torch.randn(4, 2), torch.tensor([0.0, float("nan"), 0.0, 0.0])), "non-finite"),
    (lambda: Empirical(torch.randn(4, 2), torch.zeros(3)), "one per point"),
    (lambda: GaussianMixture(torch.zeros(3), torch.randn(2, 2), torch.eye(2)), "one per component"),
    (lambda: Empirical(torch.randn(4, 2)).mean(torch.randn(3, 5)), r"eta must have shape"),
    (lambda: sa.measures.residual_dynamics(torch.randn(3, 2), 2, renorm="group"), "renorm"),
    (lambda: sa.measures.info_nce(torch.randn(3, 2), torch.randn(4, 2)), "same shape"),
])
def test_bad_input(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_dynamics_accept_numpy_betas_and_say_when_the_cloud_overflows():
    import numpy as np

    x = torch.randn(2, 30, 4)
    assert sa.measures.residual_dynamics(x, 2, renorm="sphere", beta=np.float32(1)).shape[0] == 3
    with pytest.raises(ValueError, match="beta"):
        sa.measures.residual_dynamics(x, 2, beta=True)
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="overflowed at step"):
        sa.measures.residual_dynamics(torch.randn(2, 50, 4), 200, renorm=None)
