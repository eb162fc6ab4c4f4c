"""A fixed-capacity cache's replayed step (the plan's generated call ``CacheStep`` and its
generated fast path) against the step read from the declaration every call
(``sa.compile(model, replay=False)``): the same outputs and cache to 1e-12 in float64, and the
calls the fast path must not serve — another batch, dtype, a hook, gradients — read as before."""

import importlib

import pytest
import torch

import structattn as sa
from structattn.decoding.step import _STEP

from .test_decode_fixed import _steps as _decode

MODELS = {"self_attention": lambda: sa.models.self_attention(8, causal=True, heads=2,
                                                            dtype=torch.float64),
          "forgetting_attention": lambda: sa.models.forgetting_attention(
              8, heads=2, dtype=torch.float64)}


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("validating", [True, False])
def test_the_replayed_step_is_the_step_read_every_call(name, validating):
    """Steps served by the fast path (no plan recorded after warm-up) give the outputs, the
    keys, values, prior state and lengths of the step read from the declaration each call,
    to 1e-12 in float64, checks on and off; and both are the full causal forward's rows."""
    torch.manual_seed(0)
    model = MODELS[name]()
    x = torch.randn(2, 14, 8, dtype=torch.float64)
    with sa.validation(validating):
        fast, cache = _decode(sa.compile(model), x, capacity=16)
        read, reference = _decode(sa.compile(model, replay=False), x, capacity=16)
    calls = sum(plan.calls for plan in cache.plans.values())
    assert calls >= x.shape[1] - 3 - 2  # every step after the two that record replayed
    assert reference.plans == {}
    torch.testing.assert_close(fast, read, rtol=0, atol=1e-12)
    for a, b in zip(cache.stores, reference.stores, strict=True):
        if a is None:
            assert b is None
        else:
            torch.testing.assert_close(a[..., :14, :] if a.dim() == 4 else a[..., :14],
                                       b[..., :14, :] if b.dim() == 4 else b[..., :14],
                                       rtol=0, atol=1e-12)
    assert torch.equal(cache.lengths, reference.lengths)
    with torch.no_grad():
        torch.testing.assert_close(fast, sa.compile(model)(x), rtol=0, atol=1e-10)


@pytest.mark.parametrize("name", MODELS)
def test_calls_the_fast_path_must_not_serve_are_read_as_before(name):
    """After warm-up: a hook is called; gradients flow (the step read with them, not the
    no-grad plan); float32 x_new is refused naming the dtype; another batch is refused
    naming the cache's; and the steps after them are still the reading's to 1e-12."""
    torch.manual_seed(1)
    model = MODELS[name]()
    layer, reading = sa.compile(model), sa.compile(model, replay=False)
    x = torch.randn(2, 12, 8, dtype=torch.float64)
    cache, reference = layer.new_cache(capacity=12), reading.new_cache(capacity=12)
    with torch.no_grad():
        for t in range(5):
            layer(x[:, t:t + 1], cache=cache)
            reading(x[:, t:t + 1], cache=reference)
        seen = []
        handle = layer.register_forward_hook(lambda *args: seen.append(1))
        a = layer(x[:, 5:6], cache=cache)
        handle.remove()
        assert seen == [1]
        with pytest.raises(ValueError, match="dtype"):
            layer(x[:, 6:7].float(), cache=cache)
        with pytest.raises(ValueError, match=r"batch shape must be the cache's"):
            layer(x[:1, 6:7], cache=cache)
    x_grad = x[:, 6:7].clone().requires_grad_(True)
    b = layer(x_grad, cache=cache)  # gradients on: not the no-grad plan's fast path
    assert b.requires_grad
    b.sum().backward()
    assert x_grad.grad is not None and torch.isfinite(x_grad.grad).all()
    with torch.no_grad():
        ys = [a, b.detach()] + [layer(x[:, t:t + 1], cache=cache) for t in range(7, 12)]
        zs = [reading(x[:, t:t + 1], cache=reference) for t in range(5, 12)]
    torch.testing.assert_close(torch.cat(ys, 1), torch.cat(zs, 1), rtol=0, atol=1e-12)


def test_the_step_options_are_known_by_identity_and_by_value():
    """A plan recorded with the step's read-only options serves a call passing them as the
    same object or as an equal plain dict, and refuses other options."""
    model = MODELS["self_attention"]()
    layer = sa.compile(model)
    x = torch.randn(1, 6, 8, dtype=torch.float64)
    _, cache = _decode(layer, x, capacity=8)
    reading, (keys, values, _) = cache._steps, cache.stores
    last = reading.plans._last
    x_new = torch.randn(1, 1, 8, dtype=torch.float64)
    lengths = cache.lengths.clone()
    with torch.no_grad():
        same = last.run(reading, (x_new, keys, values, lengths), _STEP[0])
        equal = last.run(reading, (x_new, keys, values, lengths), dict(_STEP[0]))
        other = last.run(reading, (x_new, keys, values, lengths),
                         {**_STEP[0], "return_posterior": True})
    assert type(same) is tuple and len(same) == 4
    assert all(torch.equal(a, b) for a, b in zip(same, equal, strict=True))
    assert other is not same and not isinstance(other, tuple)


