"""Gradient steps that diverge are not silent (structattn/iterative/divergence.py): F rising above its
start, or turning non-finite, gives a DivergenceWarning naming step_size and the step."""

import math
import re
import warnings

import pytest
import torch

import structattn as sa


def retrieve(queries, stored, beta=2.0, step_size=0.05, steps=200):
    """ξ ~ N(0, β⁻¹); φ_i ~ Uniform(stored); ψ = β ξ_iᵀ y_j; gradient steps on F."""
    y = sa.nodes("stored", stored)
    xi = sa.latent("state", queries, scale=beta ** -0.5, steps=steps, update="gradient",
                   step_size=step_size)
    phi = sa.edges("retrieve", xi, y, sa.priors.Uniform())
    sa.potential(phi, sa.potentials.DotProduct(temperature=1 / beta))
    return sa.infer(xi)


def free_energy_by_hand(xi, y, beta=2.0):
    """F(ξ) up to a constant, per batch element: Σ_i ½β‖ξ_i‖² − log (1/N) Σ_j exp(β ξ_iᵀ y_j)."""
    scores = beta * xi @ y.transpose(-1, -2)
    lse = torch.logsumexp(scores, -1) - math.log(y.shape[-2])
    return (0.5 * beta * (xi * xi).sum(-1) - lse).sum(-1)


def _inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(2, 3, 8, generator=g, dtype=torch.float64) * 3,
            torch.randn(2, 10, 8, generator=g, dtype=torch.float64) * 3)


def _first_rise(layer, q, Y, **kw):
    """The first step at which the hand-written F exceeds its start, from the trace's states."""
    with sa.validation(False):
        _, trace = layer(q, Y, return_trace=True, **kw)
    F = free_energy_by_hand(trace.states["state"], Y)  # (steps + 1, batch)
    rose = (F[1:] > F[:1]).any(-1)
    return int(rose.nonzero()[0]) + 1


@pytest.mark.parametrize("record", [False, True])
def test_a_diverging_gradient_iteration_warns_naming_step_size_and_step(record):
    layer, (q, Y) = sa.compile(retrieve), _inputs()
    step = _first_rise(layer, q, Y, step_size=2.0)
    want = (rf"latent node set 'state': update='gradient' with step_size=2.0 diverged: the free "
            rf"energy went from \S+ to \S+ over 200 steps \(batch element \(\d,\)\); it first rose "
            rf"above its start at step {step} \(F = \S+\)\. Lower step_size \(e\.g\. "
            rf"step_size=0\.5\)")
    with pytest.warns(sa.DivergenceWarning, match=want):
        out = layer(q, Y, step_size=2.0, return_trace=record)
    with sa.validation(False):  # the replay that found the step changed nothing
        again = layer(q, Y, step_size=2.0, return_trace=record)
    for a, b in zip(out if record else (out,), again if record else (again,), strict=True):
        torch.testing.assert_close(a if isinstance(a, torch.Tensor) else a.free_energy,
                                   b if isinstance(b, torch.Tensor) else b.free_energy,
                                   rtol=0, atol=0)


def test_gradients_are_unchanged_by_the_watch():
    layer, (q, Y) = sa.compile(retrieve), _inputs()
    grads = []
    for validating in (True, False):
        x = q.clone().requires_grad_()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", sa.DivergenceWarning)
            with sa.validation(validating):
                layer(x, Y, step_size=0.3, steps=5).sum().backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)


def test_non_finite_free_energy_is_named():
    layer = sa.compile(retrieve)
    q, Y = (t.float() for t in _inputs())
    # float32: one step of 1e30 puts ξ near 1e31, where ½β‖ξ‖² overflows
    with pytest.warns(sa.DivergenceWarning, match=r"step_size=1e\+30 diverged: the free energy "
                                                  r"went from \S+ to (nan|inf) over 3 steps .*; "
                                                  r"it turned non-finite at step 1 \(F = inf\)"):
        layer(q, Y, step_size=1e30, steps=3)
    # rising first, then non-finite: both said
    with pytest.warns(sa.DivergenceWarning, match=r"step_size=50.0 diverged: the free energy went "
                                                  r"from \S+ to nan over 60 steps .*; it first "
                                                  r"rose above its start at step 1"):
        layer(q * 30, Y * 30, step_size=50.0, steps=60)


def test_a_descending_iteration_or_unchecked_run_says_nothing():
    layer, (q, Y) = sa.compile(retrieve), _inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, trace = layer(q, Y, step_size=0.05, return_trace=True)  # descends
        assert bool((trace.free_energy[-1] < trace.free_energy[0]).all())
        with sa.validation(False):
            layer(q, Y, step_size=2.0)  # diverges, unchecked
    assert re.search("step_size", sa.DivergenceWarning.__doc__)
