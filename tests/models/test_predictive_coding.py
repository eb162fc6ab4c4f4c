"""Predictive coding with attention over incoming units, and the standard network.

Oracles: the free energies written out by hand and differentiated by autograd (a
brute-force gradient descent), Pyro's ELBO loss and MAP, the textbook local learning rule.
"""

import math
import warnings

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

import structattn as sa

f64 = torch.float64


def block_free_energy_by_hand(W, b, k, below, z, B_below, B):
    """−Σ_i log (1/P) Σ_j exp(−(k/2)‖z_i − W_ij f(z_j) − b_i‖²), block by block, in loops."""
    zs, fs = z.chunk(B, -1), below.chunk(B_below, -1)  # B blocks (batch, d), P blocks (batch, d')
    total = 0
    for i in range(B):
        psi = torch.stack([-0.5 * k * ((zs[i] - fs[j] @ W[i, j].T - b[i]) ** 2).sum(-1)
                           for j in range(B_below)], -1)
        total = total - (torch.logsumexp(psi, -1) - math.log(B_below))
    return total


def free_energy_by_hand(m, x, y, layers):
    """F of the declaration written out: attention — −Σ log (1/n) Σ_j exp(−(k/2)e_ij²);
    standard — Σ (k/2)‖z_l − W f(z_{l−1}) − b‖²."""
    states = [x, *layers] + ([y] if y is not None else [])
    total = 0
    for l in range(1, len(states)):
        W, b, k = m.weights[l - 1], m.biases[l - 1], m.precision
        below, z = m.f(states[l - 1]), states[l]
        if m.attention and W.dim() == 4:
            total = total + block_free_energy_by_hand(W, b, k, below, z, m.blocks[l - 1],
                                                      m.blocks[l])
        elif m.attention:
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


blocks_cases = st.tuples(
    st.lists(st.tuples(st.integers(1, 3), st.integers(1, 3)), min_size=2, max_size=4),
    st.integers(0, 2**31 - 1), st.booleans(), st.sampled_from(["tanh", None]))


@settings(max_examples=25, deadline=None)
@given(blocks_cases)
def test_blocks_inference_is_gradient_descent_on_the_free_energy(case):
    """Blocks of units competing: random layers of B blocks × d units, random weights and
    biases; the compiled iteration equals gradient descent on F written out in loops."""
    layers, seed, clamped, activation = case
    sizes, blocks = [B * d for B, d in layers], [B for B, _ in layers]
    torch.manual_seed(seed)
    m = sa.models.predictive_coding(sizes, blocks=blocks, precision=1.3, steps=4, step_size=0.1,
                                    activation=activation, dtype=f64)
    with torch.no_grad():
        for b in m.biases:
            b.normal_()
    x = torch.randn(2, sizes[0], dtype=f64)
    y = torch.randn(2, sizes[-1], dtype=f64) if clamped else None
    if clamped and len(sizes) == 2:  # nothing latent: F alone
        F = sa.compile(m).free_energy(x, y)
        assert (F - free_energy_by_hand(m, x, y, [])).abs().max() < 1e-10
        return
    # (η = 0.1 diverges on some of these networks, below: the layer then warns so, rightly —
    # what is checked here is that it computes the same descent as the loops)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sa.DivergenceWarning)
        out, trace = sa.compile(m)(x, y, return_trace=True)
    hand = descend_by_hand(m, x, y, 4, 0.1)
    for i, z in enumerate(hand, start=1):
        assert (trace.states[f"layer{i}"][-1].flatten(-2) - z).abs().max() < 1e-10
    assert (out - (y if clamped else hand[-1])).abs().max() < 1e-10
    assert (trace.free_energy[-1] - free_energy_by_hand(m, x, y, hand)).abs().max() < 1e-10
    # F never rises under gradient descent once the step is below 1/L of F; η = 0.1 is not
    # always (layers [(2, 2), (3, 3), (1, 1), (2, 2)], seed 201548382, clamped, tanh: F rose by
    # 0.35 at the first step, in the compiled and the hand-written descent alike), so the
    # descent property is checked on the same network at a step ten times smaller
    torch.manual_seed(seed)
    small = sa.models.predictive_coding(sizes, blocks=blocks, precision=1.3, steps=4,
                                        step_size=0.01, activation=activation, dtype=f64)
    small.load_state_dict(m.state_dict())
    _, trace = sa.compile(small)(x, y, return_trace=True)
    assert (trace.free_energy[1:] - trace.free_energy[:-1]).max() <= 1e-12  # F never rises


@pytest.mark.parametrize("clamped", [True, False])
def test_blocks_fixed_point_is_pyro_map(clamped):
    m = sa.models.predictive_coding([6, 4, 3], blocks=[2, 2, 1], steps=5, step_size=0.2,
                                    dtype=f64)
    x = torch.randn(2, 6, dtype=f64)
    y = torch.randn(2, 3, dtype=f64) if clamped else None
    with sa.iteration(steps=5000, tol=1e-12):
        report = sa.inference.compare(m, x, *([y] if clamped else []))
    assert report.max_abs_diff < 1e-9, str(report)
    assert report.fixed_point["layer1"] < 1e-4, str(report)


