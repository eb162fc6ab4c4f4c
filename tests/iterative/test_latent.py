"""Latent node sets (structattn/latent.py): bad options refused, a latent in no family refused."""

import pytest
import torch

import structattn as sa


@pytest.mark.parametrize("build,match", [
    (lambda: sa.models.hopfield(4, iteration=sa.IterationOptions(steps=-1)), "steps"),
    (lambda: sa.models.hopfield(4, beta=0.0), "beta"),
    (lambda: sa.models.hopfield(4, beta=-1.0), "beta"),
    (lambda: sa.models.hopfield(4, iteration=sa.IterationOptions(steps=3, tol=0.0)), "tol"),
    (lambda: sa.models.hopfield(4, iteration=sa.IterationOptions(steps=3, tol=-1e-3)), "tol"),
    (lambda: sa.models.slot_attention(0, 8), "num_slots"),
    (lambda: sa.models.slot_attention(3, 8, recipe="nope"), "recipe"),
    (lambda: sa.models.slot_attention(3, 8, iters=-2),
     r"SlotAttention: iters must be an int ≥ 0; got -2"),
    (lambda: sa.latent("z", torch.randn(2, 3), scale=0.0), "scale"),
    (lambda: sa.latent("z", torch.randn(2, 3), damping=1.0), "damping"),
    (lambda: sa.latent("z", torch.randn(2, 3), update="newton"), "update"),
    (lambda: sa.latent("z", torch.randn(2, 3), grad="sometimes"), "grad"),
    (lambda: sa.latent("z", torch.randn(3)), "at least 2 dims"),
])
def test_bad_options_are_refused(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_a_latent_in_no_family_is_refused():
    def program(x, z):
        lat = sa.latent("z", z)
        return sa.infer(lat)

    with pytest.raises(ValueError, match="in no edge family"):
        sa.compile(program)(torch.randn(1, 3, 2), torch.randn(1, 2, 2))
