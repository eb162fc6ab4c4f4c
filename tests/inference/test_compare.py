"""Comparisons with a verdict: exact and sampled checks, a non-affine program caught."""

import re

import pytest
import torch
from scipy import stats

import structattn as sa

f64 = torch.float64


def test_compare_fails_a_program_that_is_not_affine_in_its_values():
    """Exact enumeration evaluates the program at E[v]; only the sampled check sees that
    E[v²] ≠ E[v]² — on a spread posterior (temperature 4), where Var[v] is large enough for
    400 draws to see."""
    W = torch.randn(3, 3, dtype=f64)

    def squared(x):
        n = sa.nodes("x", x)
        phi = sa.edges("attn", n, n, sa.priors.Uniform())
        sa.potential(phi, sa.potentials.Bilinear(W, W, temperature=4.0))
        return sa.value(phi, sa.values.Linear(W)) ** 2

    x = 2 * torch.randn(1, 4, 3, dtype=f64)
    assert sa.inference.compare(squared, x).passed  # blind to it
    report = sa.inference.compare(squared, x, method="samples", num_samples=400)
    assert not report.passed and "FAIL" in str(report)
    assert any(c.kind == "z" and not c.passed for c in report.checks)


def test_compare_verdicts_and_plot(tmp_path):
    m = sa.models.cross_attention(4, 3, d_k=2, heads=2, dtype=f64)
    q, k = torch.randn(2, 3, 4, dtype=f64), torch.randn(2, 5, 3, dtype=f64)
    report = sa.inference.compare(m, q, k)
    assert report.passed and bool(report) and str(report).startswith("PASS (exact)")
    assert all(c.tolerance == 1e-6 for c in report.checks)
    report.plot(tmp_path / "cmp.png")
    assert (tmp_path / "cmp.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    strict = sa.inference.compare(m, q, k, atol=0.0)
    assert not strict.passed or strict.max_abs_diff == 0.0
    with pytest.raises(ValueError, match="method must be one of"):
        sa.inference.compare(m, q, k, method="vibes")
    with pytest.raises(ValueError, match="has none"):
        sa.inference.compare(m, q, k, method="mcmc")


def test_z_threshold_is_bonferroni():
    from structattn.inference.compare import z_threshold

    assert abs(z_threshold(1, 0.05) - 1.959964) < 1e-5
    assert abs(z_threshold(100, 0.01) - stats.norm.ppf(1 - 0.01 / 200)) < 1e-9


def _x(*shape):
    return torch.randn(*shape, dtype=torch.float64)


def test_compare_with_samples_accepts_affine_programs():
    m = sa.models.multihop_attention(5, d_k=3, heads=2, dtype=torch.float64)
    report = sa.inference.compare(m, _x(1, 4, 5), samples=600)
    assert report.max_abs_diff < 1e-6
    assert max(float(z.max()) for z in report.sampled_z.values()) < 5, str(report)


def test_compare_with_samples_catches_a_non_affine_program():
    """tanh after the value: the layer computes tanh(E[v]), not E[tanh(v)]."""
    W = torch.randn(2, 5, dtype=torch.float64)

    def program(x):
        n = sa.nodes("x", x)
        phi = sa.edges("a", n, n, sa.priors.Uniform())
        sa.potential(phi, sa.potentials.Bilinear(W, W))
        return torch.tanh(2 * sa.value(phi, sa.values.Linear(W)))

    report = sa.inference.compare(program, _x(1, 4, 5), samples=400)
    assert report.max_abs_diff < 1e-6  # at E[v] everything agrees …
    assert float(report.sampled_z["E[output] by samples"].max()) > 5  # … but E[output] does not


def _hopfield():
    torch.manual_seed(0)
    m = sa.models.hopfield(6, heads=2, beta=0.5,
                           iteration=sa.IterationOptions(steps=500, tol=1e-13), dtype=f64)
    return m, torch.randn(1, 3, 6, dtype=f64), torch.randn(1, 7, 6, dtype=f64)


def test_compare_notes_the_map_search_only_when_it_could_explain_a_failure():
    """A MAP search that stops above its gradient tolerance is not worth a note on a passing
    report; on a failed fixed-point check the note says which case it is and what to do."""
    m, q, Y = _hopfield()
    # one L-BFGS round of 20 iterations stops near |∇F| = 3e-6, far above gtol = 1e-10, yet the
    # states agree within map_atol = 1e-4: a passing report, no note
    assert not sa.inference.map_estimate(m, q, Y, max_iter=20).converged
    passing = sa.inference.compare(m, q, Y, fit_options={"max_iter": 20})
    assert passing.passed and "MAP search" not in str(passing)
    # out of rounds: give it more
    short = sa.inference.compare(m, q, Y, fit_options={"max_iter": 20}, map_atol=1e-9)
    assert not short.passed
    assert re.search(r"note: Pyro's MAP search stopped at max \|∇F\| = \S+, above its tolerance "
                     r"gtol = 1e-10, at its budget of 20 L-BFGS iterations: the MAP itself may "
                     r"be inexact, which could explain the failed fixed-point check\. Give it "
                     r"more, compare\(\.\.\., fit_options=\{'max_iter': 80\}\)", str(short))
    # no progress left: a gap that small is the MAP's own
    tight = sa.inference.compare(m, q, Y, map_atol=1e-14)
    assert not tight.passed
    assert re.search(r"where its loss stopped decreasing: the MAP is no more precise than that "
                     r"in this dtype, .* loosen map_atol", str(tight))
    with pytest.raises(ValueError, match=r"fit_options \['num_steps'\] are not options of the "
                                         r"MAP search .* it takes \['max_iter', 'gtol', 'init', "
                                         r"'progress'\]"):
        sa.inference.compare(m, q, Y, fit_options={"num_steps": 5})
