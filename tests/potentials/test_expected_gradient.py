"""Each potential's closed-form expected gradient (the iterating reader's update) against
autograd on the log-partition function (Lemma 7.1)."""

import pytest
import torch

import structattn as sa
from structattn.iterate import Step
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
], ids=["bilinear", "bilinear-identity", "dot", "squared-distance", "squared-distance-heads"])
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
    step = Step(sa.iterate.Engine([lat], dict(reader.families), {}), lat)
    closed = psi.expected_gradient(side, step.operator("f"))
    (auto,) = torch.autograd.grad(FamilyOperator(fam).log_partition().sum(), lat.states)
    assert closed is not None and (closed - auto).abs().max() < 1e-12
