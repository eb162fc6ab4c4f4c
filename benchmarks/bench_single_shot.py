"""Single-shot catalogue vs the strongest hand-written baselines, in one run.

1. relative-position prior (learned logits b_{clip(i−j)}) vs hand-written SDPA with the
   same dense bias built from the same table — forward+backward, target ≤ 1.1×;
2. multihop (P + P²)VX vs two sequential hand-written SDPA calls — target ≤ 1.1×;
3. graph attention over an edge list at 100,000 nodes and 1.6M edges (d = 64):
   forward+backward time and peak memory; against the dense-mask path (SDPA with a
   boolean mask) at a size where the dense mask fits, with the same average degree.

Peak memory: each graph variant runs in a fresh subprocess, warmed up once; the peak is
the growth of the RSS high-water mark during one forward+backward (``_memory.py``;
``--quick`` runs the three in one subprocess, one after the other). Run:
``python benchmarks/bench_single_shot.py [--quick] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import structattn as sa  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _results  # noqa: E402  (this script's own folder)
from _memory import measure_peak_mib  # noqa: E402

heads_of, merge = sa.split_heads, sa.merge_heads  # (…, n, H·d) ↔ (…, H, n, d)


# -- the hand-written baselines (same weight tensors as the declarations) -----------------

def relative_sdpa(m, x):
    H, n = m.heads, x.shape[-2]
    q, k, v = heads_of(x @ m.W_q.T, H), heads_of(x @ m.W_k.T, H), heads_of(x @ m.W_v.T, H)
    K = m.max_distance
    offsets = torch.arange(n)[:, None] - torch.arange(n)[None, :]
    bias = m.position_logits[:, offsets.clamp(-K, K) + K]  # (H, n, n)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1 / math.sqrt(m.d_k))
    return merge(y) @ m.W_o.T


def two_sdpa_calls(m, x):
    H = m.heads
    q, k, v = heads_of(x @ m.W_q.T, H), heads_of(x @ m.W_k.T, H), heads_of(x @ m.W_v.T, H)
    s = 1 / math.sqrt(m.d_k)
    u1 = F.scaled_dot_product_attention(q, k, v, scale=s)
    u2 = F.scaled_dot_product_attention(q, k, u1, scale=s)
    return merge(u1 + u2) @ m.W_o.T


# -- timing -------------------------------------------------------------------------------

def fwd_bwd(fn, params):
    for p in params:
        p.grad = None
    fn().sum().backward()


def time_pair(fns: dict, params, warmup: int, repeats: int) -> dict:
    """Median seconds per forward+backward, variants interleaved (order flipped each round)."""
    for fn in fns.values():
        for _ in range(warmup):
            fwd_bwd(fn, params)
    times = {k: [] for k in fns}
    names = list(fns)
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            t = time.perf_counter()
            fwd_bwd(fns[name], params)
            times[name].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def check_close(a, b, what):
    err = (a - b).abs().max().item()
    if err > 1e-3:
        raise AssertionError(f"{what}: compiled and baseline disagree by {err:.2e}")
    return err


def compare_with_baseline(what, m, baseline, baseline_label, cfg, log, target=1.1):
    """Time the compiled declaration ``m`` against ``baseline(m, x)`` (same weights)."""
    B, N = cfg["B"], cfg["N"]
    x = torch.randn(B, N, m.d_model, requires_grad=True)
    layer = sa.compile(m)
    err = check_close(layer(x), baseline(m, x), what)
    t = time_pair({"structattn": lambda: layer(x), "baseline": lambda: baseline(m, x)},
                  [x, *m.parameters()], cfg["warmup"], cfg["repeats"])
    ratio = t["structattn"] / t["baseline"]
    log(f"{what}, B={B} H={m.heads} N={N} d={m.d_k}, fwd+bwd: structattn "
        f"{t['structattn'] * 1e3:.1f} ms, {baseline_label} {t['baseline'] * 1e3:.1f} ms, ratio "
        f"{ratio:.3f} (target ≤ {target}) {'OK' if ratio <= target else 'MISS'}; max|Δ| {err:.1e}")
    return {"structattn_s": t["structattn"], "baseline_s": t["baseline"], "ratio": ratio}


def section_relative(cfg, log):
    H, d = cfg["H"], cfg["d"]
    m = sa.models.relative_position_attention(H * d, max_distance=cfg["K"], heads=H, d_k=d)
    with torch.no_grad():
        m.position_logits.normal_()
    return compare_with_baseline(f"relative positions (K={cfg['K']})", m, relative_sdpa,
                                 "hand-written SDPA + same bias", cfg, log)


def section_multihop(cfg, log):
    H, d = cfg["H"], cfg["d"]
    m = sa.models.multihop_attention(H * d, heads=H, d_k=d, hop_weights=(0, 1, 1))
    return compare_with_baseline("multihop (P + P²)VX", m, two_sdpa_calls,
                                 "two hand-written SDPA calls", cfg, log)


# -- graph: each variant in its own process for an honest peak -----------------------------

def random_graph(n, degree, seed):
    g = torch.Generator().manual_seed(seed)
    nodes = torch.arange(n)
    others = torch.randint(n, (2, n * (degree - 1)), generator=g)
    # self-loops: no child without parents; a support is a set: no duplicate edges
    return torch.cat([torch.stack([nodes, nodes]), others], dim=1).unique(dim=1)


def graph_child(variant, n, degree, d, repeats):
    """One variant at one size in this process: a JSON line of its time and peak."""
    torch.manual_seed(0)
    edge_index = random_graph(n, degree, 0)
    m = sa.models.graph_attention(d, d_k=d, heads=1)
    x = torch.randn(1, n, d, requires_grad=True)
    if variant == "dense":
        adjacency = torch.zeros(n, n, dtype=torch.bool)
        adjacency[edge_index[1], edge_index[0]] = True
    else:
        adjacency = edge_index
    layer = sa.compile(m)
    params = [x, *m.parameters()]
    for _ in range(3):  # warm-up: read, record the plan, replay — the peak is a replay's
        fwd_bwd(lambda: layer(x, adjacency), params)
    peak = measure_peak_mib(lambda: fwd_bwd(lambda: layer(x, adjacency), params))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fwd_bwd(lambda: layer(x, adjacency), params)
        times.append(time.perf_counter() - t)
    print(json.dumps({"seconds": min(times), "median_s": statistics.median(times),
                      "peak_mib": peak, "edges": int(edge_index.shape[1])}), flush=True)


def run_graph_children(runs, degree, d, repeats):
    """``[(variant, n), …]`` → their records, run in turn in one fresh subprocess."""
    out = subprocess.run([sys.executable, __file__, "--graph-child", str(degree), str(d),
                          str(repeats), *(f"{v}:{n}" for v, n in runs)],
                         capture_output=True, text=True, check=True)
    lines = [ln for ln in out.stdout.strip().splitlines() if ln.startswith("{")]
    return [json.loads(ln) for ln in lines[-len(runs):]]


def section_graph(cfg, log, fresh=True):
    """``fresh``: each run in its own subprocess; else (the smoke test) all in one, up front."""
    d, degree, repeats = cfg["graph_d"], cfg["degree"], cfg["graph_repeats"]
    runs = [("edges", cfg["graph_N"]), ("edges", cfg["small_N"]), ("dense", cfg["small_N"])]
    done = {} if fresh else dict(zip(runs, run_graph_children(runs, degree, d, repeats),
                                     strict=True))

    def result(run):
        return done[run] if run in done else run_graph_children([run], degree, d, repeats)[0]

    big = result(runs[0])
    log(f"graph attention, edge list, N={cfg['graph_N']:,} nodes, E={big['edges']:,} edges, d={d}: "
        f"fwd+bwd {big['seconds']:.2f} s (median {big['median_s']:.2f} s), peak +{big['peak_mib']:.0f} MiB")
    dense_gib = cfg["graph_N"] ** 2 / 2**30
    log(f"  dense-mask path at N={cfg['graph_N']:,}: the boolean mask alone is {dense_gib:.2f} GiB "
        f"and a materialised posterior {4 * dense_gib:.2f} GiB"
        + (" — does not fit in 24 GiB" if 5 * dense_gib > 24 else "")
        + f"; both paths compared at N={cfg['small_N']:,}, same degree:")
    small = {v: result((v, cfg["small_N"])) for v in ("edges", "dense")}
    for v, r in small.items():
        log(f"  N={cfg['small_N']:,}, E={r['edges']:,}: {v:5s} fwd+bwd {r['seconds'] * 1e3:.0f} ms, "
            f"peak +{r['peak_mib']:.0f} MiB")
    log(f"  edge list / dense mask: time {small['edges']['seconds'] / small['dense']['seconds']:.2f}×, "
        f"peak memory {small['edges']['peak_mib']:.0f} vs {small['dense']['peak_mib']:.0f} MiB")
    return {"large": big, "small": small}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--graph-child", nargs="+",  # DEGREE D REPEATS VARIANT:N …
                   help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.graph_child:
        degree, d, repeats = (int(a) for a in args.graph_child[:3])
        for run in args.graph_child[3:]:
            v, n = run.split(":")
            graph_child(v, int(n), degree, d, repeats)
        return None
    cfg = dict(B=8, H=8, N=1024, d=64, K=128, warmup=2, repeats=10, graph_N=100_000, degree=16,
               graph_d=64, small_N=8192, graph_repeats=3)
    if args.quick:
        cfg.update(B=2, H=2, N=64, d=8, K=8, warmup=1, repeats=3, graph_N=2000, small_N=500,
                   graph_d=8, graph_repeats=1)
    lines = []

    def log(s):
        print(s, flush=True)
        lines.append(s)

    log(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cores, "
        f"float32, CPU")
    results = {"config": cfg, "relative": section_relative(cfg, log),
               "multihop": section_multihop(cfg, log),
               "graph": section_graph(cfg, log, fresh=not args.quick)}
    _results.save("single_shot", results, args.json, quick=args.quick)
    return results


if __name__ == "__main__":
    main()
