"""What no parameter edit and no thread may break in a compiled module's plans
(structattn/compiling/replay.py).

- A plan folds what depends on the parameters alone and checks the parameters once per change
  of them. ``p.data = …`` and ``torch.nn.utils.vector_to_parameters`` (EMA weights, weight
  averaging, meta-learning) replace a parameter's values without moving its version counter:
  the next call must still give what a fresh reading gives, or raise its error.
- Threads making their first calls together (an inference server) must each get a recorded
  plan and the reading's values, with separate layers and with one shared layer.
"""

import threading

import pytest
import torch

import structattn as sa

from ..registry import CASES
from .test_replay import NOT_REPLAYED, _leaves_equal


def _outcome(call):
    """``("value", output)`` or ``("error", type, message)`` of ``call()``, seeded."""
    torch.manual_seed(1)
    try:
        return ("value", call())
    except Exception as err:  # the reading's own refusal, compared by type and message
        return ("error", type(err), str(err))


def _same_outcome(got, want) -> bool:
    if got[0] != want[0]:
        return False
    if got[0] == "error":
        return got[1:] == want[1:]
    a, b = got[1], want[1]
    return _leaves_equal(a, b) or all(
        torch.equal(x, y) or (torch.isnan(x).any() and torch.allclose(x, y, equal_nan=True))
        for x, y in zip(torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b),
                        strict=True) if isinstance(x, torch.Tensor))


def _edit_data(params, new):
    for p, v in zip(params, new, strict=True):
        p.data = v


def _edit_vector(params, new):
    torch.nn.utils.vector_to_parameters(torch.cat([v.reshape(-1) for v in new]), params)


EDITS = {"data": _edit_data, "vector_to_parameters": _edit_vector}


def _floating_parameters(model):
    return [p for p in model.parameters() if p.is_floating_point()]


@pytest.mark.parametrize("edit", sorted(EDITS))
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_an_edit_that_keeps_the_version_counter_is_seen(case, grad, edit):
    """Three warm calls (read, record, replay), then every parameter += N(0, 0.5²) through an
    edit that leaves ``_version`` alone: the call equals a fresh reading bit for bit."""
    model, inputs = CASES[case]()
    params = _floating_parameters(model)
    if not params:
        pytest.skip(f"{case} has no floating parameter")
    layer = sa.compile(model)
    with torch.set_grad_enabled(grad):
        for _ in range(3):
            torch.manual_seed(1)
            layer(*inputs)
        versions = [p._version for p in params]
        g = torch.Generator().manual_seed(7)
        EDITS[edit](params, [p.detach() + 0.5 * torch.randn(p.shape, generator=g, dtype=p.dtype)
                             for p in params])
        assert [p._version for p in params] == versions  # the edit the counter cannot see
        for _ in range(2):
            got = _outcome(lambda: layer(*inputs))
            want = _outcome(lambda: layer.interpret(*inputs))
            assert _same_outcome(got, want), (case, got[0], want[0])


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_nan_parameter_set_through_data_is_refused_as_a_fresh_layer_refuses_it(case):
    """Checks on: ``p.data = nan`` after warm calls gives the fresh reading's error (or, where
    the reading carries NaN, its output), never a stale plan's answer."""
    model, inputs = CASES[case]()
    params = _floating_parameters(model)
    if not params:
        pytest.skip(f"{case} has no floating parameter")
    layer = sa.compile(model)
    with torch.no_grad():
        for _ in range(3):
            torch.manual_seed(1)
            layer(*inputs)
        params[0].data = torch.full_like(params[0], float("nan"))
        got = _outcome(lambda: layer(*inputs))
        want = _outcome(lambda: sa.compile(model)(*inputs))
    assert _same_outcome(got, want), (case, got, want)
    assert got[0] == "error" or torch.isnan(torch.as_tensor(got[1][0] if isinstance(
        got[1], tuple) else got[1])).any(), case


def test_self_attention_names_the_parameter_a_data_edit_made_nan():
    m = sa.models.self_attention(8, d_k=4, heads=2, dtype=torch.float64)
    layer = sa.compile(m)
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    for _ in range(3):
        layer(x)
    m.W_q.data = torch.full_like(m.W_q, float("nan"))
    with pytest.raises(ValueError, match="W_q"):
        layer(x)


def test_two_edits_between_calls_are_seen():
    """Storage addresses may be reused after a storage is freed: two ``.data`` edits between
    calls (the second storage possibly where the first was) are still seen."""
    m = sa.models.relative_position_attention(8, d_k=4, heads=2, max_distance=3,
                                              dtype=torch.float64)
    layer = sa.compile(m)
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    with torch.no_grad():
        for step in range(20):
            for _ in range(2):
                m.position_logits.data = torch.randn_like(m.position_logits)
            torch.testing.assert_close(layer(x), layer.interpret(x), rtol=0, atol=0,
                                       msg=f"step {step}")


# -- threads ----------------------------------------------------------------------------------
THREADS = 8


def _inputs_for_grad(inputs):
    return tuple(x.detach().requires_grad_() if isinstance(x, torch.Tensor)
                 and x.is_floating_point() else x for x in inputs)


def _first(out):
    return out[0] if isinstance(out, tuple) else out


#: the models whose threads each get a layer of their own in the default run (every model
#: does under ``-m slow``; every model shares one layer in the default run): the recording
#: lock is the same for both, and a layer each costs 8 recordings per signature
EACH_LAYER_BY_DEFAULT = {"self_attention", "hopfield", "predictive_coding", "expanding_attention",
                         "stick_breaking_attention"}


def _thread_cases():
    for case in sorted(CASES):
        yield pytest.param(case, True, id=f"{case}-one_layer")
        slow = () if case in EACH_LAYER_BY_DEFAULT else (pytest.mark.slow,)
        yield pytest.param(case, False, id=f"{case}-a_layer_each", marks=slow)


@pytest.mark.parametrize("case, shared", list(_thread_cases()))
def test_first_calls_from_threads_released_together_record_and_agree(case, shared):
    """8 threads, released together by a barrier, make their first calls (forward, then
    forward+backward, three of each: read, record, replay): no call fails, every value and
    gradient equals one thread's reading, and every signature is recorded as in one thread."""
    model, inputs = CASES[case]()
    torch.manual_seed(1)
    want = _first(sa.compile(model).interpret(*inputs)).detach()
    layers = [sa.compile(model) for _ in range(1 if shared else THREADS)]
    barrier = threading.Barrier(THREADS)
    errors, values = [], []

    def work(i):
        layer = layers[i % len(layers)]
        barrier.wait()
        try:
            for _ in range(3):
                with torch.no_grad():
                    values.append(_first(layer(*inputs)))
            for _ in range(3):
                ins = _inputs_for_grad(inputs)
                out = _first(layer(*ins))
                out.sum().backward()
                values.append(out.detach())
        except Exception as err:  # collected: an exception in a thread fails nothing itself
            errors.append(f"{type(err).__name__}: {err}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert len(values) == 6 * THREADS
    if "slot" not in case:  # slot attention draws its initial slots: each call its own
        for v in values:
            torch.testing.assert_close(v, want, rtol=1e-12, atol=1e-12)
    plans = [p for layer in layers for p in layer.plans.values()]
    assert plans and all(len(layer.plans) == 2 for layer in layers)
    if CASES[case].model in NOT_REPLAYED and case == CASES[case].model:
        return
    assert all(p.graph is not None for p in plans), [p.reason for p in plans]
