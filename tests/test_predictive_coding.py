"""Predictive coding with attention over incoming units, and the standard network.

Oracles: the free energies written out by hand and differentiated by autograd (a
brute-force gradient descent), Pyro's ELBO loss and MAP, the textbook local learning rule.
"""

import math

import pytest
import torch

import structattn as sa

f64 = torch.float64


def free_energy_by_hand(m, x, y, layers):
    """F of the declaration written out: attention — −Σ log (1/n) Σ_j exp(−(k/2)e_ij²);
    standard — Σ (k/2)‖z_l − W f(z_{l−1}) − b‖²."""
    states = [x, *layers] + ([y] if y is not None else [])
    total = 0
    for l in range(1, len(states)):
        W, b, k = m.weights[l - 1], m.biases[l - 1], m.precision
        below, z = m.f(states[l - 1]), states[l]
        if m.attention:
            e = z[..., :, None] - W * below[..., None, :] - b[:, None]  # (B, n_l, n_{l−1})
            total = total - (torch.logsumexp(-0.5 * k * e ** 2, -1) - math.log(W.shape[1])).sum(-1)
        else:
            e = z - below @ W.T - b
            total = total + 0.5 * k * (e ** 2).sum(-1)
    return total


def descend_by_hand(m, x, y, T, eta):
    L = len(m.layer_sizes) - 1
    state, layers = x, []
    for l in range(1, L + (0 if y is not None else 1)):
        state = m.predict(l, state).detach()
        layers.append(state)
    for _ in range(T):  # Gauss-Seidel, layer by layer, as the engine does
        for i in range(len(layers)):
            zi = layers[i].detach().requires_grad_()
            trial = layers[:i] + [zi] + layers[i + 1:]
            (g,) = torch.autograd.grad(free_energy_by_hand(m, x, y, trial).sum(), zi)
            layers[i] = (zi - eta * g).detach()
    return layers


@pytest.mark.parametrize("attention", [True, False])
@pytest.mark.parametrize("clamped", [True, False])
def test_inference_is_gradient_descent_on_the_free_energy(attention, clamped):
    m = sa.models.predictive_coding([6, 5, 4, 3], attention=attention, precision=1.5, steps=7,
                                    step_size=0.1, dtype=f64)
    with torch.no_grad():
        for b in m.biases:
            b.normal_()
    x, y = torch.randn(2, 6, dtype=f64), (torch.randn(2, 3, dtype=f64) if clamped else None)
    out, trace = sa.compile(m)(x, y, return_trace=True)
    layers = descend_by_hand(m, x, y, 7, 0.1)
    for i, z in enumerate(layers, start=1):
        assert (trace.states[f"layer{i}"][-1][..., 0] - z).abs().max() < 1e-10
    assert (out - (y if clamped else layers[-1])).abs().max() < 1e-10
    by_hand = free_energy_by_hand(m, x, y, layers)
    assert (trace.free_energy[-1] - by_hand).abs().max() < 1e-10
    assert (trace.free_energy[1:] - trace.free_energy[:-1]).max() <= 1e-12


@pytest.mark.parametrize("attention", [True, False])
def test_fixed_point_is_pyro_map(attention):
    m = sa.models.predictive_coding([5, 4, 3], attention=attention, steps=5, step_size=0.2,
                                    dtype=f64)
    x, y = torch.randn(2, 5, dtype=f64), torch.randn(2, 3, dtype=f64)
    with sa.iteration(steps=5000, tol=1e-12):
        report = sa.inference.compare(m, x, y)
    assert report.max_abs_diff < 1e-9, str(report)
    assert report.fixed_point["layer1"] < 1e-4, str(report)


def test_free_energy_gradient_is_the_local_learning_rule():
    """Standard network: ∂F/∂W_l = −k e_l f(z_{l−1})ᵀ and ∂F/∂b_l = −k e_l at fixed states."""
    m = sa.models.predictive_coding([6, 5, 3], attention=False, precision=2.0, steps=10,
                                    dtype=f64)
    x, y = torch.randn(4, 6, dtype=f64), torch.randn(4, 3, dtype=f64)
    layer = sa.compile(m)
    with torch.no_grad():
        _, trace = layer(x, y, return_trace=True)
    z1 = trace.states["layer1"][-1]
    layer.free_energy(x, y, latents={"layer1": z1}).sum().backward()
    z1 = z1[..., 0]
    e1 = z1 - m.f(x) @ m.weights[0].T - m.biases[0]
    e2 = y - m.f(z1) @ m.weights[1].T - m.biases[1]
    assert torch.allclose(m.weights[0].grad, -2.0 * e1.T @ m.f(x))
    assert torch.allclose(m.weights[1].grad, -2.0 * e2.T @ m.f(z1))
    assert torch.allclose(m.biases[1].grad, -2.0 * e2.sum(0))


def test_attention_is_a_softmax_over_prediction_errors():
    """The expected gradient of a child: −k(z_i − b_i − Σ_j softmax_j(−(k/2)e_ij²) w_ij f(z_j))."""
    m = sa.models.predictive_coding([4, 3], steps=1, step_size=1.0, precision=0.7, dtype=f64)
    x = torch.randn(2, 4, dtype=f64)
    out = sa.compile(m)(x)
    z0 = m.predict(1, x)
    e = z0[..., :, None] - m.weights[0] * torch.tanh(x)[..., None, :] - m.biases[0][:, None]
    p = torch.softmax(-0.35 * e ** 2, -1)
    pred = (p * m.weights[0] * torch.tanh(x)[..., None, :]).sum(-1) + m.biases[0]
    assert (out - (z0 - 0.7 * (z0 - pred))).abs().max() < 1e-12


def test_gradcheck_one_step():
    m = sa.models.predictive_coding([3, 3, 2], steps=1, step_size=0.3, dtype=f64)
    layer = sa.compile(m)
    names = [n for n, _ in layer.named_parameters()]

    def f(x, *ps):
        return torch.func.functional_call(layer, dict(zip(names, ps, strict=True)), (x,))

    params = tuple(p.detach().clone().requires_grad_() for p in layer.parameters())
    assert torch.autograd.gradcheck(f, (torch.randn(2, 3, dtype=f64, requires_grad=True), *params))


@pytest.mark.parametrize("build,match", [
    (lambda: sa.models.predictive_coding([5]), "layer_sizes"),
    (lambda: sa.models.predictive_coding([5, 0]), "layer_sizes"),
    (lambda: sa.models.predictive_coding(5), "layer_sizes"),
    (lambda: sa.models.predictive_coding([5, 3], activation="relu"), "activation"),
    (lambda: sa.models.predictive_coding([5, 3], precision=0.0), "precision"),
    (lambda: sa.models.predictive_coding([5, 3], step_size=-0.1), "step_size"),
    (lambda: sa.models.predictive_coding([5, 3], steps=-1), "steps"),
])
def test_bad_configurations_are_refused(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_bad_inputs_are_refused():
    layer = sa.compile(sa.models.predictive_coding([5, 4, 3]))
    with pytest.raises(ValueError, match=r"x must have shape \(\*batch, 5\)"):
        layer(torch.randn(2, 4))
    with pytest.raises(ValueError, match=r"y must have shape \(2, 3\)"):
        layer(torch.randn(2, 5), torch.randn(2, 4))
    with pytest.raises(ValueError, match="non-finite"):
        layer(torch.full((2, 5), float("nan")))
