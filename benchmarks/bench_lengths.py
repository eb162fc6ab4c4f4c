"""Many sequence lengths: 200 calls over 100 lengths, compiled layers vs a hand-written module.

A compiled module records a plan per input signature, and a signature includes the sequence
length; once two lengths have plans, one plan with symbolic sizes serves every further
length (``sa.compile(model, dynamic=True)``, the default). This measures a stream of calls
whose lengths vary — each of 100 lengths twice, in a shuffled order — through:

- a hand-written module (bias-free ``nn.Linear`` projections + ``F.scaled_dot_product_attention``,
  the same weight tensors);
- the compiled layer (``dynamic=True``): two plans of fixed sizes, then the symbolic plan;
- the compiled layer with ``dynamic=False``: a plan per length up to ``max_plans`` (32), every
  other length read from the declaration on every call.

Self-attention, causal, d_model=64, 4 heads, B=1, lengths 16..115, float32, forward, no_grad;
and forward+backward. Each round times the stream through fresh modules (their first calls
read and record, as a server's would), then another stream through the same modules, warm;
three rounds, medians.
Run: ``python benchmarks/bench_lengths.py [--quick] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import _results  # noqa: E402  (this script's own folder)
from bench_per_call import HandAttention  # noqa: E402  (this script's own folder)

import structattn as sa  # noqa: E402


def _stream(lengths, repeats, seed, d):
    order = [n for n in lengths for _ in range(repeats)]
    random.Random(seed).shuffle(order)
    return [torch.randn(1, n, d) for n in order]


def _time(fn, xs, backward: bool) -> float:
    """Seconds for the whole stream."""
    t0 = time.perf_counter()
    for x in xs:
        if backward:
            fn(x).sum().backward()
        else:
            with torch.no_grad():
                fn(x)
    return time.perf_counter() - t0


def run(cfg) -> dict:
    torch.manual_seed(0)
    m = sa.models.self_attention(cfg["d"], heads=cfg["heads"], causal=True)
    hand = HandAttention(m)
    hand.forward = _causal(hand)
    out = {"config": cfg}
    for backward in (False, True):
        what = "fwd+bwd" if backward else "forward"
        names = ("hand-written", "structattn", "structattn, dynamic=False")
        times = {(stream, name): [] for stream in ("first", "again") for name in names}
        for r in range(cfg["rounds"]):
            variants = [("hand-written", hand),
                        ("structattn", sa.compile(m)),
                        ("structattn, dynamic=False", sa.compile(m, dynamic=False))]
            for stream in ("first", "again"):  # fresh modules, then the same ones warm
                xs = _stream(cfg["lengths"], cfg["repeats"], 2 * r + (stream == "again"),
                             cfg["d"])
                for name, fn in (variants if r % 2 == 0 else variants[::-1]):
                    times[stream, name].append(_time(fn, xs, backward))
        calls = len(cfg["lengths"]) * cfg["repeats"]
        rows = {}
        for stream in ("first", "again"):
            base = statistics.median(times[stream, "hand-written"])
            how = ("fresh modules (reading and recording included)" if stream == "first"
                   else "the same modules again")
            print(f"{what}, {calls} calls over {len(cfg['lengths'])} lengths, {how}:")
            for name in names:
                med = statistics.median(times[stream, name])
                rows[f"{stream}: {name}"] = {"seconds": med, "per_call_us": med / calls * 1e6,
                                             "ratio": med / base}
                print(f"    {name:28s} {med * 1e3:9.1f} ms  {med / calls * 1e6:8.1f} µs/call  "
                      f"{med / base:6.2f}×")
        out[what] = rows
    return out


def _causal(hand):
    """The hand-written module, causal (``is_causal=True`` in its SDPA call)."""
    import torch.nn.functional as F

    def forward(x):
        H = hand.heads
        q, k, v = (sa.split_heads(lin(x), H) for lin in (hand.q, hand.k, hand.v))
        y = F.scaled_dot_product_attention(q, k, v, scale=hand.scale, is_causal=True)
        return hand.o(sa.merge_heads(y))
    return forward


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="few lengths (smoke test)")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    cfg = dict(d=64, heads=4, lengths=list(range(16, 116)), repeats=2, rounds=3)
    if args.quick:
        cfg.update(lengths=list(range(8, 14)), rounds=1)
    torch.set_num_threads(torch.get_num_threads())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, CPU")
    results = run(cfg)
    written = _results.save("lengths", results, args.json, quick=args.quick)
    if written:
        print(f"results written to {written}")


if __name__ == "__main__":
    main()
