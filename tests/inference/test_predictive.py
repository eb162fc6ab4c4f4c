"""Prior predictive draws: edge frequencies follow the prior (chi-square, level 1e-3)."""

import torch

import structattn as sa

from .helpers import chi_square_ok

f64 = torch.float64


def test_prior_predictive_edge_frequencies_match_the_prior():
    logits = torch.randn(3, 5, dtype=f64)

    def program(x):
        n = sa.nodes("x", x)
        q = sa.nodes("q", x[..., :3, :])
        phi = sa.edges("read", q, n, sa.priors.Categorical(logits))
        sa.potential(phi, sa.potentials.DotProduct())
        return sa.value(phi, sa.values.Identity())

    x = torch.randn(1, 5, 2, dtype=f64)
    draws = sa.inference.predictive(program, x, num_samples=800, seed=3)
    counts = torch.nn.functional.one_hot(draws.edges["read"].reshape(-1, 3), 5).sum(0).double()
    assert chi_square_ok(counts, torch.softmax(logits, -1))
    idata = draws.to_arviz(group="prior")
    assert "prior" in idata.groups() and "read" in idata.prior
