"""Hopfield retrieval as a latent node set. Oracles: a hand-written float64 loop of Ramsauer
et al.'s update, their energy, Pyro's TraceEnum_ELBO loss (the free energy at a state) and
Pyro's MAP (the fixed point)."""

import inspect
import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import structattn as sa

f64 = torch.float64


def merge(t):
    B, H, n, d = t.shape
    return t.permute(0, 2, 1, 3).reshape(B, n, H * d)


def split(t, heads):  # (B, n, H·d) -> (B, H, n, d), written out independently of the library
    B, n, hd = t.shape
    return t.reshape(B, n, heads, hd // heads).permute(0, 2, 1, 3)


def hopfield_loop(m, r, Y, T):
    """Ramsauer et al.'s retrieval, per head: ξ₀ = W_q r; ξ ← Kᵀ softmax(βKξ) T times;
    output W_o concat_h(Vᵀ softmax(βKξ_T))."""
    K, V = split(Y @ m.W_k.T, m.heads), split(Y @ m.W_v.T, m.heads)
    xi = split(r @ m.W_q.T, m.heads)
    for _ in range(T):
        xi = torch.softmax(m.beta * xi @ K.transpose(-1, -2), -1) @ K
    out = merge(torch.softmax(m.beta * xi @ K.transpose(-1, -2), -1) @ V)
    return out @ m.W_o.T, xi


@pytest.mark.parametrize("T", [0, 1, 2, 3])
@pytest.mark.parametrize("heads", [1, 4])
def test_hopfield_equals_hand_written_loop(T, heads):
    m = sa.models.hopfield(7, 5, heads=heads, d_k=3, d_v=2, iteration=sa.IterationOptions(steps=T),
                           dtype=f64)
    r, Y = torch.randn(2, 3, 7, dtype=f64), torch.randn(2, 11, 5, dtype=f64)
    ref, xi = hopfield_loop(m, r, Y, T)
    out, trace = sa.compile(m)(r, Y, return_trace=True)
    assert (out - ref).abs().max() < 1e-10
    assert trace.steps == T and trace.states["state"].shape == (T + 1, 2, 3, heads * 3)
    assert (trace.states["state"][-1] - merge(xi)).abs().max() < 1e-10


@settings(max_examples=25, deadline=None, derandomize=True)
@given(B=st.integers(1, 3), M=st.integers(1, 5), N=st.integers(1, 7), heads=st.integers(1, 3),
       d_k=st.integers(1, 4), T=st.integers(0, 4), beta=st.floats(0.05, 3.0))
def test_hopfield_random_sizes(B, M, N, heads, d_k, T, beta):
    m = sa.models.hopfield(5, 3, heads=heads, d_k=d_k, d_v=2, beta=beta,
                           iteration=sa.IterationOptions(steps=T), dtype=f64)
    r, Y = torch.randn(B, M, 5, dtype=f64), torch.randn(B, N, 3, dtype=f64)
    ref, _ = hopfield_loop(m, r, Y, T)
    assert (sa.compile(m)(r, Y) - ref).abs().max() < 1e-10


def test_hopfield_free_energy_is_ramsauers_energy_and_never_increases():
    m = sa.models.hopfield(6, 6, heads=2, d_k=3, beta=2.0, iteration=sa.IterationOptions(steps=20),
                           dtype=f64)
    r, Y = torch.randn(3, 4, 6, dtype=f64), 2 * torch.randn(3, 9, 6, dtype=f64)
    _, trace = sa.compile(m)(r, Y, return_trace=True)
    F = trace.free_energy  # (21, 3)
    assert F.shape == (21, 3)
    assert (F[1:] - F[:-1]).max() <= 1e-12
    # F = β·E + const with E Ramsauer et al.'s energy: the constant is the same at every step
    E = torch.stack([m.energy(s, Y) for s in trace.states["state"]])
    const = F - m.beta * E
    assert (const - const[0]).abs().max() < 1e-10
    n, d = 4 * 2, 3  # queries·heads, d_k
    expected = n * (0.5 * d * math.log(2 * math.pi / m.beta) + math.log(9))
    assert (const - expected).abs().max() < 1e-10


def test_free_energy_equals_pyros_loss_at_every_step():
    m = sa.models.hopfield(5, 4, heads=2, d_k=2, beta=1.5, iteration=sa.IterationOptions(steps=4),
                           dtype=f64)
    r, Y = torch.randn(2, 3, 5, dtype=f64), torch.randn(2, 6, 4, dtype=f64)
    with torch.no_grad():
        _, trace = sa.compile(m)(r, Y, return_trace=True)
    for t in range(5):
        truth = sa.inference.exact(m, r, Y, latents={"state": trace.states["state"][t]})
        assert abs(float(trace.free_energy[t].sum()) - truth.free_energy) < 1e-9


def test_hopfield_fixed_point_is_pyro_map():
    # β·max‖k‖² < 1: the energy is strictly convex, so the fixed point is the unique MAP
    m = sa.models.hopfield(6, 5, heads=2, d_k=3, d_v=2, beta=0.3, dtype=f64)
    r, Y = torch.randn(2, 3, 6, dtype=f64), 0.5 * torch.randn(2, 7, 5, dtype=f64)
    with sa.iteration(steps=2000, tol=1e-13):
        report = sa.inference.compare(m, r, Y)
    assert report.max_abs_diff < 1e-9, str(report)
    assert report.fixed_point["state"] < 1e-4, str(report)
    assert abs(report.fixed_point_free_energy) < 1e-8


def test_hopfield_update_steps_zero_is_cross_attention():
    m = sa.models.hopfield(6, 5, heads=2, d_k=3, d_v=4, dtype=f64)
    c = sa.models.cross_attention(6, 5, heads=2, d_k=3, d_v=4, temperature=math.sqrt(3),
                                  dtype=f64)
    c.load_state_dict(m.state_dict())
    r, Y = torch.randn(2, 3, 6, dtype=f64), torch.randn(2, 7, 5, dtype=f64)
    assert (sa.compile(m)(r, Y) - sa.compile(c)(r, Y)).abs().max() < 1e-12


def test_last_step_only_gradient_is_one_step_from_the_detached_state():
    m = sa.models.hopfield(5, 4, heads=2, d_k=3,
                           iteration=sa.IterationOptions(steps=4, grad="last"), dtype=f64)
    r, Y = torch.randn(2, 3, 5, dtype=f64), torch.randn(2, 6, 4, dtype=f64)
    sa.compile(m)(r, Y).pow(2).sum().backward()
    got = {n: None if p.grad is None else p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad(set_to_none=True)
    # the definition: T − 1 steps without gradients, then one step that sees the parameters
    with torch.no_grad():
        _, xi = hopfield_loop(m, r, Y, 3)
    K, V = split(Y @ m.W_k.T, m.heads), split(Y @ m.W_v.T, m.heads)
    xi = torch.softmax(m.beta * xi @ K.transpose(-1, -2), -1) @ K
    out = merge(torch.softmax(m.beta * xi @ K.transpose(-1, -2), -1) @ V) @ m.W_o.T
    out.pow(2).sum().backward()
    assert got["W_q"] is None and m.W_q.grad is None  # the initial state is not differentiated
    for n in ("W_k", "W_v", "W_o"):
        assert (got[n] - getattr(m, n).grad).abs().max() < 1e-10, n


def test_hopfield_without_projections_is_the_classical_network():
    m = sa.models.hopfield(6, heads=2, projections=False, beta=0.9,
                           iteration=sa.IterationOptions(steps=3), dtype=f64)
    assert not list(m.parameters())
    r, Y = torch.randn(2, 3, 6, dtype=f64), torch.randn(2, 8, 6, dtype=f64)
    out, trace = sa.compile(m)(r, Y, return_trace=True)
    xi = split(r, 2)
    K = split(Y, 2)
    for _ in range(4):  # T updates, then the output's read: ξ_{T+1}
        xi = torch.softmax(0.9 * xi @ K.transpose(-1, -2), -1) @ K
    assert (out - merge(xi)).abs().max() < 1e-12
    per_query = m.energy(trace.states["state"][-1], Y, per_query=True)
    assert per_query.shape == (2, 3)
    assert torch.allclose(per_query.sum(-1), m.energy(trace.states["state"][-1], Y))
    with pytest.raises(ValueError, match="projections=False"):
        sa.models.hopfield(6, 4, projections=False)


def test_temperature_is_the_inverse_of_beta():
    """``temperature=τ`` (as every attention model takes it) is ``beta=1/τ``: the hand-written
    loop at β = 1/τ; both given must agree, else a clear error."""
    torch.manual_seed(0)
    m = sa.models.hopfield(6, heads=2, temperature=0.4, iteration=sa.IterationOptions(steps=2),
                           dtype=f64)
    assert m.beta == 2.5 and m.temperature == pytest.approx(0.4)
    r, Y = torch.randn(2, 3, 6, dtype=f64), torch.randn(2, 8, 6, dtype=f64)
    want, _ = hopfield_loop(m, r, Y, 2)  # reads m.beta
    assert (sa.compile(m)(r, Y) - want).abs().max() < 1e-12
    assert sa.models.hopfield(6, beta=2.5, temperature=0.4).beta == 2.5  # the same setting
    assert sa.models.hopfield(6, d_k=4).temperature == pytest.approx(2.0)  # default τ = √d_k
    with pytest.raises(ValueError, match=r"^Hopfield: beta and temperature are one setting, "
                                         r"β = 1/τ; got beta=2.0 and temperature=0.3 "
                                         r"\(1/τ = 3.33333\): give one of them"):
        sa.models.hopfield(6, beta=2.0, temperature=0.3)
    for bad in (0.0, -1.0, math.inf, "learned", True):
        with pytest.raises(ValueError, match=rf"^Hopfield: temperature must be a finite number > "
                                             rf"0 \(or None\); got {re.escape(repr(bad))}"):
            sa.models.hopfield(6, temperature=bad)


def hopfield_loop_until(m, r, Y, steps, tol, damping=0.0):
    """``hopfield_loop`` with the latent's stopping rule and damping written out: at most
    ``steps`` updates ξ ← (1 − α)·Kᵀ softmax(βKξ) + α·ξ, stopping after the first that moves
    every state by at most ``tol`` (max abs); returns the output and the number of updates."""
    K, V = split(Y @ m.W_k.T, m.heads), split(Y @ m.W_v.T, m.heads)
    xi = split(r @ m.W_q.T, m.heads)
    taken = 0
    for _ in range(steps):
        new = (1 - damping) * torch.softmax(m.beta * xi @ K.transpose(-1, -2), -1) @ K \
            + damping * xi
        moved, xi, taken = float((new - xi).detach().abs().max()), new, taken + 1
        if tol is not None and moved <= tol:
            break
    out = merge(torch.softmax(m.beta * xi @ K.transpose(-1, -2), -1) @ V)
    return out @ m.W_o.T, taken


def test_iteration_options_are_taken_whole():
    """``iteration=sa.IterationOptions(...)`` is what ``update_steps``, ``tol`` and ``grad``
    were, and passes the other fields too: steps and tol (the stopping rule), damping, against
    the hand-written loop; the default is ``IterationOptions(steps=0)``, cross attention."""
    default = inspect.signature(sa.models.Hopfield).parameters["iteration"].default
    assert default == sa.IterationOptions(steps=0)
    m = sa.models.hopfield(6)
    assert m.iteration == sa.IterationOptions(steps=0) and m.update_steps == 0
    torch.manual_seed(3)
    r, Y = torch.randn(2, 3, 6, dtype=f64), torch.randn(2, 9, 5, dtype=f64)
    for steps, tol, damping in ((3, None, 0.0), (3, 1e-3, 0.0), (200, 1e-6, 0.0),
                                (200, 1e-6, 0.4)):
        options = sa.IterationOptions(steps=steps, tol=tol, damping=damping)
        m = sa.models.hopfield(6, 5, heads=2, d_k=3, beta=0.7, iteration=options, dtype=f64)
        assert m.iteration is options and m.update_steps == steps
        want, taken = hopfield_loop_until(m, r, Y, steps, tol, damping)
        got, trace = sa.compile(m)(r, Y, return_trace=True)
        assert trace.steps == taken, (steps, tol, damping)
        assert (got - want).abs().max() < 1e-10, (steps, tol, damping)
        if steps == 200:
            assert taken < 200  # the tolerance, not the budget, stopped it
    # steps=T alone: hopfield_loop's T updates (what update_steps=T gave)
    m = sa.models.hopfield(7, 5, heads=2, d_k=3, iteration=sa.IterationOptions(steps=3),
                           dtype=f64)
    r = torch.randn(2, 3, 7, dtype=f64)
    assert (sa.compile(m)(r, Y) - hopfield_loop(m, r, Y, 3)[0]).abs().max() < 1e-10


@pytest.mark.parametrize("bad", [3, {"steps": 3}, None, sa.MeanFieldWindows(),
                                 sa.IterationOptions])
def test_a_bad_iteration_is_refused(bad):
    with pytest.raises(ValueError, match=rf"^Hopfield: iteration must be a structattn."
                                         rf"IterationOptions \(e.g. IterationOptions\(steps=3\)\); "
                                         rf"got {re.escape(repr(bad))}$"):
        sa.models.hopfield(6, iteration=bad)
    with pytest.raises(ValueError, match=r"steps must be an int ≥ 0; got -1"):
        sa.models.hopfield(6, iteration=sa.IterationOptions(steps=-1))
    with pytest.raises(TypeError, match="update_steps"):  # the old names are gone
        sa.models.hopfield(6, update_steps=3)
