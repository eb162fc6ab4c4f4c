"""Certified eviction (``layer.new_cache(tol=1e-4, …)``) against the full cache, decoding a
byte-level text token by token.

The model: a one-layer byte LM — embedding (256 → d), LayerNorm without affine parameters,
a FoX or an ALiBi layer (``heads`` heads), the residual, LayerNorm, the tied embedding as the
readout scaled by 1/√d — with its initial (untrained) weights; ALiBi's slopes are set to 2^(−5h/H) (a
quickly set model: the default 2^(−8h/H) gives the slowest head a weight that halves only
every 256 tokens). The text: the Python standard library's source, bytes. The ceilings: each
head's longest query and key over the first ``--calibrate`` tokens, times ``--margin``
(``query_norm=``, ``key_norm=``; a later token beyond them stops eviction, and the record
says so).

Measured, for each model:

- decoding both caches in turn (``--alternate`` tokens by the evicting cache, then the
  same tokens by the full one: paired, interleaved rounds) to ``--full-to`` tokens, then
  the evicting cache alone to ``--n``: the tokens held and the milliseconds per token
  (median over the ``--window`` tokens before each position), and tokens/s at
  ``--ratio-at`` (the evicting cache's over the full one's: the ratio of the medians, and
  the median over the paired turns of the ``--ratio-window`` tokens before it of each
  turn's ratio);
- the largest bound the trace reports, whether every step stayed certified;
- bits per byte of the first ``--val`` bytes, fed token by token through the evicting
  cache, against the full forward (``layer(x)``, one call) of the same bytes, and the
  evicting cache's bits per byte over all ``--n`` bytes against the full cache's over the
  lockstep part.

Run: ``python benchmarks/bench_decode_evict.py [--quick] [--json P]`` (records
``benchmarks/results/decode_evict.json``). One thread by default (``--threads``).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _results  # noqa: E402

import structattn as sa  # noqa: E402


def stdlib_bytes(n: int) -> torch.Tensor:
    """The first n bytes of the standard library's .py files, in sorted order ``(n,)``."""
    root = os.path.dirname(os.__file__)
    out = bytearray()
    for name in sorted(os.listdir(root)):
        if name.endswith(".py"):
            with open(os.path.join(root, name), "rb") as fh:
                out += fh.read()
            if len(out) >= n:
                break
    if len(out) < n:
        raise SystemExit(f"the standard library holds {len(out)} bytes of top-level source; "
                         f"asked for {n}")
    return torch.tensor(list(out[:n]), dtype=torch.long)


