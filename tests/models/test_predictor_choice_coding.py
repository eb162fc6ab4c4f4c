"""The authors' predictive-coding network: each layer picks one of K whole-layer predictors
tanh(W_k z) of the layer above, with a Euclidean (or squared) error.

Oracles: the authors' free energy F = Σ_l −(1/T) logsumexp_k(−T‖z_l − tanh(W_lk z_{l+1})‖),
written here in loops and differentiated by autograd (a brute-force gradient descent); Pyro's
exact reading of the declaration at the engine's states (the posteriors over predictors, F)
and Pyro's MAP; autograd through the predictions for the closed-form pullback.
"""

import math
import sys

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

import structattn as sa

f64 = torch.float64


def authors_free_energy(m, layers):
    """Σ_l −(1/T) log Σ_k exp(−T c(z_l − tanh(W_lk z_{l+1}))), c = ‖·‖ or ½‖·‖², layers
    bottom-up ``[(B, n_0), …, (B, n_L)]``, one predictor and one layer at a time."""
    T = m.temperature
    total = 0
    for l in range(len(layers) - 1):
        costs = []
        for k in range(m.predictors):
            e = layers[l] - torch.tanh(layers[l + 1] @ m.weights[l][k].T)
            costs.append(e.norm(dim=-1) if m.norm == "euclidean" else 0.5 * (e * e).sum(-1))
        total = total - torch.logsumexp(-T * torch.stack(costs, -1), -1) / T
    return total


def descend_by_hand(m, x, y, steps, dt):
    """The engine's order: the label (when latent) then the hidden layers top-down, each a
    step of dt on the authors' F with the others held (Gauss-Seidel); hidden layers start at
    the mean prediction from above, the label at 1/n_L."""
    L = len(m.layer_sizes) - 1
    top = y if y is not None else torch.full((x.shape[0], m.layer_sizes[L]), 1 / m.layer_sizes[L],
                                             dtype=x.dtype)
    layers = [None] * (L + 1)
    layers[0], layers[L] = x, top
    for l in range(L - 1, 0, -1):
        layers[l] = torch.stack([torch.tanh(layers[l + 1] @ m.weights[l][k].T)
                                 for k in range(m.predictors)]).mean(0).detach()
    order = ([L] if y is None else []) + list(range(L - 1, 0, -1))
    for _ in range(steps):
        for i in order:
            zi = layers[i].detach().requires_grad_()
            trial = layers[:i] + [zi] + layers[i + 1:]
            (g,) = torch.autograd.grad(authors_free_energy(m, trial).sum(), zi)
            layers[i] = (zi - dt * g).detach()
    return layers


def _network(sizes, K, T, norm, steps, dt, seed, **kw):
    torch.manual_seed(seed)
    return sa.models.predictor_choice_coding(sizes, predictors=K, temperature=T, norm=norm,
                                             steps=steps, step_size=dt, dtype=f64, **kw)


cases = st.tuples(st.lists(st.integers(1, 5), min_size=2, max_size=4), st.integers(1, 4),
                  st.sampled_from([0.5, 1.0, 3.0]), st.sampled_from(["euclidean", "squared"]),
                  st.booleans(), st.integers(0, 2**31 - 1))


@settings(max_examples=30, deadline=None)
@given(cases)
@pytest.mark.filterwarnings("ignore::structattn.DivergenceWarning")
def test_inference_is_gradient_descent_on_the_authors_free_energy(case):
    """Random layers, K and T, both norms, label clamped or inferred: the compiled iteration's
    states are gradient descent of step dt on the authors' F (to 1e-10), and its F is T times
    theirs plus L·log K. (With the Euclidean error F may rise — a cone's gradient keeps its
    length at the tip, so a fixed step overshoots it — and the engine warns, as it should.)"""
    sizes, K, T, norm, clamped, seed = case
    m = _network(sizes, K, T, norm, 4, 0.05, seed)
    x = torch.randn(3, sizes[0], dtype=f64)
    y = torch.randn(3, sizes[-1], dtype=f64) if clamped else None
    L = len(sizes) - 1
    hand = descend_by_hand(m, x, y, 4, 0.05)
    if clamped and L == 1:  # nothing latent: F alone
        F = sa.compile(m).free_energy(x, y)
        assert (F - (T * authors_free_energy(m, hand) + math.log(K))).abs().max() < 1e-10
        return
    out, trace = sa.compile(m)(x, y, return_trace=True)
    for l in range(1, L + (y is None)):
        assert (trace.states[f"layer{l}"][-1][..., 0, :] - hand[l]).abs().max() < 1e-10
    assert (out - hand[L]).abs().max() < 1e-10
    F_hand = T * authors_free_energy(m, hand) + L * math.log(K)
    assert (trace.free_energy[-1] - F_hand).abs().max() < 1e-10


