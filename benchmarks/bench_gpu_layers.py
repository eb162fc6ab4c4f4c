"""The catalogue's causal layers as a user compiles them, against the same projections around
causal SDPA and FLA's kernels: forward+backward, time and peak memory, in one run.

Each layer is ``sa.compile(sa.models.<name>(512, heads=8, d_k=64, d_v=64, dtype=…,
device=…))``, its projections W_Q, W_K, W_V, W_O included; the baselines run projections of
the same shapes (FLA's, the FoX and stick-breaking layers' own weights):

- ``causal SDPA``: x → W_Q, W_K, W_V → ``scaled_dot_product_attention(is_causal=True)`` →
  W_O, no positions and no prior — the baseline of every row (FlashAttention on a GPU);
- ``FoX (FLA)``: the same projections and FoX's forget gates log σ(W_f x + b_f) around FLA's
  ``parallel_forgetting_attn``; ``stick-breaking (FLA)``: around FLA's
  ``parallel_stickbreaking_attn`` (``fla-core``; where it does not import, its columns say
  why);
- the layers: causal self-attention, RoPE, ALiBi, relative and learned absolute positions
  (causal), FoX, FoX certified (``tol=1e-4``), stick-breaking, BAM's generalised Gaussian
  (its Triton kernel; certified at ``tol=1e-4``), causal
  multihop (P + P²)VX (up to N = 4,096: P² is dense), expanding attention's
  mean field with ``grad="last"`` on the expanding benchmark's input (each head's tokens
  carry their true parent's key, Geometric(1/16) back, and W_Q, W_K read it, as
  ``bench_expanding.py`` builds them; a = 16, b = 2, tol 0.05) and on standard-normal inputs
  (the catalogue's defaults).

B = 2, H = 8, d = 64 per head, d_model = 512, N = 1,024, 4,096 and 16,384; parameters in
bfloat16 (``--dtype``; ``autocast``: float32 parameters under ``torch.autocast`` in
bfloat16). Each method is warmed up (``--warmup`` 3 calls: a layer is read, its plan recorded,
then replayed; FLA's kernels autotune), then the methods run interleaved for ``--rounds``
rounds (every other one reversed) of ``--block`` calls, timed on a GPU with CUDA events; the
table gives medians per call and the median of the per-round ratios to causal SDPA
(``paired``). A layer whose call takes longer than ``--slow`` seconds (2) is timed by its last
warm-up call alone, so that one slow layer does not spend the run. Peak memory is
``torch.cuda.max_memory_allocated`` over one forward+backward after a reset, less what was
allocated before. Before timing, each layer's output is compared with the baseline that
computes the same function (self-attention with SDPA, FoX and stick-breaking with FLA's) and
the largest difference printed.

On the CPU (``--device cpu --sizes 64 128``, or ``--quick``: one round) the same code runs
without FLA, a smoke test whose times mean nothing. Run on a GPU:
``python benchmarks/bench_gpu_layers.py [--sizes N …] [--models NAME …] [--json PATH]``;
a full CUDA run writes ``benchmarks/results/gpu_layers.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _results  # noqa: E402  (this script's own folder)
from _device import cuda_peak_bytes, sync  # noqa: E402

import structattn as sa  # noqa: E402

SDPA = "causal SDPA"
#: SDPA around the self-attention layer's own weights: compared with it, not timed
SDPA_TWIN = "causal SDPA (its weights)"
#: the layer each FLA baseline computes the same function as
FLA_TWIN = {"FoX": "FoX (FLA)", "stick-breaking": "stick-breaking (FLA)"}


def _fla():
    """FLA's two kernels, or the reason they are missing."""
    try:
        from fla.ops.forgetting_attn.parallel import parallel_forgetting_attn
        from fla.ops.stickbreaking_attn import parallel_stickbreaking_attn
    except Exception as err:  # not installed, or no GPU driver
        return None, f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
    return (parallel_forgetting_attn, parallel_stickbreaking_attn), None


# -- the baselines: the layer's own projection weights around a kernel ---------------------


