#!/usr/bin/env python
"""Benchmark: the structattn-compiled self-attention layer against hand-written baselines.

One run prints one report with three sections:

1. time of forward + backward (loss = output.sum(), gradients to the weights and x),
   compiled layer vs the hand-written ``F.scaled_dot_product_attention`` code on the
   SAME weight tensors, causal and non-causal; ratio compiled/SDPA (target <= 1.05);
2. time of the compiled forward vs ``structattn.inference.exact`` (Pyro enumeration)
   under ``torch.no_grad()``; speed-up Pyro/compiled;
3. peak memory of forward + backward: compiled vs hand-written SDPA vs a materialised
   ``softmax(QK^T/sqrt(d)) V``, each variant in a fresh subprocess (``--quick``: the
   three in one, in turn); ratio compiled/SDPA (target <= 1.1).

Usage::

    python benchmarks/bench_attention.py              # full run (~3-5 min on 2 CPU cores)
    python benchmarks/bench_attention.py --quick      # tiny smoke test (< 30 s)
    python benchmarks/bench_attention.py --json benchmarks/results/run.json

Timing: each variant is warmed up, then the variants are run interleaved (A, B, C, then
C, B, A, ...) so that machine drift hits all of them alike; the table shows the median
(and min/max) of the repeats, and the ratio of medians as well as the median of the
per-round ratios.

Memory: ``--child VARIANT`` (internal) runs one variant in a fresh interpreter (several
variants, for the smoke test: each in turn, as follows): it builds
weights and inputs, warms the variant up on a small input (so code pages and thread-pool
stacks are not counted), returns freed heap to the OS (``malloc_trim``), resets the RSS
high-water mark to the current RSS (``/proc/self/clear_refs``), runs forward + backward once
and reports the high-water mark (``VmHWM``, the value ``ru_maxrss`` reports; falls back to
``ru_maxrss`` where /proc is not available) after the run minus the one before it.
(``ru_maxrss`` itself cannot be reset once a thread has exited, hence ``VmHWM``.)
The full run measures this with glibc's defaults (median of 3 processes) and once more
with ``MALLOC_MMAP_THRESHOLD_=131072``, which switches off glibc's adaptive mmap threshold:
freed temporaries otherwise raise that threshold, later blocks of that size come from the
heap, and freed heap blocks stay resident, so RSS depends on the *history* of allocations,
not only on the live bytes. As a cross-check the child replays the run under
``torch.profiler`` with ``profile_memory=True`` and integrates the allocator's alloc/free
events to get the peak of live tensor bytes (no fragmentation or page rounding).

Each section also reports the share of the machine's CPU used by other processes while it
ran (/proc/stat minus this process tree); above 10% the timings are flagged as suspect.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import structattn as sa

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _results  # noqa: E402  (this script's own folder)
from _device import cuda_peak_bytes, sync  # noqa: E402
from _memory import peak_rss_kib, release_and_reset_peak, rss_kib  # noqa: E402

MiB = 2**20

# ---------------------------------------------------------------------------------------
# configurations
# ---------------------------------------------------------------------------------------

FULL = {
    "time": {"batch": 8, "heads": 8, "n": 1024, "d_k": 64, "warmup": 2, "repeats": 9},
    "pyro": {"batch": 1, "heads": 1, "n": 256, "d_model": 64, "warmup": 1, "repeats": 5,
             "compiled_repeats": 200},
    "memory": {"batch": 1, "heads": 8, "n": 4096, "d_k": 64, "causal": [False, True],
               "repeats": 3, "static_malloc": True,
               "variants": ["sdpa", "compiled", "compiled_noval", "materialised"]},
    "overhead": {"batch": 1, "heads": 1, "n": 16, "d_k": 16, "min_run_time": 0.5},
}

QUICK = {
    "time": {"batch": 2, "heads": 2, "n": 128, "d_k": 16, "warmup": 1, "repeats": 3},
    "pyro": {"batch": 1, "heads": 1, "n": 32, "d_model": 16, "warmup": 1, "repeats": 2,
             "compiled_repeats": 20},
    "memory": {"batch": 1, "heads": 2, "n": 2048, "d_k": 16, "causal": [False], "repeats": 1,
               "static_malloc": False, "variants": ["sdpa", "compiled", "materialised"],
               "one_process": True},
    "overhead": {"batch": 1, "heads": 1, "n": 16, "d_k": 16, "min_run_time": 0.2},
}

TIME_TARGET = 1.05  # compiled / SDPA, forward + backward
MEM_TARGET = 1.10  # compiled / SDPA, peak memory

# ---------------------------------------------------------------------------------------
# the variants (all share the same weight tensors)
# ---------------------------------------------------------------------------------------


def build(batch, heads, n, d_k, causal, seed, d_model=None, requires_grad=True, device="cpu"):
    """A self-attention declaration, its compiled layer and an input x (seeded)."""
    torch.manual_seed(seed)
    d_model = d_model or heads * d_k
    m = sa.models.self_attention(d_model, d_k=d_k, d_v=d_k, heads=heads, causal=causal,
                                 dtype=torch.float32, device=device)
    layer = sa.compile(m)
    x = torch.randn(batch, n, d_model, dtype=torch.float32, device=device,
                    requires_grad=requires_grad)
    return m, layer, x


def _split(t, heads, d):
    return t.unflatten(-1, (heads, d)).transpose(-3, -2)


def sdpa_reference(m, x):
    """The hand-written layer: exactly the computation the compiled layer lowers to."""
    H, d_k, d_v = m.heads, m.d_k, m.d_v
    q = _split(x @ m.W_q.T, H, d_k)
    k = _split(x @ m.W_k.T, H, d_k)
    v = _split(x @ m.W_v.T, H, d_v)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=m.causal, scale=1 / math.sqrt(d_k))
    return o.transpose(-3, -2).flatten(-2) @ m.W_o.T


def materialised_reference(m, x):
    """Textbook attention: softmax(Q K^T / sqrt(d_k)) V with the (B, H, N, N) matrix formed."""
    H, d_k, d_v = m.heads, m.d_k, m.d_v
    q = _split(x @ m.W_q.T, H, d_k)
    k = _split(x @ m.W_k.T, H, d_k)
    v = _split(x @ m.W_v.T, H, d_v)
    s = (q @ k.transpose(-2, -1)) * (1 / math.sqrt(d_k))
    if m.causal:
        n = x.shape[-2]
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=x.device).tril(),
                          float("-inf"))
    o = torch.softmax(s, dim=-1) @ v
    return o.transpose(-3, -2).flatten(-2) @ m.W_o.T


def make_variants(m, layer):
    def compiled_no_validation(x):
        with sa.validation(False):
            return layer(x)

    return {
        "sdpa": lambda x: sdpa_reference(m, x),
        "compiled": layer,
        "compiled_noval": compiled_no_validation,
        "materialised": lambda x: materialised_reference(m, x),
    }


LABELS = {
    "sdpa": "hand-written SDPA",
    "compiled": "structattn compiled",
    "compiled_noval": "compiled, validation off",
    "materialised": "materialised softmax(QK^T)V",
}


def clear_grads(m, x):
    for p in m.parameters():
        p.grad = None
    x.grad = None


def fwd_bwd(fn, m, x):
    clear_grads(m, x)
    fn(x).sum().backward()


# ---------------------------------------------------------------------------------------
# section 1: forward + backward time
# ---------------------------------------------------------------------------------------


def time_interleaved(fns: dict, warmup: int, repeats: int, m, x) -> dict:
    """Median/min/max seconds per call of each fn, interleaved (order reversed every round);
    on a GPU each call is timed from a synchronised start to a synchronised end."""
    for fn in fns.values():
        for _ in range(warmup):
            fwd_bwd(fn, m, x)
    times = {name: [] for name in fns}
    names = list(fns)
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for r in range(repeats):
            for name in (names if r % 2 == 0 else names[::-1]):
                clear_grads(m, x)
                sync(x.device)
                t0 = time.perf_counter()
                fns[name](x).sum().backward()
                sync(x.device)
                times[name].append(time.perf_counter() - t0)
    finally:
        if gc_was_enabled:
            gc.enable()
    clear_grads(m, x)
    return times


def _verdict(ratio: float, target: float) -> str:
    if math.isnan(ratio):
        return f"<= {target}: n/a"
    return f"<= {target}: " + ("ok" if ratio <= target else "ABOVE")


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.1f}" if ms >= 10 else f"{ms:.3f}"


def section_time(cfg, seed, log):
    c = cfg["time"]
    rows = []
    log(f"\n[1] forward + backward time (loss = out.sum(); grads to W_q, W_k, W_v, W_o and x)\n"
        f"    B={c['batch']} H={c['heads']} N={c['n']} d_k=d_v={c['d_k']} "
        f"d_model={c['heads'] * c['d_k']} float32; {c['warmup']} warm-up runs per variant, "
        f"{c['repeats']} interleaved repeats; time.perf_counter, median (min-max)")
    header = (f"    {'causal':<7}{'variant':<28}{'median ms':>11}{'min ms':>10}{'max ms':>10}"
              f"{'/ SDPA':>9}{'paired':>9}  target")
    log(header)
    log("    " + "-" * (len(header) - 4))
    for causal in (False, True):
        m, layer, x = build(c["batch"], c["heads"], c["n"], c["d_k"], causal, seed,
                            device=cfg["device"])
        v = make_variants(m, layer)
        with torch.no_grad():
            ref = v["sdpa"](x)
            diff = float((layer(x) - ref).abs().max())
        fns = {k: v[k] for k in ("sdpa", "compiled", "compiled_noval")}
        times = time_interleaved(fns, c["warmup"], c["repeats"], m, x)
        base = statistics.median(times["sdpa"])
        for name, ts in times.items():
            med = statistics.median(ts)
            ratio = med / base
            paired = statistics.median(a / b for a, b in zip(ts, times["sdpa"], strict=True))
            target = ""
            if name == "compiled":
                target = _verdict(ratio, TIME_TARGET)
            log(f"    {str(causal):<7}{LABELS[name]:<28}{_ms(med):>11}{_ms(min(ts)):>10}"
                f"{_ms(max(ts)):>10}{ratio:>9.3f}{paired:>9.3f}  {target}")
            rows.append({"causal": causal, "variant": name, "median_s": med,
                         "min_s": min(ts), "max_s": max(ts), "times_s": ts,
                         "ratio_vs_sdpa": ratio, "paired_ratio_median": paired})
        log(f"    {'':<7}(max |compiled - SDPA| forward = {diff:.2e})")
        if x.is_cuda:  # the GPU allocator's own peak, per variant, of one forward + backward
            peaks = {}
            for name, fn in fns.items():
                clear_grads(m, x)
                peaks[name] = cuda_peak_bytes(lambda fn=fn, m=m, x=x: fwd_bwd(fn, m, x), x.device)
            log(f"    {'':<7}peak GPU memory of fwd+bwd over the inputs: " + ", ".join(
                f"{LABELS[k]} {v / 2**20:.1f} MiB ({v / peaks['sdpa']:.3f}×)"
                for k, v in peaks.items()))
            rows.append({"causal": causal, "peak_gpu_bytes": peaks})
        del m, layer, x, v, fns, ref
        gc.collect()
    log("    '/ SDPA' = ratio of medians; 'paired' = median over rounds of the per-round ratio")
    if cfg.get("quick"):
        log("    (quick: sizes are too small for the targets; fixed per-call costs dominate)")
    return {"config": c, "rows": rows}


# ---------------------------------------------------------------------------------------
# fixed per-call overhead (tiny input, forward only)
# ---------------------------------------------------------------------------------------


def section_overhead(cfg, seed, log):
    from torch.utils.benchmark import Timer

    c = cfg["overhead"]
    m, layer, x = build(c["batch"], c["heads"], c["n"], c["d_k"], False, seed,
                        requires_grad=False, device=cfg["device"])
    v = make_variants(m, layer)
    out = {}
    with torch.no_grad():
        for name in ("sdpa", "compiled", "compiled_noval"):
            t = Timer("f(x)", globals={"f": v[name], "x": x}, num_threads=torch.get_num_threads())
            out[name] = t.blocked_autorange(min_run_time=c["min_run_time"]).median
    log(f"\n    fixed per-call cost, forward only, no_grad, B={c['batch']} H={c['heads']} "
        f"N={c['n']} d_k={c['d_k']} (torch.utils.benchmark.Timer): "
        + ", ".join(f"{LABELS[k]} {s * 1e6:.0f} us" for k, s in out.items())
        + f"  -> compiled adds ~{(out['compiled'] - out['sdpa']) * 1e6:.0f} us per call")
    return {"config": c, "median_s": out}


# ---------------------------------------------------------------------------------------
# section 2: compiled forward vs Pyro exact enumeration
# ---------------------------------------------------------------------------------------


def section_pyro(cfg, seed, log):
    c = cfg["pyro"]
    d_model = c["d_model"]
    d_k = d_model // c["heads"]
    m, layer, x = build(c["batch"], c["heads"], c["n"], d_k, False, seed, d_model=d_model,
                        requires_grad=False)
    comp_times, exact_times = [], []
    per_round = max(1, c["compiled_repeats"] // c["repeats"])
    with torch.no_grad():
        for _ in range(3):
            layer(x)
        for _ in range(c["warmup"]):
            sa.inference.exact(m, x)
        # interleaved: one exact call, then a block of compiled calls, per round
        for _ in range(c["repeats"]):
            t0 = time.perf_counter()
            truth = sa.inference.exact(m, x)
            exact_times.append(time.perf_counter() - t0)
            for _ in range(per_round):
                t0 = time.perf_counter()
                y = layer(x)
                comp_times.append(time.perf_counter() - t0)
    diff = float((truth.output - y).abs().max())
    tc, te = statistics.median(comp_times), statistics.median(exact_times)
    log(f"\n[2] compiled forward vs sa.inference.exact (Pyro TraceEnum_ELBO enumeration), "
        f"torch.no_grad()\n    B={c['batch']} H={c['heads']} N={c['n']} d_model={d_model} "
        f"float32; median of {len(comp_times)} (compiled) / {c['repeats']} (exact, after "
        f"{c['warmup']} warm-up), interleaved; time.perf_counter")
    log(f"    {'structattn compiled forward':<36}{tc * 1e3:>10.3f} ms")
    log(f"    {'sa.inference.exact (Pyro)':<36}{te * 1e3:>10.3f} ms")
    log(f"    speed-up Pyro/compiled: {te / tc:.0f}x   (max |exact.output - compiled| = "
        f"{diff:.2e})")
    return {"config": c, "compiled_median_s": tc, "exact_median_s": te,
            "compiled_times_s": comp_times, "exact_times_s": exact_times,
            "speedup": te / tc, "max_abs_diff": diff}


# ---------------------------------------------------------------------------------------
# section 3: peak memory, one fresh subprocess per variant
# ---------------------------------------------------------------------------------------


def _profiler_peak_bytes(fn, m, x):
    """Peak of live tensor bytes during fn, from the profiler's alloc/free ([memory]) events."""
    from torch.profiler import ProfilerActivity, profile

    clear_grads(m, x)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn(x).sum().backward()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    cur = peak = 0
    for e in events:
        cur += e.nbytes()
        peak = max(peak, cur)
    clear_grads(m, x)
    return peak


