#!/usr/bin/env python
"""Benchmark: rotary self attention compiled from ``sa.models.rope_attention`` against RoPE
written by hand around ``F.scaled_dot_product_attention``, on the same weights.

The hand-written layer is RoPE as GPT-NeoX and LLaMA write it — the "rotate half" layout,
θ_k = base^(−2k/d), its cos/sin tables computed once and cached (the compiled layer computes
them on each call) — then causal SDPA and the output projection. Reported per size: the
forward outputs' largest difference, forward + backward time (loss = output.sum(), gradients
to the weights and x; warmed up, interleaved rounds, medians and the median of the per-round
ratios; target ≤ 1.05) and the peak of live tensor bytes under ``torch.profiler`` (target
≤ 1.1).

Usage::

    python benchmarks/bench_rope.py            # full run, writes benchmarks/results/rope.json
    python benchmarks/bench_rope.py --quick    # a smoke test at tiny sizes (writes nothing)
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _results  # noqa: E402
from bench_attention import _profiler_peak_bytes, _verdict, time_interleaved  # noqa: E402

import structattn as sa  # noqa: E402

TIME_TARGET = 1.05
MEM_TARGET = 1.10
FULL = [dict(batch=8, heads=8, n=1024, d_k=64), dict(batch=1, heads=8, n=4096, d_k=64)]
QUICK = [dict(batch=2, heads=2, n=64, d_k=16)]


class HandWrittenRoPE:
    """RoPE around SDPA as common implementations write it, reading the model's weights."""

    def __init__(self, m, base: float):
        self.m, self.base, self.cache = m, base, {}

    def tables(self, n, like):
        key = (n, like.device, like.dtype)
        if key not in self.cache:  # computed once per length, as a rotary-embedding module does
            d = self.m.d_k
            inv_freq = 1.0 / (self.base ** (torch.arange(0, d, 2, dtype=torch.float64,
                                                         device=like.device) / d))
            freqs = torch.outer(torch.arange(n, dtype=torch.float64, device=like.device),
                                inv_freq)
            emb = torch.cat([freqs, freqs], -1)
            self.cache[key] = (emb.cos().to(like.dtype), emb.sin().to(like.dtype))
        return self.cache[key]

    @staticmethod
    def rotate_half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([-x2, x1], dim=-1)

    def __call__(self, x):
        m = self.m
        H, d = m.heads, m.d_k
        q = (x @ m.W_q.T).unflatten(-1, (H, d)).transpose(-3, -2)
        k = (x @ m.W_k.T).unflatten(-1, (H, d)).transpose(-3, -2)
        v = (x @ m.W_v.T).unflatten(-1, (H, m.d_v)).transpose(-3, -2)
        cos, sin = self.tables(x.shape[-2], x)
        q = q * cos + self.rotate_half(q) * sin
        k = k * cos + self.rotate_half(k) * sin
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1 / math.sqrt(d))
        return o.transpose(-3, -2).flatten(-2) @ m.W_o.T


def measure(cfg: dict, seed: int, warmup: int, repeats: int, device: str, log) -> dict:
    torch.manual_seed(seed)
    d_model = cfg["heads"] * cfg["d_k"]
    m = sa.models.rope_attention(d_model, heads=cfg["heads"], d_k=cfg["d_k"], d_v=cfg["d_k"],
                                 rope_base=10000.0, device=device)
    layer = sa.compile(m)
    hand = HandWrittenRoPE(m, 10000.0)
    x = torch.randn(cfg["batch"], cfg["n"], d_model, device=device, requires_grad=True)
    with torch.no_grad():
        diff = float((layer(x) - hand(x)).abs().max())
    fns = {"hand-written RoPE + SDPA": hand, "structattn rope_attention": layer}
    times = time_interleaved(fns, warmup, repeats, m, x)
    base, ours = times["hand-written RoPE + SDPA"], times["structattn rope_attention"]
    ratio = statistics.median(ours) / statistics.median(base)
    paired = statistics.median(a / b for a, b in zip(ours, base, strict=True))
    peaks = {name: _profiler_peak_bytes(fn, m, x) for name, fn in fns.items()}
    mem = peaks["structattn rope_attention"] / peaks["hand-written RoPE + SDPA"]
    label = "B={batch} H={heads} N={n} d={d_k}".format(**cfg)
    log(f"{label}: forward max |diff| {diff:.1e}; fwd+bwd "
        f"{statistics.median(base) * 1e3:.1f} ms hand-written, "
        f"{statistics.median(ours) * 1e3:.1f} ms compiled: {ratio:.3f}× (paired {paired:.3f}×; "
        f"{_verdict(paired, TIME_TARGET)}); peak live tensors "
        f"{peaks['hand-written RoPE + SDPA'] / 2**20:.1f} / "
        f"{peaks['structattn rope_attention'] / 2**20:.1f} MiB: {mem:.3f}× "
        f"({_verdict(mem, MEM_TARGET)})")
    return {**cfg, "max_abs_diff": diff, "seconds": times, "ratio_of_medians": ratio,
            "paired_ratio_median": paired, "peak_bytes": peaks, "memory_ratio": mem}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    configs = QUICK if args.quick else FULL
    warmup, repeats = (1, 3) if args.quick else (3, 15)
    print(f"rotary self attention, causal, float32, forward + backward, {args.device}, "
          f"{torch.get_num_threads()} threads")
    results = [measure(c, args.seed, warmup, repeats, args.device, print) for c in configs]
    path = _results.save("rope", results, args.json, quick=args.quick, device=args.device)
    if path:
        print("wrote", path)
    return results


if __name__ == "__main__":
    main()