def _qkv(m, x):
    """(B, N, H, d) queries, keys and values from the layer's W_Q, W_K, W_V."""
    B, N, H = x.shape[0], x.shape[1], m.heads
    return (F.linear(x, m.W_q).view(B, N, H, m.d_k), F.linear(x, m.W_k).view(B, N, H, m.d_k),
            F.linear(x, m.W_v).view(B, N, H, m.d_v))


def causal_sdpa(m, x):
    """W_O · SDPA(W_Q x, W_K x, W_V x), causal, no positions."""
    q, k, v = (t.transpose(1, 2) for t in _qkv(m, x))  # (B, H, N, d)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.linear(y.transpose(1, 2).flatten(-2), m.W_o)


def fox_fla(kernel, m, x):
    """FoX with FLA's kernel: log f = log σ(W_f x + b_f) per head, float32."""
    q, k, v = _qkv(m, x)
    log_f = F.logsigmoid(F.linear(x, m.W_f, m.b_f)).float()  # (B, N, H)
    y = kernel(q, k, v, log_f, scale=m.d_k ** -0.5)
    return F.linear(y.flatten(-2).to(q.dtype), m.W_o)


def stick_breaking_fla(kernel, m, x):
    """Stick-breaking with FLA's kernel."""
    q, k, v = _qkv(m, x)
    y = kernel(q, k, v, scale=m.d_k ** -0.5)[0]
    return F.linear(y.flatten(-2).to(q.dtype), m.W_o)


# -- the layers ----------------------------------------------------------------------------


def expanding_input(B, N, H, d, seed=0):
    """``(B, N, H·d)``: each head's d features are ``bench_expanding.make_data``'s tokens
    (a unit key and the key of a parent Geometric(1/16) back), one draw per batch row and
    head."""
    from bench_expanding import make_data

    return torch.cat([torch.cat([make_data(N, d, 16.0, seed + b * H + h)[0]
                                 for h in range(H)], -1) for b in range(B)])


def read_parents(m, sharpness=8.0):
    """W_Q, W_K as ``bench_expanding.build`` sets them, per head: head h's queries read the
    parent key in its block of x (× ``sharpness``), its keys the own key."""
    H, d = m.heads, m.d_k
    half = d // 2
    with torch.no_grad():
        m.W_q.zero_()
        m.W_k.zero_()
        for h in range(H):
            rows, cols = slice(h * d, h * d + half), h * d
            eye = torch.eye(half, device=m.W_q.device, dtype=m.W_q.dtype)
            m.W_q[rows, cols + half:cols + d] = sharpness * eye
            m.W_k[rows, cols:cols + half] = eye
    return m


def layers(N, kw):
    """name → (declaration, input kind): every causal catalogue layer the run measures."""
    models = sa.models
    d_model = kw.pop("d_model")
    out = {
        "causal self-attention": (models.self_attention(d_model, causal=True, **kw), "normal"),
        "RoPE": (models.rope_attention(d_model, **kw), "normal"),
        "ALiBi": (models.alibi_attention(d_model, **kw), "normal"),
        "relative positions": (models.relative_position_attention(d_model, causal=True, **kw),
                               "normal"),
        "absolute positions (learned)": (models.absolute_position_attention(
            d_model, max_len=N, causal=True, **kw), "normal"),
        "FoX": (models.forgetting_attention(d_model, **kw), "normal"),
        "FoX, certified (tol 1e-4)": (models.forgetting_attention(d_model, tol=1e-4, **kw),
                                      "normal"),
        "stick-breaking": (models.stick_breaking_attention(d_model, **kw), "normal"),
        "generalised Gaussian": (models.generalised_gaussian_attention(d_model, **kw),
                                 "normal"),
        "generalised Gaussian, certified (tol 1e-4)": (
            models.generalised_gaussian_attention(d_model, tol=1e-4, **kw), "normal"),
        "expanding, grad='last' (expanding input)": (read_parents(models.expanding_attention(
            d_model, a=16.0, b=2.0, temperature=1.0,
            inference=sa.MeanFieldWindows(tol=0.05, grad="last"), **kw)), "expanding"),
        "expanding, grad='last' (standard normal)": (models.expanding_attention(
            d_model, inference=sa.MeanFieldWindows(grad="last"), **kw), "normal"),
    }
    if N <= 4096:  # P² of the posterior
        out["multihop (P + P²)"] = (models.multihop_attention(d_model, causal=True, **kw),
                                    "normal")
    return out


