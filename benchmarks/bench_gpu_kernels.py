"""The Triton kernels against the authors' kernels and FlashAttention, forward+backward, in one run.

For each size (B, H, N, d) and dtype, one forward+backward of:

- causal ``scaled_dot_product_attention`` (FlashAttention on a GPU): the baseline;
- FoX: structattn's key-bias kernel (``structattn_triton::key_bias_forward``, the prior
  h_j = −Σ_{l≤j} log f_l from random gates) against FLA's ``parallel_forgetting_attn``;
- stick-breaking: structattn's kernel (``structattn_triton::stick_breaking_forward``)
  against FLA's ``parallel_stickbreaking_attn`` (the authors' kernel); structattn's scan stops
  once every child's stick is below float32's rounding (its default), and "full scan" reads
  every parent as FLA's does;

printing each one's time and peak memory and its ratio to causal SDPA and to FLA. The
factors reach every kernel in the benchmark's dtype; float32 rows run with TF32 products
(``torch.set_float32_matmul_precision("high")``), as FLA's kernels use them. Targets
(issue: GPU kernels): FoX ≤ 1.1× FLA and ≤ 1.2× causal SDPA; stick-breaking ≤ 1.1× FLA with
peak memory ≤ 1.2× causal SDPA's.

FLA (``fla-core``) is optional: where it does not import, its columns say so. On a machine
without CUDA the script runs the kernels under Triton's interpreter at tiny sizes (``--quick``:
the test suite's smoke run), which times nothing meaningful. Run on a GPU:
``python benchmarks/bench_gpu_kernels.py [--quick] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

if not torch.cuda.is_available():  # before Triton's decorators run: the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _results  # noqa: E402
from _device import cuda_peak_bytes, sync  # noqa: E402


def _fla():
    """FLA's two kernels, or the reason they are missing."""
    try:
        from fla.ops.forgetting_attn.parallel import parallel_forgetting_attn
        from fla.ops.stickbreaking_attn import parallel_stickbreaking_attn
    except Exception as err:  # not installed, or no GPU driver
        return None, f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
    return (parallel_forgetting_attn, parallel_stickbreaking_attn), None


def _inputs(B, H, N, d, dtype, device):
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(B, H, N, d, generator=g).to(device, dtype).requires_grad_()
               for _ in range(3))
    # log forget gates near FoX's initial σ(3): log f ∈ (−0.1, 0)
    log_f = (-0.1 * torch.rand(B, H, N, generator=g)).to(device, torch.float32)
    do = torch.randn(B, H, N, d, generator=g).to(device, dtype)
    return q, k, v, log_f, do


def methods(B, H, N, d, dtype, device, fla):
    """name → a function running one forward+backward."""
    from structattn.kinds.stick_breaking import stop_mass
    from structattn.triton_kernels import key_bias, stick_breaking

    q, k, v, log_f, do = _inputs(B, H, N, d, dtype, device)
    scale = d ** -0.5
    h = -torch.cumsum(log_f, -1).reshape(B * H, N)  # FoX's prior over the parents (float32)

    def flat(x):  # what the library hands the kernels: (B·H, N, d) rows in their dtype
        return x.reshape(B * H, N, d)

    def sdpa():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(do)

    def fox():
        out = key_bias.forward(flat(q), flat(k), flat(v), h, scale, True)[0]
        out.to(dtype).reshape(B, H, N, d).backward(do)

    stop = stop_mass(torch.float32)

    def sb(stop=stop):
        out = stick_breaking.forward(flat(q), flat(k), flat(v), scale, stop)[0]
        out.to(dtype).reshape(B, H, N, d).backward(do)

    out = {"causal SDPA": sdpa, "FoX (structattn)": fox, "stick-breaking (structattn)": sb,
           "stick-breaking, full scan (structattn)": lambda: sb(0.0)}
    if fla is not None:
        fla_fox, fla_sb = fla
        qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
        gt, dot = log_f.transpose(1, 2).contiguous(), do.transpose(1, 2).contiguous()

        def fox_fla():
            fla_fox(qt, kt, vt, gt, scale=scale).backward(dot)

        def sb_fla():
            fla_sb(qt, kt, vt, scale=scale)[0].backward(dot)

        out.update({"FoX (FLA)": fox_fla, "stick-breaking (FLA)": sb_fla})
    return out


def measure(fn, device, rounds, block):
    """Median seconds per call over ``rounds`` blocks of ``block`` calls, and peak bytes."""
    try:
        fn()  # warm-up: compiles the Triton kernels
    except Exception as err:  # a kernel without a backward or this dtype, out of memory …
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
        return None, None, f"{type(err).__name__}: {str(err).splitlines()[0][:100]}"
    sync(device)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(block):
            fn()
        sync(device)
        times.append((time.perf_counter() - start) / block)
    peak = cuda_peak_bytes(fn, device) if torch.device(device).type == "cuda" else None
    return statistics.median(times), peak, None


