"""What one decoding step costs: a compiled causal layer's step against a fixed-capacity
cache (``layer.new_cache(capacity=L)``) vs a hand-written step over the same cache tensors.

The layers: causal self-attention and forgetting attention (FoX), small (d_model=64, 4 heads,
B=1, capacity L=256, a prefill of L/2). The hand-written step is what one writes around
PyTorch's SDPA with a preallocated cache (Hugging Face's ``StaticCache``): the projections
(``F.linear`` with the layer's own weight tensors), the new key and value written in place at
the row's length (``index_copy_``; FoX: its running sum of log forget gates too), and one
``F.scaled_dot_product_attention`` over the whole capacity with the slots beyond the length
masked out (FoX: c_i − c_j added to the mask), then W_O. Both read a tensor of lengths, so
neither reads a length on the host.

Each is timed eagerly (the layer: its recorded plan replayed, with structattn's value checks
on — the default — and off) and under ``torch.compile`` (a function doing one step, compiled
once; the layer's and the hand-written step alike), with dynamo's guards checked on every
call (the default) and skipped (``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``),
the outputs checked equal first.
Timing: the two run interleaved (order reversed each round), each round a block of steps;
medians over rounds and the median of the per-round ratios (``paired``; target ≤ 1.2×);
``--clock cpu`` times the process's CPU time (on a shared machine the time spent waiting for
a core is left out). Peak memory: the growth of the RSS high-water mark (CPU) or of the CUDA
allocator's peak over a block of steps. ``--quick`` (d_model=16, L=32, 3 rounds) compiles
with dynamo alone (``backend="eager"``: the same whole-graph trace, guards and stance, no
Inductor code, whose first compile on a machine takes ~15 s): it only checks that every path
runs (tests/test_decode_fixed.py compiles both layers' steps with Inductor). Run:
``python benchmarks/bench_decode.py [--quick] [--device cpu|cuda] [--clock wall|cpu]
[--threads N] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import _results  # noqa: E402  (this script's own folder)
from _device import cuda_peak_bytes, sync  # noqa: E402
from _memory import measure_peak_mib  # noqa: E402

import structattn as sa  # noqa: E402

TARGET = 1.2
#: how the layer's step runs: its plan replayed with structattn's value checks (the
#: default: x_new found finite, a sum per step), without them (``sa.validation(False)``),
#: compiled by torch.compile (where structattn's checks are not traced), and compiled with
#: dynamo's guards skipped while timed (``torch.compiler.set_stance(
#: skip_guard_eval_unsafe=True)``, PyTorch's setting for a decoding loop whose calls all
#: match the compiled one: what remains of the compiled step without the cost of checking
#: that each call is still the compiled one)
MODES = ("eager", "eager_unchecked", "compiled", "compiled_skip_guards")


class HandStep:
    """A step written by hand around SDPA over preallocated keys and values ``(B, H, L, d)``
    (and FoX's c ``(B, H, L)``), written in place at ``lengths`` (a tensor ``(B,)``; every row
    the same length here, as in a StaticCache)."""

    def __init__(self, model, B, L, like):
        H, self.model, self.L = model.heads, model, L
        kw = {"dtype": like.dtype, "device": like.device}
        self.keys = torch.zeros(B, H, L, model.d_k, **kw)
        self.values = torch.zeros(B, H, L, model.d_v, **kw)
        self.gate = torch.zeros(B, H, L, **kw) if hasattr(model, "W_f") else None
        self.lengths = torch.zeros(B, dtype=torch.long, device=like.device)
        self.slots = torch.arange(L, device=like.device)

    def __call__(self, x):  # x (B, 1, d)
        m, H = self.model, self.model.heads
        at = self.lengths[:1]  # (1,): the position every row writes
        q = sa.split_heads(F.linear(x, m.W_q), H)
        k = sa.split_heads(F.linear(x, m.W_k), H)
        v = sa.split_heads(F.linear(x, m.W_v), H)
        self.keys.index_copy_(2, at, k)
        self.values.index_copy_(2, at, v)
        seen = self.slots <= at  # (L,)
        mask = torch.zeros(seen.shape, dtype=x.dtype, device=x.device).masked_fill(
            ~seen, float("-inf"))[None, :]  # (1, L)
        if self.gate is not None:  # c_t = c_{t−1} + log f_t; logit c_t − c_j
            log_f = F.logsigmoid(F.linear(x, m.W_f, m.b_f)).movedim(-1, -2)  # (B, H, 1)
            prev = self.gate.index_select(2, (at - 1).clamp(min=0)) * (at > 0)
            c = prev + log_f
            self.gate.index_copy_(2, at, c)
            mask = mask + (c - self.gate).unsqueeze(-2)  # (B, H, 1, L)
        y = F.scaled_dot_product_attention(q, self.keys, self.values, attn_mask=mask,
                                           scale=1 / math.sqrt(m.d_k))
        self.lengths += 1
        return F.linear(sa.merge_heads(y), m.W_o)


def _layers(d, heads, dtype, device):
    kw = {"heads": heads, "dtype": dtype, "device": device}
    return {"self_attention": sa.models.self_attention(d, causal=True, **kw),
            "forgetting_attention": sa.models.forgetting_attention(d, **kw)}


def _pair(model, B, L, prefill, x, compiled: bool, backend: str = "inductor"):
    """The layer's step and the hand-written one, each after the same prefill, as two
    functions of x_new; compiled with torch.compile (``backend``) when asked."""
    layer = sa.compile(model)
    cache = layer.new_cache(capacity=L)
    hand = HandStep(model, B, L, x)
    with torch.no_grad():
        layer(x[:, :prefill], cache=cache)
        for t in range(prefill):
            hand(x[:, t:t + 1])

    def ours(x_new):
        return layer(x_new, cache=cache)

    if compiled:
        return (torch.compile(ours, fullgraph=True, backend=backend),
                torch.compile(hand, fullgraph=True, backend=backend), cache)
    return ours, hand, cache


def time_pair(fns: dict, x_new, rounds: int, block: int, device, clock=time.perf_counter
              ) -> dict:
    """Median seconds per step of each, and the median per-round ratio to ``"hand"``."""
    times = {k: [] for k in fns}
    names = list(fns)
    gc.disable()
    try:
        with torch.no_grad():
            for r in range(rounds):
                for name in (names if r % 2 == 0 else names[::-1]):
                    fn = fns[name]
                    sync(device)
                    t = clock()
                    for _ in range(block):
                        fn(x_new)
                    sync(device)
                    times[name].append((clock() - t) / block)
    finally:
        gc.enable()
    base = times["hand"]
    return {k: {"median_us": statistics.median(v) * 1e6,
                "paired": statistics.median(a / b for a, b in zip(v, base, strict=True))}
            for k, v in times.items()}


def peak(fn, x_new, steps: int, device) -> float:
    """MiB the peak grows by over ``steps`` steps."""
    def run():
        with torch.no_grad():
            for _ in range(steps):
                fn(x_new)
    if torch.device(device).type == "cuda":
        return cuda_peak_bytes(run, device) / 2 ** 20
    return measure_peak_mib(run)


def _stance(mode: str):
    """Where the mode skips dynamo's guards, PyTorch's stance that does; else nothing."""
    if mode == "compiled_skip_guards":
        return torch.compiler.set_stance(skip_guard_eval_unsafe=True)
    return contextlib.nullcontext()


def measure(model, name, mode, B, L, prefill, x, x_new, rounds, block, device, clock,
            backend="inductor") -> dict:
    """One row: the layer's step and the hand-written one after the same prefill, checked
    equal, warmed up, timed in pairs and their peak memory measured."""
    ours, hand, cache = _pair(model, B, L, prefill, x, mode.startswith("compiled"), backend)
    with torch.no_grad():  # the same step from the same cache: the same output
        a, b = ours(x[:, prefill:prefill + 1]), hand(x[:, prefill:prefill + 1])
        error = float((a - b).abs().max())
        assert error < 1e-4, (name, mode, error)
        for _ in range(2):  # the plan recorded, the compiled code warm
            ours(x_new)
            hand(x_new)
    plans = len(cache.plans)
    with _stance(mode):
        res = time_pair({"hand": hand, "structattn": ours}, x_new, rounds, block, device,
                        clock)
        mem = {k: peak(fn, x_new, block, device)
               for k, fn in (("hand", hand), ("structattn", ours))}
    return {"layer": name, "mode": mode, "backend": backend if mode.startswith("compiled")
            else None, "d_model": model.d_model, "heads": model.heads,
            "batch": B, "capacity": L, "prefill": prefill, "dtype": str(x.dtype),
            "hand_us": res["hand"]["median_us"], "structattn_us": res["structattn"]["median_us"],
            "paired_ratio": res["structattn"]["paired"], "target": TARGET,
            "peak_mib_hand": mem["hand"], "peak_mib_structattn": mem["structattn"],
            "max_abs_difference": error,
            "plans_recorded_while_timed": len(cache.plans) - plans}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default=None)
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="time the wall clock, or this process's CPU time (CPU only: on a "
                        "shared machine the time spent waiting for a core is left out)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch's CPU threads (default 1: a step this small runs on one)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    d, heads, B = (16, 2, 1) if args.quick else (64, 4, 1)
    L = 32 if args.quick else 256
    prefill = L // 2
    rounds = args.rounds or (3 if args.quick else 20)
    block = 2 if args.quick else 5
    # steps per variant: warm-up (3) + timing + the memory block must fit in L − prefill
    assert 3 + rounds * block + block <= L - prefill
    rows = []
    load = [os.getloadavg()[0]]  # the machine's 1-minute load, before and after
    for name, model in _layers(d, heads, torch.float32, device).items():
        x = torch.randn(B, L, d, device=device)
        x_new = torch.randn(B, 1, d, device=device)
        for mode in MODES:
            with sa.validation(mode != "eager_unchecked"):
                row = measure(model, name, mode, B, L, prefill, x, x_new, rounds, block, device,
                              time.process_time if args.clock == "cpu" else time.perf_counter,
                              "eager" if args.quick else "inductor")
            rows.append(row)
            verdict = "OK" if row["paired_ratio"] <= TARGET else "MISS"
            print(f"{name:22s} {mode:20s} hand {row['hand_us']:8.1f} µs  structattn "
                  f"{row['structattn_us']:8.1f} µs  paired {row['paired_ratio']:.3f}× "
                  f"(≤ {TARGET}: {verdict})  peak MiB {row['peak_mib_hand']:.2f} / "
                  f"{row['peak_mib_structattn']:.2f}", flush=True)
    load.append(os.getloadavg()[0])
    path = _results.save("decode", {"rows": rows, "rounds": rounds, "block": block,
                                    "clock": args.clock, "load_average": load},
                         args.json, quick=args.quick, device=device)
    if path:
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