def test_one_block_per_layer_is_the_standard_network():
    """One node per layer: one edge to choose, F and the whole iteration are the standard
    network's (same weights)."""
    sizes = [6, 5, 3]
    att = sa.models.predictive_coding(sizes, blocks=[1, 1, 1], precision=1.7, steps=6,
                                      step_size=0.1, dtype=f64)
    std = sa.models.predictive_coding(sizes, attention=False, precision=1.7, steps=6,
                                      step_size=0.1, dtype=f64)
    with torch.no_grad():
        for Wa, ba, Ws, bs in zip(att.weights, att.biases, std.weights, std.biases, strict=True):
            ba.normal_()
            Ws.copy_(Wa[0, 0])
            bs.copy_(ba[0])
    x, y = torch.randn(3, 6, dtype=f64), torch.randn(3, 3, dtype=f64)
    for target in (None, y):
        a, ta = sa.compile(att)(x, target, return_trace=True)
        s, ts = sa.compile(std)(x, target, return_trace=True)
        assert (a - s).abs().max() < 1e-12
        assert (ta.free_energy - ts.free_energy).abs().max() < 1e-12


def test_blocks_posterior_is_a_softmax_over_block_prediction_errors():
    m = sa.models.predictive_coding([6, 3], blocks=[3, 1], precision=0.8, steps=0, dtype=f64)
    x, y = torch.randn(2, 6, dtype=f64), torch.randn(2, 3, dtype=f64)
    _, post = sa.compile(m)(x, y, return_posterior=True)
    W, b = m.weights[0], m.biases[0]  # (1, 3, 3, 2), (1, 3)
    fx = torch.tanh(x).unflatten(-1, (3, 2))
    err = torch.stack([y - fx[:, j] @ W[0, j].T - b[0] for j in range(3)], -2)  # (2, 3, 3)
    expected = torch.softmax(-0.4 * (err ** 2).sum(-1), -1)
    assert post.shape == (2, 1, 1, 3)  # (batch, heads, one output block, three input blocks)
    assert (post[..., 0, 0, :] - expected).abs().max() < 1e-12


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


@pytest.mark.parametrize("sizes,blocks", [([3, 3, 2], None), ([4, 4, 2], [2, 2, 1])])
def test_gradcheck_one_step(sizes, blocks):
    m = sa.models.predictive_coding(sizes, blocks=blocks, steps=1, step_size=0.3, dtype=f64)
    layer = sa.compile(m)
    names = [n for n, _ in layer.named_parameters()]

    def f(x, *ps):
        return torch.func.functional_call(layer, dict(zip(names, ps, strict=True)), (x,))

    params = tuple(p.detach().clone().requires_grad_() for p in layer.parameters())
    x = torch.randn(2, sizes[0], dtype=f64, requires_grad=True)
    assert torch.autograd.gradcheck(f, (x, *params))


@pytest.mark.parametrize("build,match", [
    (lambda: sa.models.predictive_coding([5]), "layer_sizes"),
    (lambda: sa.models.predictive_coding([5, 0]), "layer_sizes"),
    (lambda: sa.models.predictive_coding(5), "layer_sizes"),
    (lambda: sa.models.predictive_coding([5, 3], activation="relu"), "activation"),
    (lambda: sa.models.predictive_coding([5, 3], precision=0.0), "precision"),
    (lambda: sa.models.predictive_coding([5, 3], step_size=-0.1), "step_size"),
    (lambda: sa.models.predictive_coding([5, 3], steps=-1), "steps"),
    (lambda: sa.models.predictive_coding([6, 4], blocks=[2], ), r"blocks .* 2 layers"),
    (lambda: sa.models.predictive_coding([6, 4], blocks=[4, 2]), r"dividing its size; got \[4, 2\]"),
    (lambda: sa.models.predictive_coding([6, 4], blocks=[0, 2]), "blocks"),
    (lambda: sa.models.predictive_coding([6, 4], blocks=[2, 2], attention=False), "attention=True"),
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


def test_blocks_are_the_nodes_of_the_drawing():
    """[8, 8, 4] with blocks [1, 4, 1]: 6 nodes (one input block, four hidden, one output) and
    8 candidate edges; the output's edge probabilities are its posterior over the blocks."""
    m = sa.models.predictive_coding([8, 8, 4], blocks=[1, 4, 1], steps=3, dtype=f64)
    x = torch.rand(1, 8, dtype=f64)
    G = sa.to_networkx(m, x)
    assert G.number_of_nodes() == 6 and G.number_of_edges() == 8
    _, post = sa.compile(m)(x, return_posterior=True)
    out = [(u, v, d) for u, v, d in G.edges(data=True) if d["family"] == "predict2"]
    assert len(out) == 4
    weights = sorted(d["posterior"] for *_, d in out)
    assert torch.allclose(torch.tensor(weights, dtype=f64),
                          post["predict2"][0, 0, 0].sort().values, atol=1e-6)


@pytest.mark.parametrize("blocks, bad", [([2, 0], "blocks\\[1\\] must be a positive int; got 0"),
                                         ([2, 1.5], "blocks\\[1\\] must be a positive int; got 1.5"),
                                         ([-2, 2], "blocks\\[0\\] must be a positive int; got -2")])
def test_each_block_count_is_a_size(blocks, bad):
    """Block counts are sizes, each checked and named by its layer (ENTRY.sizes covers the
    layer sizes; the block counts, relative to them, are checked here)."""
    with pytest.raises(ValueError, match=rf"^PredictiveCoding: {bad}$"):
        sa.models.predictive_coding([6, 4], blocks=blocks)
