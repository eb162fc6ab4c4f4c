"""Support kinds against Pyro: a kind written as a user would works in every reading; every
prior's two readings (Pyro's pointwise statement, the compiled tables) agree; a wrong
factorisation of a potential shows in ``compare``."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import structattn as sa

from ..registry import CASES, EXACT

F64 = torch.float64


class Band(sa.kinds.Support):
    """|i − j| ≤ width: only its definition; the dense operator lowers it."""

    def __init__(self, width):
        self.width = width

    def contains(self, child, parent):
        return (child - parent).abs() <= self.width


class FastBand(Band):
    """The same set with an operator of its own for ``attend`` (one masked SDPA call)."""


class FastBandOperator(sa.kinds.Operator):
    def attend(self, u):
        mask, _ = self.family.tables.sdpa_inputs(u.dtype)  # the band and the log prior
        a, b, scale = self.fused_factors()
        return torch.nn.functional.scaled_dot_product_attention(a, b, u, attn_mask=mask, scale=scale)


FastBand.operator = FastBandOperator


class BandPrior(sa.priors.Prior):
    def __init__(self, width, kind=Band, logits=None):
        self.width, self.kind, self.logits = width, kind, logits

    def support(self, num_children, num_parents):
        return self.kind(self.width)

    def log_weight(self, child, parent, sizes):
        return None if self.logits is None else self.logits[(child - parent).abs()]


def _weights(g, heads=2, d=4, k=3):
    return [torch.randn(heads * k, d, generator=g, dtype=F64) for _ in range(3)]


@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 7), width=st.integers(0, 3), fast=st.booleans(), weighted=st.booleans(),
       seed=st.integers(0, 2**16))
def test_a_band_kind_written_as_a_user_would_matches_pyro(n, width, fast, weighted, seed):
    g = torch.Generator().manual_seed(seed)
    W = _weights(g)
    logits = torch.randn(8, generator=g, dtype=F64) if weighted else None
    prior = BandPrior(width, FastBand if fast else Band, logits)

    def program(x):
        t = sa.nodes("x", x)
        phi = sa.edges("band", t, t, prior, heads=2)
        sa.potential(phi, sa.potentials.Bilinear(W[0], W[1], heads=2))
        return sa.merge_heads(sa.value(phi, sa.values.Linear(W[2], heads=2)))

    x = torch.randn(2, n, 4, generator=g, dtype=F64)
    report = sa.inference.compare(program, x, atol=1e-10)
    assert report.passed and report.max_abs_diff < 1e-10, str(report)
    _, post = sa.compile(program)(x, return_posterior=True)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    assert bool((post[..., (i - j).abs() > width] == 0).all())


@pytest.mark.parametrize("fast", [False, True])
def test_a_band_kind_with_a_latent_node_set_matches_pyro(fast):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 4, generator=g, dtype=F64)
    z0 = torch.randn(2, 5, 4, generator=g, dtype=F64)
    prior = BandPrior(1, FastBand if fast else Band)

    def program(x, z):
        obs = sa.nodes("x", x)
        lat = sa.latent("z", z, scale=1.0, steps=4)
        phi = sa.edges("band", lat, obs, prior)
        sa.potential(phi, sa.potentials.DotProduct(temperature=2.0))
        z = sa.infer(lat)
        return sa.value(phi, sa.values.Identity()) + z[..., None, :, :]

    layer = sa.compile(program)
    _, post, trace = layer(x, z0, return_posterior=True, return_trace=True)
    assert bool((post[..., 0, 3:] == 0).all())  # child 0 reads only parents 0 and 1
    final = {"z": trace.states["z"][-1]}
    truth = sa.inference.exact(program, x, z0, latents=final)
    torch.testing.assert_close(post, truth.marginals["band"], atol=1e-10, rtol=0)
    report = sa.inference.compare(program, x, z0, atol=1e-10, fixed_point=False)
    assert report.max_abs_diff < 1e-10, str(report)


# -- every prior: the Pyro reading = the compiled tables: tests/priors/test_registry.py, over
# every registered prior (structattn.priors.REGISTRY)


# -- a planted bug in a factorisation must fail compare -------------------------------------
def _uses(potential_type):
    names = []
    for name in EXACT:
        case = CASES[name]
        m, inputs = case()
        fams = sa.trace_structure(m, *inputs).families.values()
        if any(isinstance(p, potential_type) or isinstance(getattr(p, "base", None), potential_type)
               for f in fams for p in f.potentials):
            names.append(name)
    return names


@pytest.mark.parametrize("potential", [sa.potentials.Bilinear, sa.potentials.DotProduct,
                                       sa.potentials.SquaredDistance])
def test_a_wrong_factorisation_fails_compare_on_every_model_using_it(monkeypatch, potential):
    users = [n for n in _uses(potential) if n != "predictive_coding"]
    if potential is not sa.potentials.SquaredDistance:
        assert users, f"no catalogue model uses {potential.__name__}"
    for name in users:
        m, inputs = CASES[name]()
        assert sa.inference.compare(m, *inputs, fixed_point=False).passed, name
    right = potential.child_factor
    monkeypatch.setattr(potential, "child_factor", lambda self, x: right(self, x) * 1.01)
    for name in users:
        m, inputs = CASES[name]()
        assert not sa.inference.compare(m, *inputs, fixed_point=False).passed, name
