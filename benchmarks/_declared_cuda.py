"""``bench_declared.py --device cuda``: which reading serves each declared case on a GPU.

Each (case, N) builds the case's compiled layer on CUDA and times it, forward + backward (or
the forward alone for a forward row), once per route: ``flex`` (FlexAttention's reading,
``structattn.kinds.flex_reading``, its ``log_weight`` reading turned on) and ``without flex``
(``flex_reading.disabled()``: what the layer reads without it — a Triton kernel where the
project has one, the rows reading, or the dense (…, N, N) table or mask); each route's
reading is the layer's own ``explain`` (a route that reads the same as the other is still
timed: the same numbers twice). Time: CUDA events around ``--reps`` calls after three warm-up
calls (read, record the plan, replay; FlexAttention's first call compiles), the median;
memory: the CUDA allocator's peak over one call; the routes' outputs are compared (max
|Δ|). A route that fails or runs out of memory is a row saying so; no route starts after
``--budget`` seconds.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch
from _device import cuda_peak_bytes

from structattn.kinds import flex_reading

#: the cases a GPU route is measured for (the CPU's own rows: FlexAttention of its own, and the
#: reference's forward, are left out)
CUDA_CASES = ["alibi_causal", "alibi_user", "power_law", "alibi_noncausal", "relative_positions",
              "generalised_gaussian", "log_weight", "longformer", "longformer_forward", "bigbird"]


@contextlib.contextmanager
def route(name):
    """The route's settings in a block: FlexAttention on (its log_weight reading too) or off."""
    if name == "flex":
        old, flex_reading.LOG_WEIGHT = flex_reading.LOG_WEIGHT, True
        try:
            yield
        finally:
            flex_reading.LOG_WEIGHT = old
    else:
        with flex_reading.disabled():
            yield


def _time(fn, reps) -> float:
    """The median seconds of ``fn()`` over ``reps`` calls, each between two CUDA events."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)


def measure(bench, name, n, route_name, reps) -> dict:
    """One (case, N, route): the layer's reading, median seconds, peak MiB and output."""
    backward = bench.CASES[name][1]
    ref = bench.build_reference()
    with route(route_name):
        fn, params, layer = bench.build_case(name, ref, n, True)
        fn = fn.cuda()  # its parameters move in place: ``params`` are still the ones trained
        torch.manual_seed(1)
        x = torch.randn(1, n, bench.D_MODEL, device="cuda", requires_grad=backward)

        def call():
            bench.call(fn, x, params, backward)

        for _ in range(3):
            call()
        torch.cuda.synchronize()
        row = {"case": name, "N": n, "route": route_name,
               "mode": "fwd+bwd" if backward else "fwd", "reading": bench.reading_of(fn, x)}
        row["peak_mib"] = cuda_peak_bytes(call, "cuda") / 2 ** 20
        row["median_s"] = _time(call, reps)
        with torch.no_grad():
            out = fn(x).float().cpu()
    return row, out


def run(bench, args) -> dict:
    """Every (case, N, route) within the budget; the table printed as it goes."""
    sizes = args.sizes or [2048, 8192, 16384]
    names = [c for c in CUDA_CASES if not args.cases or c in args.cases]
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, float32; B=1, "
          f"H={bench.HEADS}, d_k=d_v={bench.D_K}", flush=True)
    print(f"{'case':<22} {'mode':<7} {'N':>6} {'route':<12} {'seconds':>9} {'peak MiB':>9}  "
          f"reading", flush=True)
    rows, start = [], time.perf_counter()
    for n in sizes:
        for name in names:
            outs = {}
            for r in ("flex", "without flex"):
                if time.perf_counter() - start > args.budget:
                    rows.append({"case": name, "N": n, "route": r, "skipped": "over the budget"})
                    continue
                try:
                    row, outs[r] = measure(bench, name, n, r, args.reps)
                except Exception as e:  # noqa: BLE001  (out of memory, a failed compile: a row)
                    row = {"case": name, "N": n, "route": r,
                           "skipped": f"{type(e).__name__}: {str(e)[:200]}"}
                finally:
                    torch.cuda.empty_cache()
                rows.append(row)
                print(_fmt(row), flush=True)
            if len(outs) == 2:
                rows[-1]["max_difference"] = (outs["flex"] - outs["without flex"]).abs().max().item()
    return {"config": {"device": torch.cuda.get_device_name(), "sizes": sizes,
                       "reps": args.reps, "heads": bench.HEADS, "d_k": bench.D_K}, "rows": rows}


def _fmt(r) -> str:
    if r.get("skipped"):
        return f"{r['case']:<22} {'':<7} {r['N']:>6,} {r['route']:<12} skipped: {r['skipped']}"
    reading = r["reading"] if not isinstance(r["reading"], dict) else "; ".join(
        r["reading"].values())
    return (f"{r['case']:<22} {r['mode']:<7} {r['N']:>6,} {r['route']:<12} "
            f"{r['median_s']:9.4f} {r['peak_mib']:9.1f}  {reading}")


__all__ = ["CUDA_CASES", "run"]
