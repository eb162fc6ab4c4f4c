"""Support kinds against Pyro: a kind written as a user would works in every reading; every
prior's two readings (Pyro's pointwise statement, the compiled tables) agree; a wrong
factorisation of a potential shows in ``compare``."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import structattn as sa
from structattn.priors.declared import declared_log_prior

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


# -- every prior: the Pyro reading (pointwise statement) = the compiled tables ---------------
def _priors(C, P, g):
    logits = torch.randn(2, C, P, generator=g, dtype=F64)
    mask = torch.rand(C, P, generator=g) < 0.6
    ring = torch.arange(min(C, P))
    edge_index = torch.stack([ring, ring.flip(0)])
    out = [sa.priors.Uniform(), sa.priors.Uniform(support=mask, empty="zero"),
           sa.priors.Uniform(edge_index=edge_index, empty="zero"),
           sa.priors.Uniform(edge_index=edge_index, causal=True, empty="zero"),
           sa.priors.Categorical(logits.masked_fill(~mask, float("-inf")), empty="zero"),
           sa.priors.Categorical(torch.randn(1, P, generator=g, dtype=F64)),
           sa.priors.RelativePosition(torch.randn(2, 5, generator=g, dtype=F64)),
           sa.priors.ALiBi(2)]
    if C <= P:
        out += [sa.priors.Uniform(causal=True), sa.priors.Categorical(logits, causal=True),
                sa.priors.BetaGeometric(1.5, torch.tensor([1.0, 3.0], dtype=F64)),
                sa.priors.BetaGeometric(2.0, 2.0, prior_tol=0.3), sa.priors.BetaGeometric(max_window=2),
                sa.priors.ALiBi(2, causal=True),
                sa.priors.ForgettingGate(-torch.rand(2, P, generator=g, dtype=F64)),
                sa.priors.GeneralisedGaussian(torch.tensor([0.5, 2.0], dtype=F64),
                                              torch.tensor([0.0, -1.0], dtype=F64),
                                              torch.tensor([1.0, 2.0], dtype=F64))]
    return out


#: the public priors whose log prior is not a table of their own: stick-breaking's reads its
#: potential (tests/models/test_stick_breaking_attention.py checks it against Pyro)
NOT_A_TABLE = {"StickBreaking"}


def test_every_public_prior_is_read_the_same_in_pyro_and_compiled():
    """The list above covers every prior ``structattn.priors`` exports: a new prior fails
    here until it is added (or named in ``NOT_A_TABLE`` with the test that covers it)."""
    public = {name for name in dir(sa.priors)
              if isinstance(getattr(sa.priors, name), type)
              and issubclass(getattr(sa.priors, name), sa.priors.Prior)
              and getattr(sa.priors, name) is not sa.priors.Prior}
    g = torch.Generator().manual_seed(0)
    listed = {type(p).__name__ for p in _priors(3, 5, g)}
    assert public - NOT_A_TABLE <= listed, sorted(public - NOT_A_TABLE - listed)


@settings(max_examples=25, deadline=None)
@given(C=st.integers(1, 6), extra=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_every_prior_reads_the_same_in_pyro_and_compiled(C, extra, seed):
    g = torch.Generator().manual_seed(seed)
    P = C + extra
    for prior in _priors(C, P, g):
        xp = torch.randn(2, P, 4, generator=g, dtype=F64)
        xc = xp[..., P - C:, :]

        def program(xc, xp, prior=prior):
            c, p = sa.nodes("c", xc), sa.nodes("p", xp)
            phi = sa.edges("f", c, p, prior, heads=2)
            sa.potential(phi, sa.potentials.DotProduct(heads=2))
            return sa.value(phi, sa.values.Identity(heads=2))

        fam = sa.trace_structure(program, xc, xp).families["f"]
        pyro_lp, has_parent = declared_log_prior(fam)  # (…, C, P) pointwise
        tables = fam.tables
        compiled = tables.log_prob_table(F64)
        mask = tables.full_mask()
        mask = torch.ones(C, P, dtype=torch.bool) if mask is None else mask
        pyro_lp, compiled, mask = torch.broadcast_tensors(pyro_lp, compiled, mask)
        support = torch.isfinite(pyro_lp)
        assert torch.equal(support, mask & has_parent[..., None].expand_as(mask)), prior.describe()
        torch.testing.assert_close(pyro_lp[support], compiled[support], atol=1e-12, rtol=0,
                                   msg=prior.describe())
        post = sa.lowering.posterior(fam)  # the operator's dense posterior: zero off the support
        post, support = torch.broadcast_tensors(post, support)
        assert bool((post[~support] == 0).all()), prior.describe()


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