@pytest.mark.parametrize("norm", ["euclidean", "squared"])
@pytest.mark.parametrize("clamped", [True, False])
def test_pyro_reads_the_same_posterior_over_predictors(norm, clamped):
    """Pyro's exact reading at the engine's final states: p(φ_l = k | z), the output and F."""
    m = _network([6, 4, 3], 3, 2.0, norm, 5, 0.05, 0)
    x = torch.randn(2, 6, dtype=f64)
    y = torch.randn(2, 3, dtype=f64) if clamped else None
    report = sa.inference.compare(m, x, *([y] if clamped else []))
    assert report.max_abs_diff < 1e-10, str(report)
    assert {c.name for c in report.checks} >= {"posterior[predict0]", "posterior[predict1]",
                                                "free energy"}


def test_squared_norm_fixed_point_is_pyro_map():
    """With the squared error F is smooth: run to a tolerance, the iteration lands on Pyro's
    MAP of the collapsed model."""
    m = _network([5, 4, 3], 2, 1.0, "squared", 5, 0.2, 1)
    x, y = torch.randn(2, 5, dtype=f64), torch.randn(2, 3, dtype=f64)
    with sa.iteration(steps=5000, tol=1e-12):
        report = sa.inference.compare(m, x, y)
    assert report.passed, str(report)
    assert report.fixed_point["layer1"] < 1e-4, str(report)


def _without_pullbacks(monkeypatch):
    """Declare the predictions without their pullback: the engine differentiates by autograd."""
    nodes = sys.modules["structattn.nodes"]
    make = nodes._make_deterministic
    monkeypatch.setattr(nodes, "_make_deterministic",
                        lambda name, fn, sources, features=None, pullback=None:
                        make(name, fn, sources, features, None))


def test_closed_form_pullback_equals_autograd(monkeypatch):
    """The states, gradients and F with the model's pullback W_kᵀ(u_k ⊙ (1 − g_k²)) equal the
    engine's autograd through tanh(W_k z); the autograd reading is not recorded (PyTorch's
    tracer would keep its gradients as constants) and says why, and stays right on new
    inputs."""
    m = _network([6, 5, 4, 3], 3, 1.5, "euclidean", 4, 0.05, 2)
    x = torch.randn(2, 6, dtype=f64)
    closed = sa.compile(m)
    want, trace = closed(x, return_trace=True)
    (g_want,) = torch.autograd.grad(want.sum(), m.weights[0])
    _without_pullbacks(monkeypatch)
    by_autograd = sa.compile(m)
    got, trace_got = by_autograd(x, return_trace=True)
    (g_got,) = torch.autograd.grad(got.sum(), m.weights[0])
    assert (got - want).abs().max() < 1e-12
    assert (trace_got.free_energy - trace.free_energy).abs().max() < 1e-12
    assert (g_got - g_want).abs().max() < 1e-12
    for _ in range(3):
        by_autograd(x)
    plans = list(by_autograd.plans.values())
    assert plans and all(p.graph is None and "differentiates with autograd" in p.reason
                         for p in plans), plans
    x2 = torch.randn(2, 6, dtype=f64)
    assert (by_autograd(x2) - closed(x2)).abs().max() < 1e-12


@pytest.mark.parametrize("recipe, seed", [("library", 3), ("authors", 7)])
def test_a_replayed_plan_follows_new_inputs(recipe, seed):
    """Recorded once, the plan computes each new input's inference (no gradient of the
    recording call kept as a constant), in either recipe (the authors' sweep too)."""
    m = _network([6, 5, 3], 2, 1.0, "euclidean", 3, 0.1, seed, recipe=recipe)
    layer, reading = sa.compile(m), sa.compile(m, replay=False)
    xs = [torch.randn(2, 6, dtype=f64) for _ in range(5)]
    outs = [layer(x) for x in xs]
    assert all(p.graph is not None for p in layer.plans.values())
    for x, out in zip(xs, outs, strict=True):
        assert torch.equal(out, reading(x))


def test_learning_rule_is_the_gradient_of_the_authors_free_energy():
    """∂F/∂W at the relaxed states (the local rule the gallery trains with) is T times the
    gradient of the authors' F there."""
    m = _network([6, 5, 3], 3, 2.0, "euclidean", 5, 0.05, 4)
    x, y = torch.randn(4, 6, dtype=f64), torch.randn(4, 3, dtype=f64)
    layer = sa.compile(m)
    with torch.no_grad():
        _, trace = layer(x, y, return_trace=True)
    final = {k: s[-1] for k, s in trace.states.items()}
    got = torch.autograd.grad(layer.free_energy(x, y, latents=final).sum(), list(m.weights))
    states = [x, final["layer1"][..., 0, :], y]
    want = torch.autograd.grad(authors_free_energy(m, states).sum(), list(m.weights))
    for g, w in zip(got, want, strict=True):
        assert (g - 2.0 * w).abs().max() < 1e-10


