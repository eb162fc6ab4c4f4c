"""Where expanding attention's mean field spends its time on a GPU, and the Triton solve's
launch settings.

On the expanding benchmark's input (``bench_expanding.py``: N tokens, parents Geometric(1/16)
back, float32), with ``grad="last"``: one forward+backward of the layer against causal SDPA;
then the pieces alone — the Triton ``solve`` (each child's fixed point) under each candidate
launch setting (children per block BM, parents per block BN, warps), the band per child
forward and backward — and torch.profiler's table of the layer's forward+backward (the
kernels by device time). Run on a GPU:
``python benchmarks/profile_expanding.py [--n 16384] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys

import torch

SMOKE = "--smoke" in sys.argv  # no GPU: a tiny run under Triton's interpreter (checks the script)
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _results  # noqa: E402
import bench_expanding as be  # noqa: E402

import structattn as sa  # noqa: E402


def timed(fn, repeats=10):
    """Median milliseconds of ``fn`` over ``repeats`` calls (CUDA events), after one warm-up."""
    fn()
    if SMOKE:
        return float("nan")
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=16384)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--smoke", action="store_true", help="no GPU: N = 100 on the CPU, untimed")
    p.add_argument("--no-sweep", action="store_true", help="the solve's default settings only")
    args = p.parse_args(argv)
    device = torch.device("cpu" if args.smoke else "cuda")
    if args.smoke:
        args.n = 100
        from structattn import triton_kernels
        inside = triton_kernels.on_cpu()  # the Triton path on CPU tensors (kept: entered)
        inside.__enter__()
    from structattn.triton_kernels import expanding

    x, _, _ = be.make_data(args.n, 64, 16.0, 0)
    x = x.to(device)
    m = be.build(64, 8.0, 16.0, 2.0, "mean_field", 0.05, "last").to(device)
    layer = sa.compile(m)
    params = list(m.parameters())
    out = {"n": args.n, "rows": [],
           "device": "smoke" if args.smoke else torch.cuda.get_device_name(device)}

    def row(name, ms, **extra):
        print(f"{name:60s} {ms:8.3f} ms", flush=True)
        out["rows"].append({"name": name, "ms": ms, **extra})

    with sa.validation(False):
        row("layer, grad='last', forward+backward", timed(lambda: be.fwd_bwd(layer, params, x)))
        row("causal SDPA, forward+backward",
            timed(lambda: be.fwd_bwd(lambda x: be.full_causal(m, x), params, x)))
        with torch.no_grad():
            row("layer, forward, no grad", timed(lambda: layer(x)))
        # the solve's and the band's own arguments, from one call
        seen = {}
        solve, attend = expanding.solve, expanding.attend_forward

        def spy_solve(*a):
            seen["solve"] = a
            return solve(*a)

        def spy_attend(*a):
            seen["attend"] = a
            return attend(*a)
        expanding.solve, expanding.attend_forward = spy_solve, spy_attend
        try:
            fresh = sa.compile(m, replay=False)  # read directly, not a recorded plan
            be.fwd_bwd(fresh, params, x)
        finally:
            expanding.solve, expanding.attend_forward = solve, attend
    s_args, a_args = seen["solve"], seen["attend"]
    fixed = solve(*s_args)
    steps, window = fixed[4].double(), fixed[0].double()
    print(f"children: steps mean {steps.mean():.2f}, max {int(steps.max())}; windows mean "
          f"{window.mean():.1f}, max {int(window.max())}")
    out["children"] = {"steps_mean": steps.mean().item(), "steps_max": int(steps.max()),
                       "window_mean": window.mean().item(), "window_max": int(window.max())}
    row("solve (default settings)", timed(lambda: solve(*s_args)), settings=dict(expanding.SOLVE))
    candidates = [] if args.no_sweep else [(32, 32, 4)] if args.smoke else \
        itertools.product((16, 32, 64), (32, 64, 128), (2, 4))
    default = dict(expanding.SOLVE)
    for bm, bn, warps in candidates:
        expanding.SOLVE.clear()
        expanding.SOLVE.update(BM=bm, BN=bn, num_warps=warps, num_stages=2)
        try:
            row(f"solve BM={bm} BN={bn} warps={warps}", timed(lambda: solve(*s_args)),
                settings=dict(expanding.SOLVE))
        except Exception as e:  # a setting the GPU refuses (shared memory)
            print(f"solve BM={bm} BN={bn} warps={warps}: {type(e).__name__}: {e}"[:200])
    expanding.SOLVE.clear()
    expanding.SOLVE.update(default)
    with torch.no_grad():
        row("band per child, forward", timed(lambda: attend(*a_args)))
    leaves = [t.detach().requires_grad_() if t.is_floating_point() else t for t in a_args[:5]]
    o, _ = attend(*leaves, *a_args[5:])
    dout = torch.randn_like(o)
    row("band per child, forward+backward",
        timed(lambda: torch.autograd.grad(attend(*leaves, *a_args[5:])[0], leaves[:4], dout)))
    from structattn.triton_kernels.band_per_child import BACKWARD
    BACKWARD["db_du"] = "atomic"  # db and du added per tile by the children's kernel
    try:
        row("band per child, forward+backward (db, du atomic)",
            timed(lambda: torch.autograd.grad(attend(*leaves, *a_args[5:])[0], leaves[:4],
                                              dout)))
    finally:
        BACKWARD["db_du"] = "parents"
    from torch.profiler import ProfilerActivity, profile
    kinds = [ProfilerActivity.CPU] + ([] if args.smoke else [ProfilerActivity.CUDA])
    with sa.validation(False), profile(activities=kinds) as prof:
        for _ in range(3):
            be.fwd_bwd(layer, params, x)
        if not args.smoke:
            torch.cuda.synchronize()
    order = "cpu_time_total" if args.smoke else "cuda_time_total"
    table = prof.key_averages().table(sort_by=order, row_limit=25)
    print(table)
    out["profile"] = table
    _results.save("profile_expanding", out, args.json, quick=args.smoke, device=device)


if __name__ == "__main__":
    main()