# -- timing --------------------------------------------------------------------------------


class Method:
    """One forward+backward: ``forward(x)`` of a module's parameters, then ``y.backward(dy)``."""

    def __init__(self, forward, params, x, autocast):
        self.forward, self.params, self.x, self.autocast = forward, params, x, autocast
        self.dy = None

    def output(self):
        with torch.autocast(self.x.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            return self.forward(self.x)

    def clear(self):
        """Drop the gradients of the last call (a call's own are part of its peak)."""
        for p in (self.x, *self.params):
            p.grad = None

    def __call__(self):
        self.clear()
        y = self.output()
        if self.dy is None or self.dy.dtype != y.dtype:
            g = torch.Generator(device="cpu").manual_seed(1)
            self.dy = torch.randn(y.shape, generator=g).to(y.device, y.dtype)
        y.backward(self.dy)


def _why(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).strip().splitlines()[0][:110]}" if str(err) \
        else type(err).__name__


def time_interleaved(methods: dict, device, rounds: int, block: int) -> dict:
    """name → seconds per call in each round (CUDA events on a GPU, the host clock
    elsewhere); every other round in reverse order."""
    cuda = device.type == "cuda"
    times = {k: [] for k in methods}
    names = list(methods)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            fn = methods[name]
            sync(device)
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                start.record()
                for _ in range(block):
                    fn()
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end) / 1e3 / block)
            else:
                t = time.perf_counter()
                for _ in range(block):
                    fn()
                times[name].append((time.perf_counter() - t) / block)
    return times