def run_child(args) -> None:
    """Internal: the variants of ``--child`` in turn in this process (one, but for the smoke
    test's); prints one JSON line for each."""
    torch.set_num_threads(args.threads)
    for variant in args.child:
        _measure_child(args, variant)


def _measure_child(args, variant) -> None:
    m, layer, x = build(args.batch, args.heads, args.n, args.d_k, args.causal, args.seed)
    fn = make_variants(m, layer)[variant]
    # warm-up on a small input: pages in the kernels' code and starts the thread pool
    small = torch.randn(args.batch, min(64, args.n), x.shape[-1], requires_grad=True)
    fwd_bwd(fn, m, small)
    del small
    clear_grads(m, x)
    gc.collect()
    hwm_reset = release_and_reset_peak()
    before, source = peak_rss_kib()
    rss_before = rss_kib()
    t0 = time.perf_counter()
    fn(x).sum().backward()
    elapsed = time.perf_counter() - t0
    after, _ = peak_rss_kib()
    prof_peak = prof_err = None
    if args.profile:
        try:
            prof_peak = _profiler_peak_bytes(fn, m, x)
        except Exception as e:  # private profiler API: report, do not fail the benchmark
            prof_err = f"{type(e).__name__}: {e}"
    print(json.dumps({
        "variant": variant, "causal": args.causal, "hwm_reset": hwm_reset,
        "peak_source": source, "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        "peak_before_kib": before, "peak_after_kib": after, "rss_before_kib": rss_before,
        "peak_delta_mib": (after - before) / 1024,
        "slack_mib": (before - rss_before) / 1024,
        "profiler_peak_mib": None if prof_peak is None else prof_peak / MiB,
        "profiler_error": prof_err, "seconds": elapsed,
    }), flush=True)


