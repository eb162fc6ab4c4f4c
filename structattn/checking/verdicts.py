"""Value checks on a GPU, queued: a replayed call hands its checks' verdicts to the device's
stream and returns; the host reads them once the GPU has run the call.

A compiled module's plan computes each value check as a tensor (``structattn.compiling.replay``); on the
CPU the replay reads it at once. On CUDA reading it would wait for the GPU to finish the call
(one synchronisation per call: a launch-bound call pays its launches and the GPU's time one
after the other). Instead each replayed call copies its verdicts into pinned host memory
without waiting, records a CUDA event after the copy, and keeps the call's inputs. A verdict
is read when its event has passed:

- at the start of the next call of the same module — which raises, before its own work, the
  error of an earlier call that failed, re-reading that call's inputs so that the message is
  the check's own, naming the argument;
- at ``structattn.raise_pending()``, which waits for every queued verdict of every module;
- when a module holds ``DEPTH`` calls in flight, the oldest is waited for (each in flight
  holds a slot: pinned host memory and an event, made once and reused).

So a bad input raises at the latest at the first call of its layer after the next
synchronisation (``loss.item()``, ``torch.cuda.synchronize()``), or at ``raise_pending()``; the
bad call itself returns what the GPU computed. ``structattn.set_validation(True,
queued=False)`` reads every verdict in its own call instead. The first calls of a signature
(read from the declaration, then recorded) check in the call, as on the CPU.
"""

from __future__ import annotations

import collections
import threading
import weakref

import torch

from . import _validation

#: the device types whose verdicts are queued (the tests add "cpu" to exercise the queue)
DEVICES = {"cuda"}
#: calls of one module whose verdicts may be in flight before the oldest is waited for
DEPTH = 4

def queued_on(device: torch.device) -> bool:
    """Whether the verdicts of checks on ``device`` are queued (a GPU, while
    ``set_validation(queued=True)``), not read in the call."""
    return _validation._QUEUED and device.type in DEVICES


_holders: weakref.WeakSet = weakref.WeakSet()  # the queues that hold verdicts
_holders_lock = threading.Lock()


class _Done:
    """The event of a verdict that is on the host already (a CPU tensor)."""

    @staticmethod
    def query() -> bool:
        return True

    @staticmethod
    def synchronize() -> None:
        return None


_DONE = _Done()


class _Slot:
    """Where one call's verdicts land: pinned host copies and a CUDA event, made once and
    reused once read (a pinned allocation and an event per call cost more than the copy)."""

    __slots__ = ("host", "event", "device")

    def __init__(self):
        self.host, self.event, self.device = None, None, None

    def fill(self, flags) -> tuple:
        """Copy ``flags`` to the host without waiting; ``(host copies, event)``."""
        device = flags[0].device
        host = self.host
        if host is None or len(host) != len(flags) or any(
                h.dtype != f.dtype for h, f in zip(host, flags, strict=True)):
            host = self.host = [torch.empty((), dtype=f.dtype, pin_memory=True) for f in flags]
        for h, f in zip(host, flags, strict=True):
            h.copy_(f, non_blocking=True)
        if self.event is None or self.device != device:
            self.event, self.device = torch.cuda.Event(), device
        self.event.record(torch.cuda.current_stream(device))
        return host, self.event


class Verdicts:
    """One compiled module's queued verdicts: ``(event, host copies, what raises the error,
    slot)`` per call, oldest first; at most ``DEPTH`` in flight."""

    __slots__ = ("queue", "lock", "free", "made", "__weakref__")

    def __init__(self):
        self.queue: collections.deque = collections.deque()
        self.lock = threading.Lock()
        self.free: list = []  # slots read and free again
        self.made = 0

    def __reduce__(self):  # a copy or a pickle starts empty, as the plans do
        return (Verdicts, ())

    def put(self, flags, fail) -> None:
        """Queue verdicts ``flags`` (device tensors, each read by ``_validation.verdict``: a
        sum that must be finite or a boolean), copied to the host in their dtypes without
        waiting; ``fail()`` raises their error (``call_failed``, ``parameters_failed``). With
        ``DEPTH`` in flight, the oldest is waited for first."""
        while True:
            with self.lock:
                slot = self.free.pop() if self.free else None
                if slot is None and self.made < DEPTH:
                    slot, self.made = _Slot(), self.made + 1
                oldest = self.queue[0][0] if slot is None and self.queue else None
            if slot is not None:
                break
            if oldest is not None:
                oldest.synchronize()
            self.settle()  # frees the oldest's slot (or raises its error)
        if flags[0].device.type == "cuda":
            host, event = slot.fill(flags)
        else:  # a device without streams (the CPU, in the tests): read when settled
            host, event = list(flags), _DONE
        with self.lock:
            self.queue.append((event, host, fail, slot))
            first = len(self.queue) == 1
        if first:
            with _holders_lock:
                _holders.add(self)

    def settle(self, wait: bool = False) -> None:
        """Read the verdicts whose events have passed (``wait``: all of them, waiting), oldest
        first; a failed one raises its call's error."""
        while True:
            with self.lock:
                if not self.queue:
                    return
                entry = self.queue[0]
                if wait:
                    entry[0].synchronize()
                elif not entry[0].query():
                    return
                self.queue.popleft()
            event, host, fail, slot = entry
            passed = all(_validation.verdict(h) for h in host)
            with self.lock:
                self.free.append(slot)
            if not passed:
                fail()


NOTE = ("structattn: this error belongs to an earlier call of this layer. On a GPU the checks' "
        "verdicts are queued and read once the GPU has run the call (at the next call of the "
        "layer, or structattn.raise_pending()); structattn.set_validation(True, queued=False) "
        "reads each in its own call.")


def call_failed(read, layer, inputs: tuple, kwargs: dict) -> None:
    """The error of an earlier call whose check failed: ``read(layer, inputs, kwargs)``, the
    declaration read again on its inputs, checked, raises the check's own message (a note
    added: which call it belongs to)."""
    try:
        read(layer, inputs, kwargs)
    except Exception as err:
        err.add_note(NOTE)
        raise
    err = ValueError(f"{type(layer.declaration).__name__}: a value check failed on an earlier "
                     f"call, whose inputs have changed since (written in place), so the check "
                     f"cannot name what failed; structattn.set_validation(True, queued=False) "
                     f"raises it in the call that fails")
    err.add_note(NOTE)
    raise err


def parameters_failed(module) -> None:
    """The error of a parameter found non-finite by a queued check: the first such parameter
    of ``module`` named."""
    try:
        _validation.check_parameters(module)
    except ValueError as err:
        err.add_note(NOTE)
        raise
    err = ValueError(f"{type(module).__name__}: a parameter was non-finite at an earlier call "
                     f"and has been replaced since; structattn.set_validation(True, "
                     f"queued=False) raises it in the call that meets it")
    err.add_note(NOTE)
    raise err


def raise_pending() -> None:
    """Wait for the queued verdicts of every compiled module's calls on a GPU and raise the
    first failed check's error (naming the argument); return when all passed.

    Calls the GPU has run are read at the next call of their layer anyway: this finds them
    now, e.g. at the end of a training step or in a test. Nothing is queued on the CPU or
    with ``structattn.set_validation(True, queued=False)``, and then it returns at once.

    Raises:
        ValueError: when a queued check failed: the check's own error, raised again by
            re-reading the failed call's inputs or naming the non-finite parameter (or, when
            those have been overwritten since, an error that says so), with a note that it
            belongs to an earlier call.
    """
    with _holders_lock:
        holders = list(_holders)
    for verdicts in holders:
        verdicts.settle(wait=True)