@pytest.mark.parametrize("name", MODELS)
def test_after_warm_up_each_step_is_one_generated_call(name, monkeypatch):
    """After warm-up the layer's call serves a step in the function generated for its plan
    (``CacheStep``): ``read`` is never entered, the plan counts each step, and a NaN x_new
    is refused with the check's message, the cache's lengths unchanged."""
    read_module = importlib.import_module("structattn.decoding.read")  # (the package's
    # ``read`` is the function)
    torch.manual_seed(2)
    model = MODELS[name]()
    layer = sa.compile(model)
    x = torch.randn(2, 12, 8, dtype=torch.float64)
    _, cache = _decode(layer, x[:, :6], capacity=12)
    assert cache._step is not None
    entered = []
    real = read_module.read_fixed
    monkeypatch.setattr(read_module, "read_fixed",
                        lambda *a, **k: entered.append(1) or real(*a, **k))
    calls = sum(plan.calls for plan in cache.plans.values())
    with torch.no_grad():
        ys = [layer(x[:, t:t + 1], cache=cache) for t in range(6, 10)]
    assert entered == []
    assert sum(plan.calls for plan in cache.plans.values()) == calls + 4
    lengths = cache.lengths.clone()
    bad = x[:, 10:11].clone()
    bad[1, 0, 3] = float("nan")
    with torch.no_grad(), pytest.raises(ValueError, match="finite"):
        layer(bad, cache=cache)
    assert torch.equal(cache.lengths, lengths)
    with torch.no_grad():
        ys += [layer(x[:, t:t + 1], cache=cache) for t in range(10, 12)]
        full = sa.compile(model, replay=False)(x)
    torch.testing.assert_close(torch.cat(ys, 1), full[:, 6:], rtol=0, atol=1e-10)


def test_a_cache_of_another_batch_shape_is_not_served_by_a_flat_batchs_step():
    """Two caches of one layer and capacity share the step's plans; a cache whose batch is
    (2, 1) is not served by the function of a (2,)-batch cache's plan: its call with a flat
    x_new is refused naming the batch shape, and its own calls read the full forward's rows."""
    torch.manual_seed(3)
    model = MODELS["self_attention"]()
    layer = sa.compile(model)
    x = torch.randn(2, 8, 8, dtype=torch.float64)
    _, flat = _decode(layer, x[:, :6], capacity=8)
    nested = layer.new_cache(capacity=8)
    with torch.no_grad():
        layer(x[:, None, :5], cache=nested)
        nested._step = flat._step  # the flat cache's generated call, tried first
        with pytest.raises(ValueError, match="batch shape must be the cache's"):
            layer(x[:, 5:6], cache=nested)
        y = layer(x[:, None, 5:6], cache=nested)
    with torch.no_grad():
        full = sa.compile(model, replay=False)(x)
    torch.testing.assert_close(y[:, 0], full[:, 5:6], rtol=0, atol=1e-10)


@pytest.mark.parametrize("name", MODELS)
def test_the_steps_writes_are_bound_to_torch_and_keep_every_bit(name, monkeypatch):
    """The step's in-place writes (``aten.scatter_``) and aliases are called through their
    torch bindings (``Tensor.scatter_``, ``Tensor.view_as``) in the recorded plan, and the
    steps give the outputs and caches of a plan recorded without binding, bit for bit."""
    import structattn.plans.record as record

    torch.manual_seed(4)
    model = MODELS[name]()
    x = torch.randn(2, 10, 8, dtype=torch.float64)
    bound, cache = _decode(sa.compile(model), x, capacity=10)
    targets = [n.target for plan in cache.plans.values() if plan.graph is not None
               for n in plan.graph.graph.nodes]
    assert torch.Tensor.scatter_ in targets
    assert not any(isinstance(t, torch._ops.OpOverload) and t._schema.is_mutable
                   for t in targets)
    with monkeypatch.context() as patch:
        patch.setattr(record, "_bind_to_torch", lambda graph, args: None)
        unbound, reference = _decode(sa.compile(model), x, capacity=10)
    assert torch.equal(bound, unbound)
    for a, b in zip(cache.stores, reference.stores, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