def _load_tuned(path: str) -> dict:
    """The settings ``tune_key_bias.py`` found (the largest N's per kernel, dtype and width),
    put into ``key_bias.TUNED``; {} where the file is missing."""
    if not os.path.exists(path):
        print(f"--tuned: {path} not found; the default settings run", flush=True)
        return {}
    from structattn.triton_kernels import key_bias

    with open(path) as f:
        best = json.load(f)["best"]
    for name, cfg in sorted(best.items(), key=lambda kv: int(kv[0].split(",")[3])):
        kernel, dtype, w, _ = name.split(",")
        key_bias.TUNED[(kernel, getattr(torch, dtype), int(w))] = {
            k: cfg[k] for k in ("BM", "BN", "num_warps", "num_stages")}
    print(f"tuned settings: {key_bias.TUNED}", flush=True)
    return dict(key_bias.TUNED)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, one round (smoke test)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-fla", action="store_true",
                   help="leave FLA out (its autotuning compiles ~27 kernels per size and dtype)")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"],
                   choices=["bfloat16", "float16", "float32"])
    p.add_argument("--tuned", metavar="PATH",
                   help="the key-bias kernel's launch settings from tune_key_bias.py")
    p.add_argument("--sizes", nargs="+", metavar="B,H,N,d", help="these sizes only")
    args = p.parse_args(argv)
    tuned = _load_tuned(args.tuned) if args.tuned else {}
    device = torch.device(args.device)
    if args.quick or device.type != "cuda":
        sizes, dtypes, rounds, block = [(1, 2, 40, 16)], [torch.float32], 1, 1
    else:
        sizes = [(8, 8, 1024, 64), (4, 8, 4096, 64), (1, 4, 16384, 128)]
        if args.sizes:
            sizes = [tuple(int(v) for v in s.split(",")) for s in args.sizes]
        dtypes, rounds, block = [getattr(torch, d) for d in args.dtypes], 5, 3
        torch.set_float32_matmul_precision("high")  # TF32 products in the float32 rows
    from structattn import triton_kernels

    if not triton_kernels.available():
        print("Triton is not installed (pip install structattn[gpu]): nothing to measure")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": str(device), "rows": [], "note": "no Triton"}, f)
        return
    fla, why = (None, "left out (--no-fla)") if args.no_fla else _fla()
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        "CPU, Triton's interpreter (times mean nothing)"
    print(f"torch {torch.__version__}, {where}; FLA: {'yes' if fla else why}", flush=True)
    rows = []

    import triton

    def save():  # after every size: a run cut short keeps what it measured
        _results.save("gpu_kernels", {"device": where, "triton": triton.__version__,
                                      "fla": fla is not None, "rows": rows,
                                      "tuned": {",".join(map(str, k)): v
                                                for k, v in tuned.items()}},
                      args.json, quick=args.quick or device.type != "cuda", device=device)

    for dtype in dtypes:
        for B, H, N, d in sizes:
            found = {}
            for name, fn in methods(B, H, N, d, dtype, device, fla).items():
                t, peak, note = measure(fn, device, rounds, block)
                found[name] = (t, peak, note)
            base_t, base_m = found["causal SDPA"][:2]
            for name, (t, peak, note) in found.items():
                fla_name = name.split(" (")[0].split(",")[0] + " (FLA)"
                fla_t = found.get(fla_name, (None,))[0] if "structattn" in name else None
                row = {"B": B, "H": H, "N": N, "d": d, "dtype": str(dtype).split(".")[-1],
                       "method": name, "seconds": t, "peak_bytes": peak, "note": note,
                       "vs_sdpa": t / base_t if t and base_t else None,
                       "memory_vs_sdpa": peak / base_m if peak and base_m else None,
                       "vs_fla": t / fla_t if t and fla_t else None}
                rows.append(row)
                ratio = "" if row["vs_sdpa"] is None else f"  {row['vs_sdpa']:.2f}× SDPA"
                ratio += "" if row["vs_fla"] is None else f", {row['vs_fla']:.2f}× FLA"
                mem = "" if row["memory_vs_sdpa"] is None else \
                    f", memory {row['memory_vs_sdpa']:.2f}× SDPA"
                ms = "—" if t is None else f"{1e3 * t:.2f} ms"
                print(f"B={B} H={H} N={N} d={d} {row['dtype']:>8}  {name:<28} {ms}{ratio}{mem}"
                      f"{'  (' + note + ')' if note else ''}", flush=True)
            save()
    save()


if __name__ == "__main__":
    main()
