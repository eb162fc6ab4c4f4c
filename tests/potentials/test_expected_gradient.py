"""Each potential's closed-form expected gradient (the iterating reader's update) against
autograd on the log-partition function (Lemma 7.1)."""

import pytest
import torch

import structattn as sa
from structattn.iterative.iterate import Step
from structattn.kinds import DenseOperator as FamilyOperator

f64 = torch.float64


def _family(potential_side, potential):
    """A latent on ``potential_side`` of one family, and an observed other side."""
    z = torch.randn(2, 3, 4, dtype=f64)
    x = torch.randn(2, 5, 4, dtype=f64)

    def program(z, x):
        obs = sa.nodes("x", x)
        lat = sa.latent("z", z)
        c, p = (lat, obs) if potential_side == "children" else (obs, lat)
        phi = sa.edges("f", c, p, sa.priors.Uniform(), heads=potential.heads)
        sa.potential(phi, potential)
        return sa.infer(lat)

    return program, z, x


@pytest.mark.parametrize("side", ["children", "parents"])
@pytest.mark.parametrize("make", [
    lambda: sa.potentials.Bilinear(torch.randn(6, 4, dtype=f64), torch.randn(6, 4, dtype=f64),
                                   heads=2, temperature=1.3),
    lambda: sa.potentials.Bilinear(None, torch.randn(4, 4, dtype=f64), heads=2, temperature=0.7),
    lambda: sa.potentials.DotProduct(heads=2, temperature=0.9),
    lambda: sa.potentials.SquaredDistance(temperature=1.7),
    lambda: sa.potentials.SquaredDistance(temperature=0.6, heads=2),
    lambda: sa.potentials.Bilinear(torch.randn(6, 4, dtype=f64), torch.randn(6, 4, dtype=f64),
                                   heads=2, temperature=torch.tensor([0.4, 1.9], dtype=f64)),
    lambda: sa.potentials.DotProduct(heads=2, temperature=torch.tensor([2.2, 0.5], dtype=f64)),
    lambda: sa.potentials.SquaredDistance(temperature=torch.tensor([0.6, 1.5], dtype=f64),
                                          heads=2),
    lambda: sa.potentials.Distance(precision=1.7, power=1),
    lambda: sa.potentials.Distance(precision=0.6, power=2),
    lambda: sa.potentials.Rotary(torch.randn(8, 4, dtype=f64), torch.randn(8, 4, dtype=f64),
                                 heads=2, temperature=1.3, base=10.0),
    lambda: sa.potentials.Rotary(torch.randn(8, 4, dtype=f64), torch.randn(8, 4, dtype=f64),
                                 heads=2, temperature=0.8, base=3.0, dims=2),
], ids=["bilinear", "bilinear-identity", "dot", "squared-distance", "squared-distance-heads",
        "bilinear-tau-per-head", "dot-tau-per-head", "squared-distance-tau-per-head",
        "euclidean-distance", "distance-squared", "rotary", "rotary-partial"])
def test_closed_form_expected_gradient_is_the_log_partition_gradient(side, make):
    """Lemma 7.1: Σ_i ∇ log Σ_j exp ψ_ij = E_post[∇ψ] — the closed form against autograd."""
    psi = make()
    if isinstance(psi, sa.potentials.Bilinear) and psi.W_q is None and side == "parents":
        psi = sa.potentials.Bilinear(torch.randn(4, 4, dtype=f64), None, heads=2)
    program, z, x = _family(side, psi)
    reader = sa.readers.Marginalise(latent_values={"z": z.clone().requires_grad_()})
    with reader:
        program(z, x)
    fam, lat = reader.families["f"], reader.latents["z"]
    step = Step(sa.iterative.iterate.Engine([lat], dict(reader.families), {}), lat)
    closed = psi.expected_gradient(side, step.operator("f"))
    (auto,) = torch.autograd.grad(FamilyOperator(fam).log_partition().sum(), lat.states)
    assert closed is not None and (closed - auto).abs().max() < 1e-12


@pytest.mark.parametrize("side", ["children", "parents"])
def test_squared_distance_curvature_per_head(side):
    """E[−∂²ψ/∂x²] with τ per head: on head h's features, the curvature at the scalar τ_h
    (1/τ_h for a child, m_j/τ_h for a parent) — the EM step's denominator per head."""
    tau = torch.tensor([0.6, 1.5], dtype=f64)
    program, z, x = _family(side, sa.potentials.SquaredDistance(temperature=tau, heads=2))

    def curvature(t):
        psi = sa.potentials.SquaredDistance(temperature=t, heads=2)
        prog, _, _ = _family(side, psi)
        reader = sa.readers.Marginalise(latent_values={"z": z})
        with reader:
            prog(z, x)
        lat = reader.latents["z"]
        step = Step(sa.iterative.iterate.Engine([lat], dict(reader.families), {}), lat)
        c = psi.expected_curvature(side, step.operator("f"))
        return torch.as_tensor(c, dtype=f64).expand(*z.shape[:-1], z.shape[-1])

    per_head = curvature(tau)
    for h in range(2):
        ref = curvature(float(tau[h]))
        torch.testing.assert_close(per_head[..., 2 * h:2 * h + 2], ref[..., 2 * h:2 * h + 2],
                                   atol=1e-12, rtol=0)
    assert not torch.allclose(per_head[..., :2], per_head[..., 2:])