def run_size(N, args, fla, log) -> list[dict]:
    """Every method at length N: rows of time, paired ratio and peak memory."""
    device = torch.device(args.device)
    autocast = args.dtype == "autocast"
    dtype = torch.float32 if autocast else getattr(torch, args.dtype)
    B, H, d = args.batch, args.heads, args.d
    kw = dict(d_model=H * d, heads=H, d_k=d, d_v=d, dtype=dtype, device=device)
    torch.manual_seed(0)
    decls = layers(N, dict(kw))
    if args.models:
        decls = {k: v for k, v in decls.items() if any(w in k for w in args.models)}
    g = torch.Generator(device="cpu").manual_seed(0)
    inputs = {"normal": torch.randn(B, N, H * d, generator=g),
              "expanding": expanding_input(B, N, H, d)}
    inputs = {k: v.to(device, dtype).requires_grad_() for k, v in inputs.items()}
    x = inputs["normal"]
    # causal SDPA runs the projections of a FoX module drawn as every layer's are
    torch.manual_seed(0)
    base = sa.models.forgetting_attention(kw["d_model"], **{k: v for k, v in kw.items()
                                                            if k != "d_model"})
    base_params = [p for p in base.parameters() if p.requires_grad]
    methods = {SDPA: Method(lambda x: causal_sdpa(base, x), base_params, x, autocast)}
    twins = {}  # layer name → the baseline that computes the same function
    for name, (m, kind) in decls.items():
        layer = sa.compile(m)
        methods[name] = Method(layer, [p for p in m.parameters() if p.requires_grad],
                               inputs[kind], autocast)
        if name == "causal self-attention":
            twins[name] = SDPA_TWIN
            methods[SDPA_TWIN] = Method(lambda x, m=m: causal_sdpa(m, x), [], x, autocast)
        if fla is not None and name in FLA_TWIN:
            fn = fox_fla if name == "FoX" else stick_breaking_fla
            kernel = fla[0] if name == "FoX" else fla[1]
            twins[name] = FLA_TWIN[name]
            methods[FLA_TWIN[name]] = Method(lambda x, fn=fn, kernel=kernel, m=m: fn(kernel, m, x),
                                             [p for p in m.parameters() if p.requires_grad], x,
                                             autocast)
    order = [n for n in methods if n != SDPA_TWIN]  # the rows
    built = dict(methods)  # what runs at all is compared below, slow or not
    notes, diffs, once = {}, {}, {}
    for name, fn in list(methods.items()):  # warm-up: reads, records, compiles kernels
        try:
            for _ in range(args.warmup - 1):
                fn()
            sync(device)
            t = time.perf_counter()
            fn()
            sync(device)
            t = time.perf_counter() - t
            if t > args.slow and name != SDPA and name in order:  # timed by that call
                once[name] = t
                notes[name] = f"one call timed: {t:.2f} s > --slow {args.slow:g} s"
                del methods[name]
        except Exception as err:  # a kernel missing for this dtype, out of memory …
            notes[name] = _why(err)
            del methods[name]
            if device.type == "cuda":
                torch.cuda.empty_cache()
            log(f"  {name}: {notes[name]}")
    with torch.no_grad():  # the same function, two ways: how far apart
        for name, twin in twins.items():
            if name in built and twin in built and not ({name, twin} & set(notes) - set(once)):
                a, b = built[name].output().float(), built[twin].output().float()
                diffs[name] = float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))
                log(f"  {name} vs {twin}: largest difference {diffs[name]:.2e} of the output's "
                    f"largest entry")
    methods.pop(SDPA_TWIN, None)  # compared above, not timed (it is SDPA's row)
    times = time_interleaved(methods, device, args.rounds, args.block)
    peaks = {}
    for k, fn in methods.items():
        fn.clear()
        peaks[k] = cuda_peak_bytes(fn, device) if device.type == "cuda" else None
    base_t, base_m = times[SDPA], peaks[SDPA]
    times.update({k: [t] * len(base_t) for k, t in once.items()})
    rows = []
    for name in (n for n in order if n in times or n in notes):
        t = times.get(name)
        fla_name = FLA_TWIN.get(name)
        row = {"N": N, "B": B, "H": H, "d": d, "dtype": args.dtype, "method": name,
               "seconds": statistics.median(t) if t else None,
               "paired_vs_sdpa": statistics.median(a / b for a, b in zip(t, base_t, strict=True))
               if t else None,
               "peak_bytes": peaks.get(name), "note": notes.get(name),
               "max_difference": diffs.get(name)}
        row["memory_vs_sdpa"] = (row["peak_bytes"] / base_m
                                 if row["peak_bytes"] and base_m else None)
        ft = times.get(fla_name) if fla_name else None
        row["paired_vs_fla"] = (statistics.median(a / b for a, b in zip(t, ft, strict=True))
                                if t and ft else None)
        rows.append(row)
    return rows


