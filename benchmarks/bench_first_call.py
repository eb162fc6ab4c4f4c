"""What the first calls of a new input signature cost, against one reading of the declaration.

A compiled module reads a signature's first call, records a plan on its second (traced once
by ``make_fx``, then the graph run once to check its torch bindings, that run's outputs
serving the call) and replays the plan after (``structattn/compiling/replay.py``). Per layer,
in one run, medians of ``--repeats``:

- ``reading``: ``layer.interpret(x)``, the declaration read from scratch (what a first call
  costs);
- ``recording``: the recording call, its plans dropped before each (``reset``), so each one
  records anew — in a process that recorded the same call structures before (the bindings'
  verdicts known: ``structattn.plans.record._BINDS``) — and ``first recording``, the very
  first recording in the process (the bindings checked by running each beside its overload);
- ``replay``: a later call of the signature.

``recording / reading`` is what the issue calls readings: ≤ 2 where the tensor work
dominates (large sizes); at small sizes the tracer's own Python cost shows. Forward under
``torch.no_grad()`` and with autograd (``forward_grad``). Run:
``python benchmarks/bench_first_call.py [--quick] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import _results  # noqa: E402  (this script's own folder)

import structattn as sa  # noqa: E402
from structattn.plans import record as _record  # noqa: E402


def _median(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _recording(layer, inputs: tuple) -> float:
    """One recording call's seconds: the plans dropped, the signature read once, then the
    call that records timed."""
    layer.reset()
    layer(*inputs)  # the reading (record_after = 1)
    t = time.perf_counter()
    layer(*inputs)
    return time.perf_counter() - t


def measure(name: str, model, inputs: tuple, repeats: int, grad: bool, log) -> dict:
    """The reading, the recording call (first in the process, then later ones) and the
    replay of ``model`` compiled, on ``inputs``."""
    layer = sa.compile(model)
    with torch.enable_grad() if grad else torch.no_grad():
        _record._BINDS.clear()  # as in a fresh process
        first = _recording(layer, inputs)
        read = _median(lambda: layer.interpret(*inputs), repeats)
        rec = statistics.median(_recording(layer, inputs) for _ in range(repeats))
        layer(*inputs)
        replay = _median(lambda: layer(*inputs), repeats)
    log(f"{name:44s} {'grad' if grad else 'no_grad':7s} reading {read * 1e3:8.2f} ms  "
        f"recording {rec * 1e3:8.2f} ms ({rec / read:5.2f}×; the first in the process "
        f"{first / read:5.2f}×)  replay {replay * 1e3:8.2f} ms")
    return {"reading_s": read, "recording_s": rec, "first_recording_s": first,
            "replay_s": replay, "recording_over_reading": rec / read,
            "first_recording_over_reading": first / read}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a tiny size, one repeat (smoke test)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    sizes = [(1, 16, 64, 1), (8, 1024, 256, 4)] if not args.quick else [(1, 16, 64, 1)]
    repeats = 1 if args.quick else args.repeats
    log = print
    log(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, CPU")
    rows = {}
    for B, N, d, H in sizes:
        torch.manual_seed(0)
        x = torch.randn(B, N, d, requires_grad=True)
        r = torch.randn(B, 4, d, requires_grad=True)
        cases = {f"self-attention B={B} N={N} d={d} H={H}":
                     (sa.models.self_attention(d, heads=H), (x,)),
                 f"causal self-attention B={B} N={N} d={d} H={H}":
                     (sa.models.self_attention(d, heads=H, causal=True), (x,)),
                 f"Hopfield T=3 B={B} M=4 N={N} d={d}":
                     (sa.models.hopfield(d, d, iteration=sa.IterationOptions(steps=3)), (r, x))}
        for name, (model, inputs) in cases.items():
            for grad in (False, True):
                rows[f"{name}, {'grad' if grad else 'no_grad'}"] = measure(
                    name, model, inputs, repeats, grad, log)
    results = {"config": {"sizes": sizes, "repeats": repeats}, "rows": rows}
    _results.save("first_call", results, args.json, quick=args.quick)
    return results


if __name__ == "__main__":
    main()