def test_drawing_shows_the_predictions_as_deterministic(tmp_path):
    m = sa.models.predictor_choice_coding([6, 4, 3], predictors=3, steps=2)
    src = sa.model_graph(m).source
    assert "predictions0_i = f(layer1)" in src and "deterministic" in src
    assert src.count("style=dotted") >= 2 and "dotted: deterministic" in src
    sa.save(sa.model_graph(m, unrolled=True), tmp_path / "m.svg")


@pytest.mark.parametrize("kwargs, match", [
    ({"norm": "l1"}, r"norm must be one of \['euclidean', 'squared'\]; got 'l1'"),
    ({"temperature": 0.0}, r"temperature must be a finite number > 0; got 0.0"),
    ({"temperature": -1.0}, r"temperature must be a finite number > 0; got -1.0"),
    ({"layer_sizes": [4]}, r"layer_sizes must be a list of ≥ 2 positive ints"),
    ({"label_init": float("nan")}, r"label_init must be a finite number or None \(1/n_L\); "
                                   r"got nan"),
    ({"recipe": "paper"}, r"recipe must be one of \['library', 'authors'\]; got 'paper'"),
    ({"recipe": None}, r"recipe must be one of \['library', 'authors'\]; got None"),
])
def test_bad_settings_are_refused(kwargs, match):
    args = {"layer_sizes": [4, 3], **kwargs}
    with pytest.raises(ValueError, match=match):
        sa.models.predictor_choice_coding(args.pop("layer_sizes"), **args)


def test_bad_inputs_are_refused():
    layer = sa.compile(sa.models.predictor_choice_coding([4, 3, 2], steps=1))
    with pytest.raises(ValueError, match=r"x must have shape \(\*batch, 4\); got \(2, 5\)"):
        layer(torch.randn(2, 5))
    with pytest.raises(ValueError, match=r"y must have shape \(2, 2\) .*; got \(2, 3\)"):
        layer(torch.randn(2, 4), torch.randn(2, 3))
    with pytest.raises(ValueError, match=r"x: .*float64.*float32|dtype"):
        layer(torch.randn(2, 4, dtype=f64))


# -- recipe="authors": the authors' schedule, step for step ----------------------------------
def authors_infer_by_hand(m, x, y, steps, dt, differentiable=False):
    """The authors' ``PCN.infer`` (AttentionPCN, pcn.py) written out in their indexing: xs[0]
    the label, xs[L] the image; ``network[l − 1]`` predicts xs[l] from xs[l − 1] with the
    free energy of their ``AttentionLayer.free_energy_func`` (layers.py: torch.cdist, then
    −(1/T) logsumexp(−T·errs)). Start: the label (y, or ``label_init`` when inferred), the
    hidden layers propagated from it (their ``propagate_xs``: the mean prediction), the image.
    Each step: for l = L … 1 one vector-Jacobian product of F_l at (xs[l], xs[l − 1]), then
    xs[l] −= dt·∂F_l/∂xs[l] (never the image) and xs[l − 1] −= dt·∂F_l/∂xs[l − 1] (never a
    clamped label). Returns the states after each step, bottom-up like the library's
    (``differentiable``: the steps themselves differentiable, for the weights' gradient)."""
    L, T = len(m.layer_sizes) - 1, m.temperature
    weights = [m.weights[L - l] for l in range(1, L + 1)]  # their network[l − 1]

    def predictions(l, z):  # (B, K, n): their multiple_predictions, tanh, transposed
        return torch.stack([torch.tanh(z @ w.T) for w in weights[l - 1]], 1)

    def free_energy(l, xl, z):  # (B, 1)
        if differentiable:  # the same distances: cdist has no second derivative
            errs = torch.linalg.vector_norm(xl[:, None, :] - predictions(l, z), dim=-1)[:, None]
        else:
            errs = torch.cdist(xl[:, None, :], predictions(l, z))  # (B, 1, K)
        if m.norm == "squared":  # (not in their code: the squared error, for the other norm)
            errs = 0.5 * errs ** 2
        return -torch.logsumexp(-T * errs, dim=2) / T

    xs = [y if y is not None else x.new_full((x.shape[0], m.layer_sizes[L]), m.label_init)]
    for l in range(1, L):  # (not detached: the model's start follows the weights too)
        xs.append(predictions(l, xs[l - 1]).mean(1))
    xs.append(x)
    history = [xs[::-1]]
    for _ in range(steps):
        for l in reversed(range(1, L + 1)):
            _, (dx, dz) = torch.autograd.functional.vjp(
                lambda a, b, l=l: free_energy(l, a, b), (xs[l], xs[l - 1]),
                v=x.new_ones(x.shape[0], 1), create_graph=differentiable)
            if l != L:
                xs[l] = xs[l] - dt * dx
            if l == 1 and y is not None:
                continue
            xs[l - 1] = xs[l - 1] - dt * dz
        history.append(xs[::-1])
    return history


