"""Deterministic node sets (``structattn.deterministic``): states computed from other node
sets, followed through a latent's iteration, differentiated in closed form (a pullback) or
by autograd — and a reading that differentiates by autograd is never recorded as a plan."""

import pytest
import torch

import structattn as sa

f64 = torch.float64


def _program(pullback):
    """A latent z (*batch, 1, 3) read through K = 4 predictions tanh(W_k z); an observed x
    (1 node of 5) picks one of them, ψ = −‖x − g_k‖²/2."""
    W = torch.randn(4, 5, 3, dtype=f64)

    def fn(z):
        return torch.tanh((W @ z[..., 0, None, :, None]).squeeze(-1))

    def vjp(u, g, z):
        return torch.einsum("knm,...kn->...m", W, u * (1 - g * g)).unsqueeze(-2)

    def program(x):
        z = sa.latent("z", torch.zeros(*x.shape[:-1], 1, 3, dtype=f64), scale=1.0,
                      update="gradient", steps=6, step_size=0.2)
        g = sa.deterministic("g", fn, z, pullback=vjp if pullback else None)
        phi = sa.edges("pick", sa.nodes("x", x.unsqueeze(-2)), g, sa.priors.Uniform())
        sa.potential(phi, sa.potentials.Distance(power=2))
        return sa.infer(z)

    return program, fn


def _descend(fn, x, steps=6, eta=0.2):
    """Gradient descent on F(z) = ‖z‖²/2 − log (1/4) Σ_k exp(−‖x − g_k(z)‖²/2), by autograd."""
    z = torch.zeros(*x.shape[:-1], 1, 3, dtype=f64)
    for _ in range(steps):
        z = z.detach().requires_grad_()
        g = fn(z)
        F = 0.5 * (z * z).sum() - torch.logsumexp(-0.5 * ((x[..., None, :] - g) ** 2).sum(-1),
                                                    -1).sum()
        (grad,) = torch.autograd.grad(F, z)
        z = z - eta * grad
    return z.detach()


@pytest.mark.parametrize("pullback", [True, False])
def test_a_latent_is_inferred_through_its_deterministic_node_set(pullback):
    torch.manual_seed(0)
    program, fn = _program(pullback)
    layer = sa.compile(program)
    x = torch.randn(2, 5, dtype=f64)
    assert (layer(x) - _descend(fn, x)).abs().max() < 1e-12
    torch.manual_seed(0)
    assert sa.inference.compare(layer, x).max_abs_diff < 1e-10


def test_a_plan_is_recorded_with_a_pullback_and_not_without():
    torch.manual_seed(1)
    xs = [torch.randn(2, 5, dtype=f64) for _ in range(4)]
    for pullback in (True, False):
        torch.manual_seed(0)
        program, fn = _program(pullback)
        layer = sa.compile(program)
        for x in xs:
            assert (layer(x) - _descend(fn, x)).abs().max() < 1e-12
        (plan,) = layer.plans.values()
        if pullback:
            assert plan.graph is not None and plan.calls >= 2
        else:
            assert plan.graph is None and "differentiates with autograd" in plan.reason


def test_node_energies_are_read_every_call_and_say_why():
    """The standard predictive-coding network's node energies are differentiated by autograd:
    its plan is not recorded (the tracer would keep the gradients as constants), and every call
    follows its own input."""
    m = sa.models.predictive_coding([5, 4, 3], attention=False, steps=3, dtype=f64)
    layer, reading = sa.compile(m), sa.compile(m, replay=False)
    for _ in range(4):
        x = torch.randn(2, 5, dtype=f64)
        assert torch.equal(layer(x), reading(x))
    (plan,) = layer.plans.values()
    assert plan.graph is None and "differentiates with autograd" in plan.reason


def test_observed_sources_make_an_observed_node_set():
    x = torch.randn(2, 3, 4, dtype=f64)
    with sa.readers.TraceStructure() as reader:
        g = sa.deterministic("g", lambda s: 2 * s, sa.nodes("x", x))
    assert g.observed and torch.equal(g.states, 2 * x) and "g" in reader.node_sets


@pytest.mark.parametrize("call, match", [
    (lambda x: sa.deterministic("g", 3, x), r"deterministic node set 'g': fn must be callable"),
    (lambda x: sa.deterministic("g", lambda s: s.sum(-1), x),
     r"deterministic node set 'g': fn must return states of shape \(2, n, features\)"),
    (lambda x: sa.deterministic("g", lambda s: s, torch.zeros(2, 3)),
     r"deterministic node set 'g': give the node sets its states are computed from"),
    (lambda x: sa.deterministic("g", lambda s: s * float("nan"), x),
     r"node set 'g' contains non-finite values"),
    (lambda x: sa.deterministic("g", lambda s: s, x, pullback=1),
     r"deterministic node set 'g': pullback must be callable or None; got int"),
])
def test_bad_declarations_are_refused(call, match):
    x = sa.nodes("x", torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match=match):
        call(x)


def test_a_pullback_of_the_wrong_shape_is_refused():
    W = torch.randn(4, 5, 3, dtype=f64)

    def program(x):
        z = sa.latent("z", torch.zeros(*x.shape[:-1], 1, 3, dtype=f64), update="gradient",
                      steps=1)
        g = sa.deterministic("g", lambda z: torch.tanh((W @ z[..., 0, None, :, None]).squeeze(-1)),
                             z, pullback=lambda u, g, z: u)
        phi = sa.edges("pick", sa.nodes("x", x.unsqueeze(-2)), g, sa.priors.Uniform())
        sa.potential(phi, sa.potentials.Distance())
        return sa.infer(z)

    with pytest.raises(ValueError, match=r"deterministic node set 'g': pullback must return one "
                                         r"gradient per source, shaped like its states "
                                         r"\['\(2, 1, 3\)'\]; got \['\(2, 4, 5\)'\]"):
        sa.compile(program)(torch.randn(2, 5, dtype=f64))


def test_distance_potential_settings_are_checked():
    with pytest.raises(ValueError, match=r"power must be 1 \(the Euclidean norm\) or 2"):
        sa.potentials.Distance(power=3)
    with pytest.raises(ValueError, match=r"temperature must be a finite number > 0; got 0"):
        sa.potentials.Distance(precision=0)

    def program(x, y):
        phi = sa.edges("f", sa.nodes("x", x), sa.nodes("y", y), sa.priors.Uniform())
        sa.potential(phi, sa.potentials.Distance())
        return sa.value(phi, sa.values.Identity())

    with pytest.raises(ValueError, match=r"Distance potential compares children and parents of "
                                         r"the same width"):
        sa.compile(program)(torch.randn(3, 4), torch.randn(5, 2))
