"""The recording call is served by its own recording (``structattn.plans.plan.serve``): the
declaration is read once (traced) and the graph run once (the check of its bindings, whose
outputs are the call's), with no replay after; random draws are the ones a replay makes, so
a seed fixes them, and a plan that serves nothing after all puts the generators back."""

import threading

import pytest
import torch

import structattn as sa
from structattn.plans import plan as plan_module
from structattn.plans import record as record_module

from ..registry import CASES


def _counting(monkeypatch, layer):
    """Counts of the layer's readings and of the plans' replays, as they happen."""
    counts = {"read": 0, "replay": 0}
    interpret, replay = layer.interpret, plan_module.replay

    def counted_interpret(*args, **kwargs):
        counts["read"] += 1
        return interpret(*args, **kwargs)

    def counted_replay(*args, **kwargs):
        counts["replay"] += 1
        return replay(*args, **kwargs)

    monkeypatch.setattr(layer, "interpret", counted_interpret)
    monkeypatch.setattr(plan_module, "replay", counted_replay)
    return counts


def test_the_recording_call_reads_once_and_replays_nothing(monkeypatch):
    model, inputs = CASES["self_attention"]()
    layer = sa.compile(model)
    counts = _counting(monkeypatch, layer)
    first = layer(*inputs)  # a reading
    assert counts == {"read": 1, "replay": 0}
    second = layer(*inputs)  # recorded: traced once, served by the recording's own run
    assert counts == {"read": 2, "replay": 0}
    plan = next(iter(layer.plans.values()))
    assert plan.graph is not None and plan.served is None and plan.calls == 1
    third = layer(*inputs)  # replayed (the fast path: no ``replay`` call, no reading)
    assert counts["read"] == 2 and plan.calls == 2
    assert torch.equal(first, second) and torch.equal(second, third)


def _is_fake(x) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(x, FakeTensor)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_recording_call_computes_once(monkeypatch, case):
    """The recording traces the reading on fake tensors (no tensor work) and computes the
    call once, in the graph's run that checks its bindings: the call costs one reading's
    tensor work and the tracer's Python (``benchmarks/bench_first_call.py``)."""
    model, inputs = CASES[case]()
    layer = sa.compile(model)
    readings = []
    interpret = layer.interpret

    def counted_interpret(*args, **kwargs):
        readings.append(any(_is_fake(x) for x in args))
        return interpret(*args, **kwargs)

    monkeypatch.setattr(layer, "interpret", counted_interpret)
    with torch.no_grad():
        layer(*inputs)
        layer(*inputs)
    (plan,) = layer.plans.values()
    if plan.graph is None:  # a reading of tensor values: read every call, its reason says why
        assert plan.reason and readings[1:2] == [True]
        return
    assert plan.traced == "fake" and readings == [False, True], (plan.traced, readings)


def test_the_recording_call_keeps_its_gradient():
    model, inputs = CASES["hopfield"]()
    layer = sa.compile(model)
    params = [p for p in layer.parameters() if p.requires_grad]
    grads = []
    for _ in range(3):  # read, record (served), replay
        out = layer(*inputs)
        grads.append(torch.autograd.grad(out.sum(), params, allow_unused=True))
    assert next(iter(layer.plans.values())).graph is not None
    for g in grads[1:]:
        assert all((a is None and b is None) or torch.equal(a, b)
                   for a, b in zip(g, grads[0], strict=True))


def test_the_recording_call_draws_what_a_reading_draws():
    model, (x, _) = CASES["slot_attention"]()
    inputs = (x,)  # no initial slots: each call draws them
    layer = sa.compile(model)
    torch.manual_seed(3)
    seeded = torch.get_rng_state()
    read = layer.interpret(*inputs)
    assert not torch.equal(torch.get_rng_state(), seeded)  # the reading draws
    after_read = torch.rand(4)
    layer(*inputs)  # the first call: read
    torch.manual_seed(3)
    recorded = layer(*inputs)  # the recording call, served
    after_recorded = torch.rand(4)
    plan = next(iter(layer.plans.values()))
    assert plan.graph is not None and plan.calls == 1
    assert torch.equal(recorded, read)  # the slots drawn are the reading's
    assert torch.equal(after_recorded, after_read)  # and the generator moved as far
    torch.manual_seed(3)
    assert torch.equal(layer(*inputs), read) and torch.equal(torch.rand(4), after_read)


def test_a_withdrawn_recording_puts_the_generators_back():
    model, (x, _) = CASES["slot_attention"]()
    inputs = (x,)  # no initial slots: the recording draws them
    layer = sa.compile(model)
    state = layer._plans.state(layer.declaration)
    names = layer._plans.names(layer.declaration)
    torch.manual_seed(5)
    before = torch.get_rng_state()
    plan = record_module.record(layer, names, state, tuple(inputs), {})
    assert plan.served is not None and not torch.equal(torch.get_rng_state(), before)
    record_module.withdraw(plan)
    assert plan.served is None and torch.equal(torch.get_rng_state(), before)


def test_only_the_recording_call_is_served_its_outputs():
    """Another call that finds the plan before the recording call serves it (another thread)
    is replayed on its own tensors."""
    model, (x,) = CASES["self_attention"]()
    layer = sa.compile(model)
    state = layer._plans.state(layer.declaration)
    names = layer._plans.names(layer.declaration)
    plan = record_module.record(layer, names, state, (x,), {})
    other = torch.randn_like(x)
    got = plan_module.serve(plan, state, (other,))
    assert plan.served is not None  # still the recording call's
    assert torch.equal(got, layer.interpret(other))
    assert torch.equal(plan_module.serve(plan, state, (x,)), layer.interpret(x))
    assert plan.served is None


def test_threads_recording_at_once_each_get_their_own_output():
    model, (x,) = CASES["self_attention"]()
    layer = sa.compile(model, max_plans=4)
    xs = [torch.randn_like(x) for _ in range(6)]
    for t in xs[:1]:
        layer(t)  # read once: the next call of the signature records
    got = [None] * len(xs)
    start = threading.Barrier(len(xs))

    def call(i):
        start.wait()
        got[i] = layer(xs[i])

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for t, y in zip(xs, got, strict=True):
        assert torch.equal(y, layer.interpret(t))
