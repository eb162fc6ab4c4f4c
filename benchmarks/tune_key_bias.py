"""Launch settings of the key-bias Triton kernel (FoX, ALiBi) measured on a GPU, one kernel at
a time: the forward, the children's backward (da) and the parents' backward (db, du, dh).

For each size of ``bench_gpu_kernels.py`` and dtype, each kernel runs with each candidate
(``BM`` children × ``BN`` parents per block, warps, pipeline stages) while the other two keep
theirs; the fastest (median of rounds of calls, CUDA-synchronised) is kept. The settings go to
a JSON file that ``bench_gpu_kernels.py --tuned PATH`` loads into
``structattn.triton_kernels.key_bias.TUNED`` before it measures, and that the library's
defaults are then set from. Needs a CUDA device. Run:
``python benchmarks/tune_key_bias.py --json PATH [--budget SECONDS]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

FORWARD = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (64, 64, 4, 3),
           (128, 32, 4, 3), (64, 128, 8, 2)]
CHILDREN = [(64, 64, 4, 2), (64, 64, 8, 2), (128, 64, 8, 2), (128, 32, 4, 3), (64, 32, 4, 3),
            (128, 128, 8, 1)]
PARENTS = [(64, 64, 4, 2), (64, 64, 8, 2), (32, 128, 8, 2), (64, 128, 8, 2), (32, 64, 4, 3),
           (128, 128, 8, 1)]
SIZES = [(8, 8, 1024, 64), (4, 8, 4096, 64), (1, 4, 16384, 128)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", metavar="PATH", required=True)
    p.add_argument("--budget", type=float, default=150.0, help="seconds; stops trying after it")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16"])
    args = p.parse_args(argv)
    from structattn.triton_kernels import key_bias
    from structattn.triton_kernels._tiles import width

    dev = torch.device("cuda")
    began = time.perf_counter()
    found: dict = {}

    def clock(fn, rounds=5, block=3):
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(rounds):
            t = time.perf_counter()
            for _ in range(block):
                fn()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t) / block)
        return statistics.median(times)

    for name in args.dtypes:
        dtype = getattr(torch, name)
        for B, H, N, d in SIZES:
            g = torch.Generator().manual_seed(0)
            a, b, u = (torch.randn(B * H, N, d, generator=g).to(dev, dtype) for _ in range(3))
            h = (0.1 * torch.rand(B * H, N, generator=g)).cumsum(-1).to(dev)
            dout = torch.randn(B * H, N, d, generator=g).to(dev, dtype)
            scale = d ** -0.5
            out, lse = key_bias.forward(a, b, u, h, scale, True)
            w = width(d)
            fwd = (a, b, u, h, scale, True)
            bwd = (dout, a, b, u, h, out, lse, scale, True)
            runs = {"forward": lambda fwd=fwd: key_bias.forward(*fwd),
                    "children": lambda bwd=bwd: key_bias.backward(*bwd),
                    "parents": lambda bwd=bwd: key_bias.backward(*bwd)}
            for kernel, candidates in (("forward", FORWARD), ("children", CHILDREN),
                                       ("parents", PARENTS)):
                key = (kernel, dtype, w)
                best = None
                for bm, bn, warps, stages in candidates:
                    if time.perf_counter() - began > args.budget:
                        break
                    key_bias.TUNED[key] = dict(BM=bm, BN=bn, num_warps=warps, num_stages=stages)
                    try:
                        t = clock(runs[kernel])
                    except Exception as err:  # too much shared memory, …
                        print(f"{name} {B}×{H} N={N} d={d} {kernel} {(bm, bn, warps, stages)}: "
                              f"{type(err).__name__}", flush=True)
                        continue
                    print(f"{name} {B}×{H} N={N} d={d} {kernel:<8} BM={bm:<3} BN={bn:<3} "
                          f"warps={warps} stages={stages}: {1e3 * t:.3f} ms", flush=True)
                    if best is None or t < best[0]:
                        best = (t, key_bias.TUNED[key])
                if best is None:
                    key_bias.TUNED.pop(key, None)
                    continue
                key_bias.TUNED[key] = best[1]
                found[f"{kernel},{name},{w},{N}"] = dict(best[1], ms=1e3 * best[0])
                print(f"  best {kernel}: {best[1]} {1e3 * best[0]:.3f} ms", flush=True)
            with open(args.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(dev), "best": found}, f,
                          indent=1)


if __name__ == "__main__":
    main()
