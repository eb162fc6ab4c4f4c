"""Queued verdicts (``structattn.checking.verdicts``): on a GPU a replayed call's checks are read once
the GPU has run it, and a failed one raises at the next call of its layer or at
``structattn.raise_pending()``, naming the argument. The queue is device-agnostic but for the
copy and the event; here the CPU stands in for the GPU (its verdicts are ready at once), and
tests/test_cuda.py checks the same on CUDA, with a synchronisation made an error."""

import threading

import pytest
import torch

import structattn as sa
from structattn.checking import verdicts


@pytest.fixture
def queued_on_cpu():
    verdicts.DEVICES.add("cpu")  # in place: the replay holds the set
    try:
        yield
    finally:
        verdicts.DEVICES.discard("cpu")
        sa.set_validation(True, queued=True)


def _replayed(x, **kw):
    layer = sa.compile(sa.models.self_attention(7, d_k=3, heads=2, **kw))
    for _ in range(3):  # read, record, replay
        layer(x)
    return layer


def _nan(x, at=(1, 2, 3)):
    bad = x.clone()
    bad[at] = float("nan")
    return bad


def test_a_bad_input_raises_at_the_next_call_naming_it(queued_on_cpu):
    x = torch.randn(2, 5, 7)
    layer = _replayed(x)
    out = layer(_nan(x))  # the bad call returns what was computed
    assert torch.isnan(out).any()
    with pytest.raises(ValueError, match=r"'x' contains non-finite values .* the first at index "
                                         r"\(1, 2, 3\)") as err:
        layer(x)
    assert "belongs to an earlier call" in "".join(err.value.__notes__)
    torch.testing.assert_close(layer(x), layer(x))  # settled: the layer goes on


def test_raise_pending_raises_the_failed_check_now(queued_on_cpu):
    x = torch.randn(2, 5, 7)
    layer = _replayed(x)
    layer(_nan(x, (0, 4, 0)))
    with pytest.raises(ValueError, match=r"the first at index \(0, 4, 0\)"):
        sa.raise_pending()
    sa.raise_pending()  # nothing left
    layer(x)


def test_queued_false_reads_each_verdict_in_its_call(queued_on_cpu):
    sa.set_validation(True, queued=False)
    x = torch.randn(2, 5, 7)
    layer = _replayed(x)
    with pytest.raises(ValueError, match=r"contains non-finite values") as err:
        layer(_nan(x))
    assert not getattr(err.value, "__notes__", None)
    assert not layer._plans.verdicts.queue


def test_an_input_changed_in_place_since_gets_a_general_error(queued_on_cpu):
    x = torch.randn(2, 5, 7)
    layer = _replayed(x)
    bad = _nan(x)
    layer(bad)
    bad.copy_(x)  # the buffer reused before the verdict was read
    with pytest.raises(ValueError, match=r"^SelfAttention: a value check failed on an earlier "
                                         r"call, whose inputs have changed since"):
        layer(x)


def test_a_parameter_turned_nan_raises_naming_it(queued_on_cpu):
    x = torch.randn(2, 5, 7)
    layer = _replayed(x)
    with torch.no_grad():
        layer.declaration.W_k.view(-1)[4] = float("nan")
    layer(x)  # its check is queued: the call returns
    with pytest.raises(ValueError, match=r"parameter 'W_k' of SelfAttention contains "
                                         r"non-finite values"):
        sa.raise_pending()
    with pytest.raises(ValueError, match=r"parameter 'W_k'"):  # and again while it is so
        layer(x)
        sa.raise_pending()


def test_the_queue_is_bounded(queued_on_cpu, monkeypatch):
    """At most DEPTH calls in flight per module: the oldest is waited for (here: ready)."""
    seen = []
    real = verdicts.Verdicts.settle

    def settle(self, wait=False):
        seen.append(len(self.queue))
        return real(self, wait)

    monkeypatch.setattr(verdicts.Verdicts, "settle", settle)
    x = torch.randn(2, 5, 7)
    layer = _replayed(x)
    for _ in range(10):
        layer(x)
    assert max(seen) <= verdicts.DEPTH + 1
    assert len(layer._plans.verdicts.queue) <= verdicts.DEPTH


def test_threads_share_a_queue(queued_on_cpu):
    x = torch.randn(2, 5, 7)
    layer = _replayed(x)
    errors = []

    def work():
        try:
            for _ in range(50):
                layer(x)
        except Exception as err:  # noqa: BLE001 — any error fails the test below
            errors.append(err)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    sa.raise_pending()
    assert not layer._plans.verdicts.queue


def test_off_the_gpu_nothing_is_queued():
    x = torch.randn(2, 5, 7)
    layer = _replayed(x)
    with pytest.raises(ValueError, match=r"contains non-finite values"):
        layer(_nan(x))
    assert not layer._plans.verdicts.queue