def table(rows: list[dict], fla_note: str | None = None) -> list[str]:
    """The ratios as a markdown table: one row per method, per N its time and peak memory
    over causal SDPA's (and over FLA's kernel, where it has one)."""
    sizes = sorted({r["N"] for r in rows})
    names = list(dict.fromkeys(r["method"] for r in rows))
    at = {(r["N"], r["method"]): r for r in rows}
    head = "| method | " + " | ".join(f"N = {n:,}" for n in sizes) + " |"
    lines = [head, "|---|" + "---|" * len(sizes)]
    for name in names:
        cells = []
        for n in sizes:
            r = at.get((n, name))
            if r is None or r["seconds"] is None:
                cells.append("—" if r is None else "fails")
                continue
            if name == SDPA:
                cell = f"{1e3 * r['seconds']:.2f} ms"
            else:
                cell = f"{r['paired_vs_sdpa']:.2f}×"
            if r.get("paired_vs_fla") is not None:
                cell += f" ({r['paired_vs_fla']:.2f}× FLA)"
            if r.get("peak_bytes") is not None:
                cell += (f", {r['peak_bytes'] / 2 ** 20:.0f} MiB" if name == SDPA else
                         f", memory {r['memory_vs_sdpa']:.2f}×")
            cells.append(cell)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if fla_note:
        lines.append(f"\nFLA: {fla_note}")
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sizes", type=int, nargs="+", default=None, metavar="N",
                   help="sequence lengths (default 1024 4096 16384 on a GPU, 64 128 on a CPU)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--d", type=int, default=64, help="width per head")
    p.add_argument("--dtype", default="bfloat16",
                   choices=["bfloat16", "float16", "float32", "autocast"],
                   help="the parameters' dtype, or autocast: float32 ones under torch.autocast "
                        "in bfloat16")
    p.add_argument("--models", nargs="+", metavar="NAME",
                   help="only the layers whose names contain one of these")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--block", type=int, default=3, help="calls per timed block")
    p.add_argument("--warmup", type=int, default=3, help="calls before timing (≥ 3)")
    p.add_argument("--slow", type=float, default=None, metavar="S",
                   help="a layer whose call takes longer is timed once, its last warm-up call "
                        "(default 2 s; 60 s with --quick)")
    p.add_argument("--budget", type=float, default=None, metavar="S",
                   help="start no further N once this many seconds have passed")
    p.add_argument("--no-fla", action="store_true", help="leave FLA's kernels out")
    p.add_argument("--quick", action="store_true",
                   help="the CPU smoke test: --device cpu --sizes 64 128 --batch 1 --heads 2 "
                        "--d 16, one round")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    if args.quick:  # every path at a size the CPU runs in seconds
        args.device, args.rounds, args.block, args.warmup = "cpu", 1, 1, 3
        args.batch, args.heads, args.d, args.sizes = 1, 2, 16, args.sizes or [64, 128]
        args.slow = 60.0 if args.slow is None else args.slow
    args.slow = 2.0 if args.slow is None else args.slow
    if args.warmup < 3:
        p.error(f"--warmup must be ≥ 3 (a layer's first call reads it, its second records a "
                f"plan, and the last warm-up call, a replay, is timed); got {args.warmup}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: no CUDA device here (torch.cuda.is_available() is "
                f"False); run with --device cpu")
    sizes = args.sizes or ([1024, 4096, 16384] if device.type == "cuda" else [64, 128])
    fla, why = (None, "left out (--no-fla)") if args.no_fla else \
        (None, "not on the CPU (its kernels need a GPU)") if device.type != "cuda" else _fla()
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        "CPU (times mean nothing at these sizes)"
    print(f"torch {torch.__version__}, {where}, {args.dtype}, B={args.batch} H={args.heads} "
          f"d={args.d}; FLA: {'yes' if fla else why}", flush=True)
    rows, start = [], time.perf_counter()

    def save():  # after every N: a run cut short keeps what it measured
        return _results.save("gpu_layers", {
            "device": where, "fla": fla is not None, "fla_note": why, "dtype": args.dtype,
            "config": {"batch": args.batch, "heads": args.heads, "d": args.d,
                       "rounds": args.rounds, "block": args.block, "sizes": sizes},
            "rows": rows}, args.json, quick=args.quick or device.type != "cuda", device=device)

    for N in sizes:
        if args.budget is not None and time.perf_counter() - start > args.budget:
            print(f"N={N}: not started (--budget {args.budget:g} s spent)", flush=True)
            break
        print(f"N={N}:", flush=True)
        found = run_size(N, args, fla, lambda s: print(s, flush=True))
        rows.extend(found)
        for r in found:
            ms = "—" if r["seconds"] is None else f"{1e3 * r['seconds']:8.2f} ms"
            ratio = "" if r["paired_vs_sdpa"] is None else f"  {r['paired_vs_sdpa']:.2f}× SDPA"
            ratio += "" if r["paired_vs_fla"] is None else f", {r['paired_vs_fla']:.2f}× FLA"
            mem = "" if r["peak_bytes"] is None else \
                f", peak {r['peak_bytes'] / 2 ** 20:.0f} MiB ({r['memory_vs_sdpa']:.2f}× SDPA)"
            print(f"  {r['method']:<44} {ms}{ratio}{mem}"
                  f"{'  (' + r['note'] + ')' if r['note'] else ''}", flush=True)
        save()
    print("\nforward+backward over causal SDPA (paired medians; memory: peak over SDPA's):")
    print("\n".join(table(rows, None if fla else why)))
    path = save()
    if path:
        print("wrote", path)
    return rows


if __name__ == "__main__":
    main()