def _authors(sizes, K, T, norm, steps, dt, seed, **kw):
    return _network(sizes, K, T, norm, steps, dt, seed, recipe="authors", **kw)


@pytest.mark.parametrize("sizes", [[6, 4, 3], [7, 5, 4, 3], [5, 3]])
@pytest.mark.parametrize("norm", ["euclidean", "squared"])
@pytest.mark.parametrize("clamped", [True, False])
def test_authors_recipe_is_their_update_step_for_step(sizes, norm, clamped):
    """recipe="authors": the states after every one of 6 steps equal the authors' loop written
    out (their F by torch.cdist, their order, their vector-Jacobian products) to 1e-12, label
    clamped or free, in float64; the output is their label."""
    m = _authors(sizes, 3, 1.5, norm, 6, 0.1, 5)
    x = torch.randn(4, sizes[0], dtype=f64)
    y = torch.randn(4, sizes[-1], dtype=f64) if clamped else None
    L = len(sizes) - 1
    hand = authors_infer_by_hand(m, x, y, 6, 0.1)
    if clamped and L == 1:  # nothing latent
        assert torch.equal(sa.compile(m)(x, y), y)
        return
    out, trace = sa.compile(m)(x, y, return_trace=True)
    for l in range(1, L + (y is None)):
        got = trace.states[f"layer{l}"][..., 0, :]  # (steps + 1, B, n_l)
        want = torch.stack([h[l] for h in hand])
        assert (got - want).abs().max() < 1e-12, l
    assert (out - hand[-1][L]).abs().max() < 1e-12
    # with a hidden layer the schedules differ: the library's states end elsewhere; with the
    # label the one latent, both are plain gradient descent on F
    _, library = sa.compile(_network(sizes, 3, 1.5, norm, 6, 0.1, 5))(x, y, return_trace=True)
    name = "layer1" if L > 1 else f"layer{L}"
    gap = (library.states[name] - trace.states[name]).abs().max()
    assert gap > 1e-6 if L > 1 else gap < 1e-12


def test_authors_recipe_differentiates_through_their_steps():
    """Unrolled, the gradient of the label with respect to every weight is autograd's through
    their loop; grad="last" ends at the same states."""
    m = _authors([6, 5, 4], 3, 2.0, "euclidean", 4, 0.05, 6)
    x = torch.randn(3, 6, dtype=f64)
    out = sa.compile(m)(x)
    want = authors_infer_by_hand(m, x, None, 4, 0.05, differentiable=True)[-1][-1]
    assert (out - want).abs().max() < 1e-12
    got_g = torch.autograd.grad(out.square().sum(), list(m.weights))
    want_g = torch.autograd.grad(want.square().sum(), list(m.weights))
    for g, w in zip(got_g, want_g, strict=True):
        assert (g - w).abs().max() < 1e-12
    last = _authors([6, 5, 4], 3, 2.0, "euclidean", 4, 0.05, 6, grad="last")
    assert (sa.compile(last)(x) - out).abs().max() < 1e-12


@pytest.mark.parametrize("clamped", [True, False])
def test_library_recipe_is_the_default_bit_for_bit(clamped):
    """recipe="library" is the model without the argument: the same states at every step, the
    same output and the same weight gradients, bit for bit."""
    x = torch.randn(3, 6, dtype=f64)
    y = torch.randn(3, 3, dtype=f64) if clamped else None
    runs = []
    for kw in ({}, {"recipe": "library"}):
        torch.manual_seed(8)
        m = sa.models.predictor_choice_coding([6, 5, 4, 3], predictors=3, temperature=1.5,
                                              steps=4, step_size=0.05, dtype=f64, **kw)
        out, trace = sa.compile(m)(x, y, return_trace=True)
        loss = trace.states["layer1"][-1].square().sum()
        runs.append((out, trace, torch.autograd.grad(loss, list(m.weights), allow_unused=True)))
    (out_a, trace_a, g_a), (out_b, trace_b, g_b) = runs
    assert torch.equal(out_a, out_b)
    assert trace_a.states.keys() == trace_b.states.keys()
    assert all(torch.equal(trace_a.states[k], trace_b.states[k]) for k in trace_a.states)
    assert torch.equal(trace_a.free_energy, trace_b.free_energy)
    for a, b in zip(g_a, g_b, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
