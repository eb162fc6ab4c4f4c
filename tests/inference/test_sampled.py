"""The sampled checks' statistics against a known posterior: false failures at the promised
family-wise α on nearly certain and rare edges, and a planted error still caught."""

import pyro
import pytest
import torch
from scipy import stats

import structattn as sa
from structattn.inference.sampled import binomial_z, edge_z, output_z, z_threshold

f64 = torch.float64
KEYS = torch.tensor([[[0.0], [8.0]]], dtype=f64)  # 2 parents, d = 1


def _two_parents(p):
    """One child, two parents: the compiled posterior (1 − p, p), ``(batch, H, C, P)``."""
    return torch.tensor([[[[1 - p, p]]]], dtype=f64)


def _check(q_true, q_compiled, S, gen):
    """Draw S edges from q_true; every entry's |z| against q_compiled; passed?"""
    idx = torch.multinomial(q_true.reshape(-1, 2), S, replacement=True, generator=gen)
    idx = idx.T.reshape(S, 1, 1, 1)  # (S, batch, H, C)
    outputs = KEYS[0][idx]  # (S, 1, 1, 1, 1): the value of the parent drawn
    compiled = (q_compiled.unsqueeze(-1) * KEYS[0]).sum(-2)  # E[v], (1, 1, 1, 1)
    zs = [output_z(outputs, compiled, {"a": q_compiled}, {"a": idx}), edge_z(q_compiled, idx)]
    crit = z_threshold(sum(z.numel() for z in zs), 0.01)
    return all(float(z.max()) <= crit for z in zs)


@pytest.mark.parametrize("p", [5e-4, 6.7e-3, 0.05, 0.5])
def test_false_failures_stay_at_alpha(p):
    """200 seeds of 100 draws from the compiled posterior itself: at most 2% fail (α = 0.01
    plus its binomial noise), however certain the posterior."""
    gen = torch.Generator().manual_seed(0)
    q = _two_parents(p)
    failures = sum(not _check(q, q, 100, gen) for _ in range(200))
    assert failures <= 4, f"{failures}/200 false failures at p = {p}"


@pytest.mark.parametrize("p, S", [(0.5, 4000), (0.05, 2000), (5e-4, 2000)])
def test_a_posterior_off_by_0_05_fails(p, S):
    gen = torch.Generator().manual_seed(1)
    caught = sum(not _check(_two_parents(p), _two_parents(p + 0.05), S, gen) for _ in range(20))
    assert caught >= 19, f"{caught}/20 caught at p = {p}"


def test_binomial_z_is_the_exact_two_sided_test():
    """Against scipy's exact binomial test (the same 'no more likely' two-sided p-value)."""
    for n, q, S in [(0, 5e-4, 100), (1, 4e-4, 100), (3, 0.05, 100), (61, 0.5, 100), (0, 0.0, 50),
                    (2, 0.0, 50), (50, 1.0, 50)]:
        pvalue = stats.binomtest(n, S, q).pvalue if 0 < q < 1 else float(n == (S if q else 0))
        want = float(-stats.norm.ppf(min(pvalue, 1.0) / 2)) if pvalue < 1 else 0.0
        got = float(binomial_z(torch.tensor(n), torch.tensor(q, dtype=f64), S))
        assert got == pytest.approx(want, abs=1e-6), (n, q, S)
    # the rare edge: one hit of an edge of probability 4e-4 in 100 draws (normal
    # approximation: z = 4.79) is what one in 26 runs sees
    assert float(binomial_z(torch.tensor(1), torch.tensor(4e-4, dtype=f64), 100)) < 2.1


def test_an_output_no_draw_explains_fails():
    """Every draw the same, the compiled output elsewhere, and the compiled posterior certain
    of that parent: nothing unseen can explain the difference."""
    q = _two_parents(0.0)
    idx = torch.zeros(100, 1, 1, 1, dtype=torch.long)
    z = output_z(torch.zeros(100, 1, 1, 1, 1, dtype=f64), torch.full((1, 1, 1, 1), 0.1, dtype=f64),
                 {"a": q}, {"a": idx})
    assert float(z.max()) > 5


def _family(q, k):
    a, b = sa.nodes("q", q), sa.nodes("k", k)
    phi = sa.edges("attn", a, b, sa.priors.Uniform())
    sa.potential(phi, sa.potentials.DotProduct(temperature=1.0))
    return sa.value(phi, sa.values.Identity())


@pytest.mark.parametrize("gap", [8.0, 0.0])
def test_compare_with_samples_passes_a_nearly_certain_posterior(gap):
    """The issue's model: posterior (3.4e-4, 0.9997) (and (½, ½)); per-entry statistics."""
    q = torch.ones(1, 1, 1, dtype=f64)
    k = torch.tensor([[[0.0], [gap]]], dtype=f64)
    for seed in range(3):
        pyro.set_rng_seed(seed)
        report = sa.inference.compare(_family, q, k, samples=100, progress=False)
        assert report.passed, str(report)
        assert set(report.sampled_z) == {"E[output] by samples", "edge frequencies[attn]"}
        assert report.sampled_z["edge frequencies[attn]"].shape == (1, 1, 1, 2)


def test_long_sampled_checks_show_progress(capsys):
    """From PROGRESS_DRAWS draws on a tqdm bar counts the draws; below it, or with
    progress=False, nothing is printed."""
    from structattn.inference.compare import PROGRESS_DRAWS

    q, k = torch.ones(1, 1, 1, dtype=f64), torch.tensor([[[0.0], [1.0]]], dtype=f64)
    sa.inference.compare(_family, q, k, samples=PROGRESS_DRAWS)
    err = capsys.readouterr().err
    assert "posterior samples" in err and f"{PROGRESS_DRAWS}/{PROGRESS_DRAWS}" in err
    sa.inference.compare(_family, q, k, samples=PROGRESS_DRAWS - 1)
    sa.inference.compare(_family, q, k, samples=PROGRESS_DRAWS, progress=False)
    assert "posterior samples" not in capsys.readouterr().err