def _ratio(a, b):
    """a / b, NaN when either is missing or b is 0 (e.g. a peak below RSS resolution)."""
    return a / b if a is not None and b else float("nan")


# glibc's malloc raises its mmap threshold (up to 32 MiB) each time it frees an mmapped
# block, after which large blocks come from the heap and freed ones stay resident; a
# fixed threshold (which also fixes the trim threshold) turns that adaptation off.
STATIC_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def _run_child(variant, causal, c, seed, threads, static_malloc, profile):
    """The record of ``variant`` measured in a fresh process."""
    return _run_children([variant], causal, c, seed, threads, static_malloc, profile)[0]


def _run_children(variants, causal, c, seed, threads, static_malloc, profile):
    """The records of ``variants``, measured in turn in one fresh process."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", *variants,
           "--batch", str(c["batch"]), "--heads", str(c["heads"]), "--n", str(c["n"]),
           "--d-k", str(c["d_k"]), "--seed", str(seed), "--threads", str(threads)]
    if causal:
        cmd.append("--causal")
    if profile:
        cmd.append("--profile")
    env = dict(os.environ)
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if static_malloc:
        env.update(STATIC_MALLOC_ENV)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
        raise RuntimeError(f"child {' '.join(variants)} (causal={causal}) exit "
                           f"{proc.returncode}: {tail}")
    lines = [line for line in proc.stdout.strip().splitlines() if line.startswith("{")]
    return [json.loads(line) for line in lines[-len(variants):]]


def section_memory(cfg, seed, threads, log):
    c = cfg["memory"]
    reps = c["repeats"]
    static = c["static_malloc"]
    log(f"\n[3] peak memory of forward + backward, B={c['batch']} H={c['heads']} N={c['n']} "
        f"d_k=d_v={c['d_k']} d_model={c['heads'] * c['d_k']} float32\n"
        f"    method: each variant in a fresh subprocess, warmed up on N=64; peak RSS = RSS "
        f"high-water mark (VmHWM,\n    what ru_maxrss reports) after one forward+backward minus "
        f"the mark right before it, which is\n    reset to the current RSS there (malloc_trim + "
        f"/proc/self/clear_refs); includes the gradients.\n"
        f"    'default malloc' = median [min-max] of {reps} processes (materialised: 1) with "
        f"glibc's defaults;\n"
        + ("    'static mmap thr.' = 1 process with MALLOC_MMAP_THRESHOLD_=131072 (glibc's "
           "adaptive threshold off;\n    see benchmarks/README.md);\n" if static else "")
        + "    'tensors' = peak live tensor bytes from torch.profiler(profile_memory=True) "
          "alloc/free events\n    (allocator level, no fragmentation; a cross-check)")
    if c.get("one_process"):
        log("    (smoke test: the variants in one subprocess, in turn)")
    cols = [("peak RSS MiB, default malloc", 30), ("/ SDPA", 8)]
    if static:
        cols += [("static mmap thr.", 17), ("/ SDPA", 8)]
    cols += [("tensors MiB", 12), ("/ SDPA", 8)]
    head = f"    {'causal':<7}{'variant':<29}" + "".join(f"{t:>{w}}" for t, w in cols) + "  target"
    log(head)
    log("    " + "-" * (len(head) - 4))
    rows = []
    for causal in c["causal"]:
        res = {}
        # the smoke test (one process each, no static run): the variants in one process
        shared = c.get("one_process") and reps == 1 and not static
        try:
            done = dict(zip(c["variants"], _run_children(
                c["variants"], causal, c, seed, threads, False, profile=True), strict=True)) \
                if shared else {}
        except RuntimeError as e:
            log(f"    {str(causal):<7}{', '.join(c['variants']):<29} FAILED: {e}")
            continue
        for variant in c["variants"]:
            n_default = reps if variant != "materialised" else 1
            try:
                runs = [done[variant] if variant in done else
                        _run_child(variant, causal, c, seed, threads, False,
                                   profile=(not static and i == 0)) for i in range(n_default)]
                static_run = (_run_child(variant, causal, c, seed, threads, True, profile=True)
                              if static else None)
            except RuntimeError as e:
                log(f"    {str(causal):<7}{LABELS[variant]:<29} FAILED: {e}")
                continue
            deltas = [r["peak_delta_mib"] for r in runs]
            res[variant] = {
                "variant": variant, "causal": causal,
                "default_mib": statistics.median(deltas), "default_runs_mib": deltas,
                "static_mib": static_run["peak_delta_mib"] if static_run else None,
                "profiler_mib": (static_run or runs[0])["profiler_peak_mib"],
                "profiler_error": (static_run or runs[0])["profiler_error"],
                "slack_mib": max(r["slack_mib"] for r in runs + ([static_run] if static_run else [])),
                "hwm_reset_ok": all(r["hwm_reset"] and r["peak_source"] == "VmHWM"
                                    for r in runs + ([static_run] if static_run else [])),
                "children": runs + ([static_run] if static_run else []),
            }
        base = res.get("sdpa", {})
        for variant, r in res.items():
            r["default_ratio"] = _ratio(r["default_mib"], base.get("default_mib"))
            r["static_ratio"] = _ratio(r["static_mib"], base.get("static_mib"))
            r["profiler_ratio"] = _ratio(r["profiler_mib"], base.get("profiler_mib"))
            d = r["default_runs_mib"]
            spread = f"[{min(d):.1f}-{max(d):.1f}]" if len(d) > 1 else ""
            cells = [f"{r['default_mib']:.1f} {spread}".rstrip(), f"{r['default_ratio']:.3f}"]
            if static:
                cells += [f"{r['static_mib']:.1f}", f"{r['static_ratio']:.3f}"]
            cells += ["n/a" if r["profiler_mib"] is None else f"{r['profiler_mib']:.1f}",
                      f"{r['profiler_ratio']:.3f}"]
            target = _verdict(r["default_ratio"], MEM_TARGET) if variant == "compiled" else ""
            log(f"    {str(causal):<7}{LABELS[variant]:<29}"
                + "".join(f"{cell:>{w}}" for cell, (_, w) in zip(cells, cols, strict=True)) + f"  {target}")
            rows.append(r)
    slack = max((r["slack_mib"] for r in rows), default=0.0)
    if not all(r["hwm_reset_ok"] for r in rows):
        log("    WARNING: could not reset the RSS high-water mark (/proc/self/clear_refs, "
            "VmHWM); fell back to ru_maxrss")
    log(f"    (largest high-water mark - current RSS at a baseline: {slack:.1f} MiB: the RSS "
        f"columns under-read by at most that)")
    return {"config": c, "rows": rows}


# ---------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------


def header(args, log):
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        affinity = None
    meta = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "mode": "quick" if args.quick else "full",
        "torch": torch.__version__,
        "structattn": getattr(sa, "__version__", None) or _dist_version("structattn"),
        "pyro": _dist_version("pyro-ppl"),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": affinity,
        "seed": args.seed,
        "loadavg_start": _loadavg(),
    }
    meta["git_commit"], meta["git_dirty"] = _git_state()
    log(f"structattn attention benchmark ({meta['mode']} run, {meta['date']})")
    git = ("" if meta["git_commit"] is None else
           f" (git {meta['git_commit']}{', uncommitted changes' if meta['git_dirty'] else ''})")
    log(f"torch {meta['torch']} | structattn {meta['structattn']}{git} | pyro {meta['pyro']} | "
        f"python {meta['python']} | {meta['machine']} {meta['cpu_capability']}")
    log(f"torch threads {meta['threads']} (interop {meta['interop_threads']}) | cores: "
        f"os.cpu_count()={meta['cpu_count']}, usable (affinity)={meta['cpu_affinity']} | "
        f"seed {meta['seed']}")
    la = meta["loadavg_start"]
    if la is not None:
        log(f"load average at the start: {la[0]:.2f} (1 min), {la[1]:.2f} (5 min)"
            + ("  (machine not idle)" if la[0] > 0.5 else ""))
    return meta


def _git_state():
    """(short commit, dirty?) of the repository holding this script, or (None, None)."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain",
                                "--untracked-files=no", "--", ":!benchmarks"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None, None
    if head.returncode != 0:
        return None, None
    return head.stdout.strip(), bool(dirty.stdout.strip())


