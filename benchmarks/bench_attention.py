#!/usr/bin/env python
"""Benchmark: the structattn-compiled self-attention layer against hand-written baselines.

One run prints one report with three sections:

1. time of forward + backward (loss = output.sum(), gradients to the weights and x),
   compiled layer vs the hand-written ``F.scaled_dot_product_attention`` code on the
   SAME weight tensors, causal and non-causal; ratio compiled/SDPA (target <= 1.05);
2. time of the compiled forward vs ``structattn.inference.exact`` (Pyro enumeration)
   under ``torch.no_grad()``; speed-up Pyro/compiled;
3. peak memory of forward + backward: compiled vs hand-written SDPA vs a materialised
   ``softmax(QK^T/sqrt(d)) V``, each variant in a fresh subprocess; ratio
   compiled/SDPA (target <= 1.1).

Usage::

    python benchmarks/bench_attention.py              # full run (~3-5 min on 2 CPU cores)
    python benchmarks/bench_attention.py --quick      # tiny smoke test (< 30 s)
    python benchmarks/bench_attention.py --json benchmarks/results/run.json

Timing: each variant is warmed up, then the variants are run interleaved (A, B, C, then
C, B, A, ...) so that machine drift hits all of them alike; the table shows the median
(and min/max) of the repeats, and the ratio of medians as well as the median of the
per-round ratios.

Memory: ``--child VARIANT`` (internal) runs one variant in a fresh interpreter and reports
``ru_maxrss`` after the run minus ``ru_maxrss`` right after building weights/inputs and a
small warm-up of the same variant (so code pages and thread-pool stacks are not counted).
As a cross-check the child also replays the run under ``torch.profiler`` with
``profile_memory=True`` and integrates the allocator's alloc/free events to get the peak
of live tensor bytes (allocator-level; excludes malloc fragmentation and page rounding).
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

MiB = 2**20

# ---------------------------------------------------------------------------------------
# configurations
# ---------------------------------------------------------------------------------------

FULL = {
    "time": {"batch": 8, "heads": 8, "n": 1024, "d_k": 64, "warmup": 2, "repeats": 9},
    "pyro": {"batch": 1, "heads": 1, "n": 256, "d_model": 64, "warmup": 1, "repeats": 5,
             "compiled_repeats": 200},
    "memory": {"batch": 1, "heads": 8, "n": 4096, "d_k": 64},
    "overhead": {"batch": 1, "heads": 1, "n": 16, "d_k": 16},
}

QUICK = {
    "time": {"batch": 2, "heads": 2, "n": 128, "d_k": 16, "warmup": 1, "repeats": 3},
    "pyro": {"batch": 1, "heads": 1, "n": 32, "d_model": 16, "warmup": 1, "repeats": 2,
             "compiled_repeats": 20},
    "memory": {"batch": 1, "heads": 2, "n": 2048, "d_k": 16},
    "overhead": {"batch": 1, "heads": 1, "n": 16, "d_k": 16},
}

TIME_TARGET = 1.05  # compiled / SDPA, forward + backward
MEM_TARGET = 1.10  # compiled / SDPA, peak memory

# ---------------------------------------------------------------------------------------
# the variants (all share the same weight tensors)
# ---------------------------------------------------------------------------------------


def build(batch, heads, n, d_k, causal, seed, d_model=None, requires_grad=True):
    """A self-attention declaration, its compiled layer and an input x (seeded)."""
    torch.manual_seed(seed)
    d_model = d_model or heads * d_k
    m = sa.models.self_attention(d_model, d_k=d_k, d_v=d_k, heads=heads, causal=causal,
                                 dtype=torch.float32)
    layer = sa.compile(m)
    x = torch.randn(batch, n, d_model, dtype=torch.float32, requires_grad=requires_grad)
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
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
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
    """Median/min/max seconds per call of each fn, interleaved (order reversed every round)."""
    for name, fn in fns.items():
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
                t0 = time.perf_counter()
                fns[name](x).sum().backward()
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
        m, layer, x = build(c["batch"], c["heads"], c["n"], c["d_k"], causal, seed)
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
            paired = statistics.median(a / b for a, b in zip(ts, times["sdpa"]))
            target = ""
            if name == "compiled":
                target = _verdict(ratio, TIME_TARGET)
            log(f"    {str(causal):<7}{LABELS[name]:<28}{_ms(med):>11}{_ms(min(ts)):>10}"
                f"{_ms(max(ts)):>10}{ratio:>9.3f}{paired:>9.3f}  {target}")
            rows.append({"causal": causal, "variant": name, "median_s": med,
                         "min_s": min(ts), "max_s": max(ts), "times_s": ts,
                         "ratio_vs_sdpa": ratio, "paired_ratio_median": paired})
        log(f"    {'':<7}(max |compiled - SDPA| forward = {diff:.2e})")
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
                        requires_grad=False)
    v = make_variants(m, layer)
    out = {}
    with torch.no_grad():
        for name in ("sdpa", "compiled", "compiled_noval"):
            t = Timer("f(x)", globals={"f": v[name], "x": x}, num_threads=torch.get_num_threads())
            out[name] = t.blocked_autorange(min_run_time=0.5).median
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


def _rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


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
    """Internal: one variant, one process; prints one JSON line."""
    torch.set_num_threads(args.threads)
    m, layer, x = build(args.batch, args.heads, args.n, args.d_k, args.causal, args.seed)
    fn = make_variants(m, layer)[args.child]
    # warm-up on a small input: pages in the kernels' code and starts the thread pool
    small = torch.randn(args.batch, min(64, args.n), x.shape[-1], requires_grad=True)
    fwd_bwd(fn, m, small)
    del small
    clear_grads(m, x)
    gc.collect()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    rss_before = _rss_kib()
    t0 = time.perf_counter()
    fn(x).sum().backward()
    elapsed = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        prof_peak = _profiler_peak_bytes(fn, m, x)
    except Exception as e:  # private profiler API: report, do not fail the benchmark
        prof_peak, prof_err = None, f"{type(e).__name__}: {e}"
    else:
        prof_err = None
    print(json.dumps({
        "variant": args.child, "causal": args.causal,
        "maxrss_before_kib": before, "maxrss_after_kib": after, "rss_before_kib": rss_before,
        "peak_delta_mib": (after - before) / 1024,
        "slack_mib": (before - rss_before) / 1024,
        "profiler_peak_mib": None if prof_peak is None else prof_peak / MiB,
        "profiler_error": prof_err, "seconds": elapsed,
    }))


def _ratio(a, b):
    """a / b, NaN when either is missing or b is 0 (e.g. a peak below RSS resolution)."""
    return a / b if a is not None and b else float("nan")


def section_memory(cfg, seed, threads, log):
    c = cfg["memory"]
    log(f"\n[3] peak memory of forward + backward, B={c['batch']} H={c['heads']} N={c['n']} "
        f"d_k=d_v={c['d_k']} d_model={c['heads'] * c['d_k']} float32\n"
        f"    method: each variant in a fresh subprocess; 'peak RSS' = ru_maxrss after the run "
        f"minus ru_maxrss after\n    building weights/inputs + a small warm-up of the same "
        f"variant (includes the gradients); 'tensors' = peak\n    live tensor bytes from "
        f"torch.profiler(profile_memory=True) alloc/free events (cross-check)")
    header = (f"    {'causal':<7}{'variant':<30}{'peak RSS MiB':>13}{'/ SDPA':>9}"
              f"{'tensors MiB':>13}{'/ SDPA':>9}  target")
    log(header)
    log("    " + "-" * (len(header) - 4))
    rows = []
    for causal in (False, True):
        res = {}
        for variant in ("sdpa", "compiled", "materialised"):
            cmd = [sys.executable, os.path.abspath(__file__), "--child", variant,
                   "--batch", str(c["batch"]), "--heads", str(c["heads"]), "--n", str(c["n"]),
                   "--d-k", str(c["d_k"]), "--seed", str(seed), "--threads", str(threads)]
            if causal:
                cmd.append("--causal")
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                log(f"    {str(causal):<7}{LABELS[variant]:<30} FAILED (exit {proc.returncode}): "
                    f"{proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ''}")
                continue
            res[variant] = json.loads(proc.stdout.strip().splitlines()[-1])
        for variant, r in res.items():
            base = res.get("sdpa")
            ratio = _ratio(r["peak_delta_mib"], base and base["peak_delta_mib"])
            pratio = _ratio(r["profiler_peak_mib"], base and base["profiler_peak_mib"])
            pp = r["profiler_peak_mib"]
            target = ""
            if variant == "compiled":
                target = _verdict(ratio, MEM_TARGET)
            pp_s = f"{pp:>13.1f}" if pp is not None else f"{'n/a':>13}"
            log(f"    {str(causal):<7}{LABELS[variant]:<30}{r['peak_delta_mib']:>13.1f}"
                f"{ratio:>9.3f}{pp_s}{pratio:>9.3f}  {target}")
            rows.append({**r, "ratio_vs_sdpa": ratio, "profiler_ratio_vs_sdpa": pratio})
    slack = max((r["slack_mib"] for r in rows), default=0.0)
    log(f"    (largest ru_maxrss - current RSS at the baseline: {slack:.1f} MiB; the RSS "
        f"columns can under-read by at most that)")
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
    }
    log(f"structattn attention benchmark ({meta['mode']} run, {meta['date']})")
    log(f"torch {meta['torch']} | structattn {meta['structattn']} | pyro {meta['pyro']} | "
        f"python {meta['python']} | {meta['machine']} {meta['cpu_capability']}")
    log(f"torch threads {meta['threads']} (interop {meta['interop_threads']}) | cores: "
        f"os.cpu_count()={meta['cpu_count']}, usable (affinity)={meta['cpu_affinity']} | "
        f"seed {meta['seed']}")
    return meta


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
    p.add_argument("--child", choices=["sdpa", "compiled", "compiled_noval", "materialised"],
                   help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    p.add_argument("--heads", type=int, help=argparse.SUPPRESS)
    p.add_argument("--n", type=int, help=argparse.SUPPRESS)
    p.add_argument("--d-k", type=int, help=argparse.SUPPRESS)
    p.add_argument("--causal", action="store_true", help=argparse.SUPPRESS)
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
    if args.repeats:
        cfg["time"]["repeats"] = args.repeats

    def log(line=""):
        print(line, flush=True)

    start = time.perf_counter()
    results = {"meta": header(args, log)}
    if "time" not in args.skip:
        results["time"] = section_time(cfg, args.seed, log)
    if "overhead" not in args.skip:
        results["overhead"] = section_overhead(cfg, args.seed, log)
    if "pyro" not in args.skip:
        results["pyro"] = section_pyro(cfg, args.seed, log)
    if "memory" not in args.skip:
        results["memory"] = section_memory(cfg, args.seed, args.threads, log)
    results["meta"]["wall_s"] = time.perf_counter() - start
    log(f"\ntotal wall time {results['meta']['wall_s']:.0f} s")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        log(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