class ByteLM(torch.nn.Module):
    """embedding → LayerNorm → attention (+ residual) → LayerNorm → tied readout."""

    def __init__(self, kind: str, d: int, heads: int, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(256, d)
        if kind == "FoX":
            model = sa.models.forgetting_attention(d, heads=heads)
        else:
            model = sa.models.alibi_attention(d, heads=heads)
            h = torch.arange(1, heads + 1, dtype=model.slopes.dtype)
            model.slopes.copy_(2.0 ** (-5.0 * h / heads))
        self.layer = sa.compile(model)

    def inputs(self, tokens):
        return F.layer_norm(self.emb(tokens), (self.emb.embedding_dim,))

    def readout(self, x, h):
        z = F.layer_norm(x + h, (x.shape[-1],))
        return z @ self.emb.weight.T / math.sqrt(x.shape[-1])  # (…, 256)

    def forward(self, tokens):  # the full forward: (1, n) → (1, n, 256)
        x = self.inputs(tokens)
        return self.readout(x, self.layer(x))


def bits(logits, targets) -> float:
    """Mean −log₂ p(target) over the positions, float64."""
    return float(F.cross_entropy(logits.double().reshape(-1, 256), targets.reshape(-1))) \
        / math.log(2)


def ceilings(lm, x, calibrate, margin):
    """Each head's longest query and key over the first ``calibrate`` tokens × margin."""
    m = lm.layer.declaration
    H = m.heads
    xs = x[:, :calibrate]

    def longest(W):
        return (xs @ W.T).unflatten(-1, (H, -1)).double().norm(dim=-1).amax(dim=(0, 1)) * margin
    return {"query_norm": longest(m.W_q), "key_norm": longest(m.W_k)}


def paired_ratio(t_ev, t_full, at, args):
    """The median, over the turns in the ``ratio_window`` tokens before ``at``, of the full
    cache's median time per token in the turn over the evicting cache's."""
    ratios = []
    for c0 in range(max(0, at - args.ratio_window), at, args.alternate):
        c1 = min(at, c0 + args.alternate)
        ratios.append(statistics.median(t_full[c0:c1]) / statistics.median(t_ev[c0:c1]))
    return statistics.median(ratios)


def run_model(kind, args, tokens):
    lm = ByteLM(kind, args.d, args.heads, args.seed)
    layer = lm.layer
    with torch.no_grad():
        x = lm.inputs(tokens[None, :args.n])  # (1, n, d)
        ceil = ceilings(lm, x, args.calibrate, args.margin)
        ev = layer.new_cache(tol=args.tol, block=args.block, **ceil)
        full = layer.new_cache()
        t_ev, t_full = [], []
        nll_ev, nll_full = [], []
        targets = tokens[1:args.n + 1]
        for c0 in range(0, args.n, args.alternate):  # paired rounds of ``alternate`` tokens
            chunk = range(c0, min(args.n, c0 + args.alternate))
            for t in chunk:
                xt = x[:, t:t + 1]
                t0 = time.perf_counter()
                h = layer(xt, cache=ev)
                t_ev.append(time.perf_counter() - t0)
                nll_ev.append(lm.readout(xt, h)[0, 0])
            for t in chunk:
                if t >= args.full_to:
                    break
                xt = x[:, t:t + 1]
                t0 = time.perf_counter()
                hf = layer(xt, cache=full)
                t_full.append(time.perf_counter() - t0)
                nll_full.append(lm.readout(xt, hf)[0, 0])
        logits_ev = torch.stack(nll_ev)  # (n, 256)
        logits_full = torch.stack(nll_full)
        val = min(args.val, args.n)
        reference = lm(tokens[None, :val])[0]  # the full forward, one call
    trace = ev.trace

    def ms(times, at):
        lo = max(0, at - args.window)
        return 1e3 * statistics.median(times[lo:at]) if at <= len(times) else None
    positions = [p for p in args.positions if p <= args.n]
    ratio_at = min(args.ratio_at, args.full_to)
    row = {
        "model": kind, "d_model": args.d, "heads": args.heads, "tol": args.tol,
        "block": args.block, "tokens": args.n, "ceilings": {k: v.tolist() for k, v in ceil.items()},
        "held_at": {p: trace[p - 1].held for p in positions},
        "held_max": max(s.held for s in trace), "evicted": ev.evicted,
        "ms_per_token_evict": {p: ms(t_ev, p) for p in positions},
        "ms_per_token_full": {p: ms(t_full, p) for p in positions if p <= args.full_to},
        "ratio_at": ratio_at,
        "tokens_per_s_ratio": ms(t_full, ratio_at) / ms(t_ev, ratio_at),
        # the median over the turns of the ``--ratio-window`` tokens before ratio_at of each
        # turn's ratio (paired: the two caches' turns ran back to back, under the same load)
        "tokens_per_s_ratio_paired": paired_ratio(t_ev, t_full, ratio_at, args),
        "bound_max": max(s.bound for s in trace),
        "certified": all(s.certified for s in trace),
        "val_bytes": val,
        "bpb_full_forward": bits(reference, targets[:val]),
        "bpb_evict_token_by_token": bits(logits_ev[:val], targets[:val]),
        "bpb_full_cache_lockstep": bits(logits_full, targets[:args.full_to]),
        "bpb_evict_lockstep": bits(logits_ev[:args.full_to], targets[:args.full_to]),
        "bpb_evict_all": bits(logits_ev, targets),
    }
    row["bpb_diff_vs_full_forward"] = abs(row["bpb_evict_token_by_token"]
                                          - row["bpb_full_forward"])
    row["bpb_diff_vs_full_cache"] = abs(row["bpb_evict_lockstep"]
                                        - row["bpb_full_cache_lockstep"])
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes: checks every path runs")
    ap.add_argument("--models", nargs="+", default=["FoX", "ALiBi"])
    ap.add_argument("--n", type=int, default=65536, help="tokens decoded by the evicting cache")
    ap.add_argument("--full-to", type=int, default=16384, help="tokens the full cache reads")
    ap.add_argument("--ratio-at", type=int, default=16384)
    ap.add_argument("--ratio-window", type=int, default=1024,
                    help="tokens before --ratio-at whose paired turns give the ratio")
    ap.add_argument("--positions", type=int, nargs="+",
                    default=[1024, 2048, 4096, 8192, 16384, 32768, 65536])
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--alternate", type=int, default=64,
                    help="tokens each cache reads in turn (paired, interleaved rounds)")
    ap.add_argument("--val", type=int, default=4096, help="bytes of the full forward's bpb")
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--calibrate", type=int, default=4096)
    ap.add_argument("--margin", type=float, default=1.25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.quick:  # long enough that both models evict (ALiBi's slowest head after ~1,000)
        args.n, args.full_to, args.ratio_at, args.val = 1088, 384, 384, 256
        args.positions, args.window, args.d, args.heads = [256, 512, 1088], 64, 64, 4
        args.ratio_window = 128
        args.calibrate = 1024
    torch.set_num_threads(args.threads)
    tokens = stdlib_bytes(args.n + 1)
    rows = []
    for kind in args.models:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        row = run_model(kind, args, tokens)
        # the machine's 1-minute load average before and after (a shared machine's timings)
        row["load_average"] = [load, os.getloadavg()[0] if load is not None else None]
        rows.append(row)
        print(f"{kind}: held {row['held_at']} (max {row['held_max']}), ms/token evict "
              f"{ {p: round(v, 3) for p, v in row['ms_per_token_evict'].items()} } full "
              f"{ {p: round(v, 3) for p, v in row['ms_per_token_full'].items()} }; tokens/s "
              f"×{row['tokens_per_s_ratio']:.2f} at {row['ratio_at']} (paired turns "
              f"×{row['tokens_per_s_ratio_paired']:.2f}); bound ≤ "
              f"{row['bound_max']:.3g} certified={row['certified']}; bpb "
              f"{row['bpb_evict_token_by_token']:.6f} vs full forward "
              f"{row['bpb_full_forward']:.6f} (Δ {row['bpb_diff_vs_full_forward']:.2e}), "
              f"all {row['bpb_evict_all']:.4f}", flush=True)
    _results.save("decode_evict", {"rows": rows, "args": vars(args)}, args.json,
                  quick=args.quick)
    return rows


if __name__ == "__main__":
    main()