class CpuMeter:
    """CPU seconds spent by *other* processes over an interval: system-wide busy time from
    /proc/stat minus this process's (and its children's) own CPU time. Linux only; None
    elsewhere. A large share means the timings were taken on a contended machine."""

    def __init__(self):
        self.start = self._sample()

    @staticmethod
    def _sample():
        try:
            with open("/proc/stat") as f:
                fields = [int(v) for v in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        hz = os.sysconf("SC_CLK_TCK")
        user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
        busy = (user + nice + system + irq + softirq + steal) / hz
        own = sum(getattr(resource.getrusage(who), f) for who in
                  (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN) for f in ("ru_utime", "ru_stime"))
        return busy, own, time.perf_counter()

    def other_share(self):
        """Fraction of the machine's CPU capacity used by other processes since start."""
        end = self._sample()
        if self.start is None or end is None:
            return None
        busy, own, wall = (e - s for e, s in zip(end, self.start, strict=True))
        capacity = wall * (os.cpu_count() or 1)
        return max(0.0, busy - own) / capacity if capacity > 0 else None


def _loadavg():
    try:
        return os.getloadavg()
    except OSError:
        return None


def _dist_version(name):
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return None


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="tiny configuration for a smoke test (< 30 s)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    p.add_argument("--seed", type=int, default=0, help="torch.manual_seed (default 0)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads (default: torch's default)")
    p.add_argument("--repeats", type=int, default=None,
                   help="override the number of timed repeats in section 1")
    p.add_argument("--skip", action="append", default=[],
                   choices=["time", "overhead", "pyro", "memory"],
                   help="skip a section (repeatable)")
    # internal: one memory-measurement child
    p.add_argument("--device", default="cpu",
                   help="cpu (default) or cuda: sections time and overhead on that device "
                        "(memory is the CPU's RSS and pyro is CPU-only: skipped on cuda)")
    p.add_argument("--child", nargs="+",
                   choices=["sdpa", "compiled", "compiled_noval", "materialised"],
                   help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    p.add_argument("--heads", type=int, help=argparse.SUPPRESS)
    p.add_argument("--n", type=int, help=argparse.SUPPRESS)
    p.add_argument("--d-k", type=int, help=argparse.SUPPRESS)
    p.add_argument("--causal", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads is None:
        args.threads = torch.get_num_threads()
    if args.child:
        run_child(args)
        return 0
    torch.set_num_threads(args.threads)
    cfg = json.loads(json.dumps(QUICK if args.quick else FULL))  # a copy
    cfg["quick"] = args.quick
    cfg["device"] = args.device
    if args.device != "cpu":
        args.skip += [s for s in ("memory", "pyro") if s not in args.skip]
    if args.repeats:
        cfg["time"]["repeats"] = args.repeats

    def log(line=""):
        print(line, flush=True)

    start = time.perf_counter()
    results = {"meta": header(args, log)}
    sections = {"time": lambda: section_time(cfg, args.seed, log),
                "overhead": lambda: section_overhead(cfg, args.seed, log),
                "pyro": lambda: section_pyro(cfg, args.seed, log),
                "memory": lambda: section_memory(cfg, args.seed, args.threads, log)}
    contended = []
    for name, run in sections.items():
        if name in args.skip:
            continue
        t0, meter = time.perf_counter(), CpuMeter()
        results[name] = run()
        results[name]["section_wall_s"] = time.perf_counter() - t0
        share = meter.other_share()
        results[name]["other_processes_cpu_share"] = share
        if share is not None:
            log(f"    [other processes used {share:.0%} of the machine's CPU during this section]")
            if share > 0.10 and name != "memory":
                contended.append(name)
    if contended:
        log(f"\nWARNING: other processes competed for the CPU during {', '.join(contended)}; "
            f"those timings are inflated and noisy (small, many-op workloads suffer most: "
            f"OpenMP threads wait for a descheduled peer). Re-run on an idle machine.")
    load = _loadavg()
    results["meta"]["loadavg_end"] = load
    if load is not None:
        log(f"\nload average at the end: {load[0]:.2f} (1 min), {load[1]:.2f} (5 min) on "
            f"{os.cpu_count()} cores")
    results["meta"]["wall_s"] = time.perf_counter() - start
    log(f"\ntotal wall time {results['meta']['wall_s']:.0f} s")
    written = _results.save("attention", results, args.json, quick=args.quick,
                            device=getattr(args, "device", None))
    if written:
        log(f"results written to {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
