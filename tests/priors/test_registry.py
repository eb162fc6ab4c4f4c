"""Every registered prior (``structattn.priors.REGISTRY``: one ``ENTRY`` per prior file) under
the same checks (``prior_checks``): Pyro's reading equals the compiled tables and the entry's
numpy formula, bad parameters are refused by name, gradients reach the parameters, and a
certified distance prior's bound holds against Pyro's whole past. A public prior without an
entry fails here; a throw-away prior — a power law over the distance, one short class and
one entry — is held to the same checks."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import structattn as sa

from .prior_checks import (
    check_bad,
    check_certificate,
    check_formula,
    check_gradients,
    check_tables,
)

ENTRIES = sa.priors.REGISTRY


def test_every_public_prior_has_an_entry():
    """A prior class exported by ``structattn.priors`` without a registry entry fails here."""
    public = {name for name in dir(sa.priors)
              if isinstance(getattr(sa.priors, name), type)
              and issubclass(getattr(sa.priors, name), sa.priors.Prior)
              and getattr(sa.priors, name) not in (sa.priors.Prior, sa.priors.DistancePrior)}
    assert public == set(ENTRIES), sorted(public ^ set(ENTRIES))
    assert all(e.prior is getattr(sa.priors, name) for name, e in ENTRIES.items())


def test_every_distance_prior_takes_the_generic_tables_and_is_certified():
    """The priors over the distance — ALiBi, the beta-geometric, FoX's gate (not stationary),
    the generalised Gaussian — are ``DistancePrior``s with no tables of their own, and each
    entry states a certified instance and its parameters, so the generic tests below hold
    their certificates and gradients."""
    distance = {n for n, e in ENTRIES.items() if issubclass(e.prior, sa.priors.DistancePrior)}
    assert distance == {"ALiBi", "BetaGeometric", "ForgettingGate", "GeneralisedGaussian"}
    for name in distance:
        entry = ENTRIES[name]
        assert entry.prior.tables is sa.priors.DistancePrior.tables, name
        assert entry.certified is not None and entry.parameters is not None, name


@pytest.mark.parametrize("C, P", [(1, 1), (5, 5), (3, 7), (7, 3)])
@pytest.mark.parametrize("dtype", [None, torch.float32])
def test_a_stationary_distance_prior_lays_its_distances_along_the_diagonals(C, P, dtype):
    """``DistancePrior.log_table`` evaluates the prior at the C + P − 1 distances once and lays
    them along the grid's diagonals: bit for bit ``log_weight`` on the grid (the base
    ``Prior.log_table``), for the first C of P tokens and for the last C (the beta-geometric's
    children), −∞ included."""
    g = torch.Generator().manual_seed(10 * C + P)
    seen = 0
    for entry in ENTRIES.values():
        for prior in entry.cases(C, P, g):
            if not (isinstance(prior, sa.priors.DistancePrior) and prior.stationary):
                continue
            asked = []
            read = prior.log_at_distance

            def spy(d, dtype=None, read=read, asked=asked):
                asked.append(tuple(d.shape))
                return read(d, dtype)
            want = sa.priors.Prior.log_table(prior, C, P, "cpu", dtype)  # log_weight per pair
            prior.log_at_distance = spy
            got = prior.log_table(C, P, "cpu", dtype)
            assert asked == [(C + P - 1,)], (prior.describe(), asked)
            assert got.dtype == want.dtype and got.shape[-2:] == (C, P), prior.describe()
            assert torch.equal(*torch.broadcast_tensors(got, want)), prior.describe()
            seen += 1
    assert seen >= (3 if C <= P else 1)  # ALiBi, the beta-geometric, the Gaussian (C ≤ P)


@pytest.mark.parametrize("C, P", [(1, 1), (5, 5), (3, 7), (7, 3)])
def test_a_table_over_the_offsets_is_the_log_weight_at_every_pair(C, P):
    """Every registered prior that states ``log_at_offsets`` (a function of i − j alone): its
    table at d − lowest is bit for bit ``log_weight`` at every pair (i, j) of the grid the
    support reads (j ≤ i, or every parent), −∞ included; a prior that is not stationary, or
    whose children are not the first C tokens, states none."""
    g = torch.Generator().manual_seed(10 * C + P)
    seen = set()
    for name, entry in ENTRIES.items():
        for prior in entry.cases(C, P, g):
            for causal in (True, False):
                got = prior.log_at_offsets(C, P, "cpu", causal)
                if got is None:
                    assert not (isinstance(prior, sa.priors.DistancePrior) and prior.stationary
                                and prior.child_offset(C, P) == 0), prior.describe()
                    continue
                table, lowest = got
                assert lowest == (0 if causal else 1 - P) and table.dim() == 2
                assert table.shape[-1] == C - lowest, prior.describe()
                i, j = sa.kinds.base.grid(C, P, "cpu")
                want = prior.log_weight(i, j, (C, P))  # (H|1, C, P)
                d = (i - j).expand(C, P)
                read = d >= lowest  # j ≤ i, or every parent
                looked = table[:, (d - lowest).clamp(0, table.shape[-1] - 1)]  # (H|1, C, P)
                want, looked = torch.broadcast_tensors(want, looked)
                assert torch.equal(looked[..., read], want[..., read]), prior.describe()
                seen.add(name)
    assert {"ALiBi", "RelativePosition"} | ({"GeneralisedGaussian"} if C <= P else set()) <= seen


@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_bad_parameters_are_refused_by_name(name):
    check_bad(ENTRIES[name])


@settings(max_examples=25, deadline=None)
@given(C=st.integers(1, 6), extra=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_every_prior_reads_the_same_in_pyro_compiled_and_numpy(C, extra, seed):
    g = torch.Generator().manual_seed(seed)
    P = C + extra
    for entry in ENTRIES.values():
        for prior in entry.cases(C, P, g):
            check_tables(prior, C, P, g)
            if entry.formula is not None:
                check_formula(entry, prior, C, P, g)


@pytest.mark.parametrize("name", sorted(n for n, e in ENTRIES.items() if e.parameters))
def test_gradients_reach_the_priors_parameters(name):
    check_gradients(ENTRIES[name], torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", sorted(n for n, e in ENTRIES.items() if e.certified))
def test_a_certified_prior_is_within_its_bound_of_the_whole_past(name):
    check_certificate(ENTRIES[name].certified(torch.Generator().manual_seed(2)),
                      torch.Generator().manual_seed(3))


# -- a user's prior: one class, one entry ----------------------------------------------------
class PowerLaw(sa.priors.DistancePrior):
    """p(φ_i = j) ∝ (i − j)^−α over the strict past, a learnable α per head."""

    first = 1

    def __init__(self, alpha, *, tol=None, block_size=64):
        self.alpha = torch.as_tensor(alpha, dtype=torch.float64).reshape(-1)
        if not bool((self.alpha > 0).all()):
            raise ValueError(f"PowerLaw prior: alpha must be > 0; got {self.alpha.tolist()}")
        super().__init__("PowerLaw prior", causal=True, tol=tol, block_size=block_size)

    def log_at_distance(self, d, dtype=None):
        alpha = self.alpha.to(dtype or self.alpha.dtype).reshape(-1, *([1] * d.dim()))
        safe = d.clamp(min=1).to(alpha.dtype)
        return torch.where(d >= 1, -alpha * safe.log(), float("-inf"))  # (H, *d)


def _power_law_formula(prior, C, P):
    import numpy as np

    d = (P - C + np.arange(C))[:, None] - np.arange(P)[None, :]
    with np.errstate(divide="ignore"):
        w = -prior.alpha.detach().numpy()[:, None, None] * np.log(np.maximum(d, 1))
    return np.where(d >= 1, w, -np.inf)


POWER_LAW = sa.priors.PriorEntry(
    PowerLaw, lambda C, P, g: [PowerLaw(torch.tensor([0.5, 2.0]))] if C == P else [],
    _power_law_formula,
    bad={"alpha must be > 0": lambda: PowerLaw(-1.0),
         "needs the causal support|must be None or in": lambda: PowerLaw(1.0, tol=3.0)},
    parameters=lambda g: ((torch.tensor([0.7, 1.5], dtype=torch.float64),),
                          lambda a: PowerLaw(a)),
    certified=lambda g: PowerLaw(torch.tensor([4.0, 6.0]), tol=1e-2, block_size=8))


def test_a_power_law_prior_is_one_class_and_one_entry():
    """Adding a prior over the distance takes ``log_at_distance`` and an entry: no tables of
    its own; the generic checks then cover it — Pyro = compiled = numpy, bad α refused,
    gradients in α, and its certificate sound (and reading less than the whole past)."""
    assert PowerLaw.tables is sa.priors.DistancePrior.tables
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 7):
        for prior in POWER_LAW.cases(n, n, g):
            check_tables(prior, n, n, g)
            check_formula(POWER_LAW, prior, n, n, g)
    check_bad(POWER_LAW)
    check_gradients(POWER_LAW, g)
    cut = check_certificate(POWER_LAW.certified(g), g, n=64, spread=0.5)
    assert cut.width < 31 and cut.skipped > 0.5, cut
