"""Bad arguments to SVI, MCMC and predictive draws are refused, naming the argument."""

import math

import pytest
import torch

import structattn as sa

from .helpers import conjugate_toy

f64 = torch.float64


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
