"""Distance priors at SDPA speed: FoX, causal ALiBi, stick-breaking; forward+backward, one run.

Both priors' log weights are a difference of per-token terms (c_i − c_j; −m·i + m·j), which
structattn lowers without an N×N bias (``Prior.terms``): on the CPU as the fused kernel with
the per-parent term as its mask, broadcast over the queries, trained through a backward
kernel of ours that returns the term's gradient too (``structattn/kinds/key_bias.py``,
``csrc/key_bias.cpp``); elsewhere as plain causal SDPA with one more key dimension carrying the
term. Compared, per N, with the same weights:

- ``causal SDPA``: a hand-written causal self-attention layer without any bias — the baseline
  (projections + ``scaled_dot_product_attention(is_causal=True)``);
- ``FoX, structattn`` / ``ALiBi, structattn``: the compiled ``forgetting_attention`` /
  ``alibi_attention`` (replayed plans);
- ``FoX, dense bias`` / ``ALiBi, dense bias``: each paper's formulation in eager torch — the
  log prior materialised as an ``(H, N, N)`` float bias and passed to SDPA as ``attn_mask``;
- ``stick-breaking, structattn``: the compiled ``stick_breaking_attention`` (its CPU kernel,
  which stops a scan once the stick left is under rounding — on these random weights, tens of
  tokens back); ``stick-breaking, every pair``: the same with ``tol=0``, reading all N²/2
  pairs, the worst case; ``stick-breaking, eager``: the paper's formulation in eager torch,
  log A_ij = log σ(s_ij) + Σ_{j<l<i} log σ(−s_il) as a reverse cumulative sum over an
  ``(H, N, N)`` score matrix.

``FoX, certified`` / ``ALiBi, certified``: the same layers with ``tol`` (default 1e-4): only
the window whose posterior mass beyond it is certified ≤ tol for every token is read
(``structattn/certificates/certified.py``; the fraction of pairs skipped is printed) — FoX's adaptive
computation pruning with a proof. ALiBi's slopes are the paper's, 2^(−8h/H): its slowest
head (1/256 for H = 4) rarely certifies a window shorter than the sequence. ``Gaussian, dense
bias`` / ``Gaussian, certified``: BAM's generalised Gaussian (``generalised_gaussian_attention``,
width 16, β = 1), which has no fast path without ``tol`` (its log prior does not separate:
an ``(H, N, N)`` bias, up to N = 4,096), and with it.

B=1, H=4, d_model=256 (d=64 per head), float32, N = 1,024 and 4,096 (``--long``: 16,384 too,
without the dense-bias and eager variants, whose bias alone would take 4 GiB). Reported: median time
of forward+backward over interleaved rounds, the median per-round ratio to causal SDPA
(``paired``), and the peak of live tensor bytes during one forward+backward (the profiler's
allocation events) relative to causal SDPA; then the forward alone without gradients
(inference), timed the same way; beside each paired median, the quartiles of the per-round
ratios (the records keep those and their extremes). Targets (issue 22): FoX and ALiBi ≤ 1.1× causal
SDPA in time and peak memory; stick-breaking ≤ 2× causal SDPA in time. Run:
``python benchmarks/bench_distance_priors.py [--quick] [--long] [--json PATH] [--isa avx2]``
(``--isa avx2``: an AVX2 machine on an AVX-512 one — structattn's kernels built for AVX2 and
PyTorch's held to AVX2, ``_results.AVX2``).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import _results  # noqa: E402  (this script's own folder)
from _device import cuda_peak_bytes, sync  # noqa: E402  (the script's own folder)

import structattn as sa  # noqa: E402

heads_of, merge = sa.split_heads, sa.merge_heads  # (…, n, H·d) ↔ (…, H, n, d)


def _qkv(m, x):
    H = m.heads
    return (heads_of(F.linear(x, m.W_q), H), heads_of(F.linear(x, m.W_k), H),
            heads_of(F.linear(x, m.W_v), H))


def causal_sdpa(m, x):
    """The baseline: projections and one causal SDPA call, no bias."""
    q, k, v = _qkv(m, x)
    return F.linear(merge(F.scaled_dot_product_attention(q, k, v, is_causal=True)), m.W_o)


def fox_dense_bias(m, x):
    """FoX as its paper writes it, in eager torch: D_ij = c_i − c_j (j ≤ i, −∞ above),
    c = cumsum(log σ(W_f x + b_f)), added to the logits as an (H, N, N) bias."""
    q, k, v = _qkv(m, x)
    c = torch.cumsum(F.logsigmoid(F.linear(x, m.W_f, m.b_f)), -2).movedim(-1, -2)  # (B, H, N)
    n = x.shape[-2]
    bias = (c[..., :, None] - c[..., None, :]).masked_fill(
        ~torch.ones(n, n, dtype=torch.bool, device=x.device).tril(), float("-inf"))
    return F.linear(merge(F.scaled_dot_product_attention(q, k, v, attn_mask=bias)), m.W_o)


def alibi_dense_bias(m, x):
    """ALiBi as its paper writes it: −m_h (i − j) for j ≤ i, −∞ above, an (H, N, N) bias."""
    q, k, v = _qkv(m, x)
    n = x.shape[-2]
    i = torch.arange(n, device=x.device)
    dist = (i[:, None] - i[None, :]).to(x.dtype)
    bias = (-m.slopes[:, None, None] * dist).masked_fill(dist < 0, float("-inf"))
    return F.linear(merge(F.scaled_dot_product_attention(q, k, v, attn_mask=bias)), m.W_o)


def stick_breaking_eager(m, x):
    """Stick-breaking as its paper writes it, in eager torch: A_ij = β_ij Π_{j<l<i} (1 − β_il),
    β = σ(q_i·k_j/√d), j < i, through logs — an (H, N, N) attention matrix."""
    q, k, v = _qkv(m, x)
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    n = x.shape[-2]
    before = torch.ones(n, n, dtype=torch.bool, device=x.device).tril(-1)
    log_pass = F.logsigmoid(-s).masked_fill(~before, 0.0)
    nearer = log_pass.flip(-1).cumsum(-1).flip(-1) - log_pass  # Σ_{j<l<i} log(1 − β_il)
    att = (F.logsigmoid(s) + nearer).masked_fill(~before, float("-inf")).exp()
    return F.linear(merge(att @ v), m.W_o)


def _params(m):
    return [p for p in m.parameters() if p.requires_grad]


def _fwd_bwd(fn, x, params):
    for p in (x, *params):
        p.grad = None
    fn().sum().backward()


def peak_bytes(fn, x, params) -> int:
    """Peak of live tensor bytes during one forward+backward (profiler allocation events; on
    a GPU the caching allocator's peak over what was allocated before)."""
    from torch.profiler import ProfilerActivity, profile

    _fwd_bwd(fn, x, params)
    gc.collect()
    if x.is_cuda:
        for p in (x, *params):
            p.grad = None
        return cuda_peak_bytes(lambda: _fwd_bwd(fn, x, params), x.device)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _fwd_bwd(fn, x, params)
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    cur = peak = 0
    for e in events:
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak


def _forward(fn, x, params):
    with torch.no_grad():
        fn()


def time_fwd_bwd(fns: dict, x, rounds: int, backward: bool = True) -> dict:
    """Interleaved rounds of forward+backward (or, ``backward=False``, of the forward alone
    without gradients: inference)."""
    once = _fwd_bwd if backward else _forward
    for fn, params in fns.values():
        for _ in range(3):  # read, record, replay
            once(fn, x, params)
    times = {k: [] for k in fns}
    names = list(fns)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            fn, params = fns[name]
            sync(x.device)
            t = time.perf_counter()
            once(fn, x, params)
            sync(x.device)
            times[name].append(time.perf_counter() - t)
    base = times["causal SDPA"]
    out = {}
    for k, v in times.items():
        ratios = sorted(a / b for a, b in zip(v, base, strict=True))
        # the spread of the per-round ratios: their quartiles, and the extremes
        q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        out[k] = {"median_s": statistics.median(v), "paired": statistics.median(ratios),
                  "paired_quartiles": [q1, q3], "paired_range": [ratios[0], ratios[-1]]}
    return out


def same_weights(source, *models) -> None:
    """Copy ``source``'s projections W_Q, W_K, W_V, W_O into each of ``models``."""
    with torch.no_grad():
        for m in models:
            for name in ("W_q", "W_k", "W_v", "W_o"):
                getattr(m, name).copy_(getattr(source, name))


def run(n: int, cfg: dict, log) -> dict:
    torch.manual_seed(0)
    d, H = cfg["d_model"], cfg["heads"]
    fox = sa.models.forgetting_attention(d, heads=H)
    alibi = sa.models.alibi_attention(d, heads=H)
    same_weights(fox, alibi)
    sb = sa.models.stick_breaking_attention(d, heads=H)
    sb_every = sa.models.stick_breaking_attention(d, heads=H, tol=0.0)
    same_weights(fox, sb, sb_every)
    for m in (fox, alibi, sb, sb_every):
        m.to(cfg["device"])
    x = torch.randn(1, n, d, device=cfg["device"], requires_grad=True)
    fox_layer, alibi_layer = sa.compile(fox), sa.compile(alibi)
    sb_layer, sb_every_layer = sa.compile(sb), sa.compile(sb_every)
    fox_cut = sa.models.forgetting_attention(d, heads=H, tol=cfg["tol"]).to(cfg["device"])
    alibi_cut = sa.models.alibi_attention(d, heads=H, tol=cfg["tol"]).to(cfg["device"])
    fox_cut.load_state_dict(fox.state_dict())
    alibi_cut.load_state_dict(alibi.state_dict())
    fox_cut_layer, alibi_cut_layer = sa.compile(fox_cut), sa.compile(alibi_cut)
    # BAM's generalised Gaussian (width 16, Laplace): no fast path without tol — a dense bias
    gauss = sa.models.generalised_gaussian_attention(d, heads=H).to(cfg["device"])
    gauss_cut = sa.models.generalised_gaussian_attention(d, heads=H, tol=cfg["tol"]).to(
        cfg["device"])
    same_weights(fox, gauss, gauss_cut)
    gauss_layer, gauss_cut_layer = sa.compile(gauss), sa.compile(gauss_cut)
    skipped = {}
    with torch.no_grad():
        for k, layer, m in (("FoX, certified", fox_cut_layer, fox_cut),
                            ("ALiBi, certified", alibi_cut_layer, alibi_cut),
                            ("Gaussian, certified", gauss_cut_layer, gauss_cut)):
            if cfg.get("variants") and not any(w in k for w in cfg["variants"]):
                continue
            c = layer(x, return_trace=True)[1].truncation[m.family_name]
            # each head's width where each reads its own (the band kernels), else the shared
            heads = c.heads.flatten().tolist() if c.heads is not None else [c.width]
            skipped[k] = (c.width, c.skipped, float(c.bound.max()), heads)
    dense = n <= cfg["dense_up_to"]
    if dense:  # the lowering computes what the papers' formulations compute
        with torch.no_grad():
            torch.testing.assert_close(fox_layer(x), fox_dense_bias(fox, x), rtol=1e-3, atol=1e-4)
            torch.testing.assert_close(alibi_layer(x), alibi_dense_bias(alibi, x), rtol=1e-3,
                                       atol=1e-4)
            want = stick_breaking_eager(sb, x)
            torch.testing.assert_close(sb_layer(x), want, rtol=1e-3, atol=1e-4)
            torch.testing.assert_close(sb_every_layer(x), want, rtol=1e-3, atol=1e-4)
    fns = {"causal SDPA": ((lambda: causal_sdpa(fox, x)), _params(fox)),
           "FoX, structattn": ((lambda: fox_layer(x)), _params(fox)),
           "ALiBi, structattn": ((lambda: alibi_layer(x)), _params(alibi)),
           "stick-breaking, structattn": ((lambda: sb_layer(x)), _params(sb)),
           "stick-breaking, every pair": ((lambda: sb_every_layer(x)), _params(sb_every)),
           "FoX, certified": ((lambda: fox_cut_layer(x)), _params(fox_cut)),
           "ALiBi, certified": ((lambda: alibi_cut_layer(x)), _params(alibi_cut)),
           "Gaussian, certified": ((lambda: gauss_cut_layer(x)), _params(gauss_cut))}
    if dense:
        fns["FoX, dense bias"] = ((lambda: fox_dense_bias(fox, x)), _params(fox))
        fns["ALiBi, dense bias"] = ((lambda: alibi_dense_bias(alibi, x)), _params(alibi))
        fns["stick-breaking, eager"] = ((lambda: stick_breaking_eager(sb, x)), _params(sb))
        fns["Gaussian, dense bias"] = ((lambda: gauss_layer(x)), _params(gauss))
    if cfg.get("variants"):  # these only (and the baseline)
        fns = {k: v for k, v in fns.items()
               if k == "causal SDPA" or any(w in k for w in cfg["variants"])}
        skipped = {k: v for k, v in skipped.items() if k in fns}
    res = time_fwd_bwd(fns, x, cfg["rounds"])
    mem = {k: peak_bytes(fn, x, params) for k, (fn, params) in fns.items()}
    log(f"N={n}, B=1, H={H}, d={d // H} per head, forward+backward "
        f"(causal SDPA {res['causal SDPA']['median_s'] * 1e3:.1f} ms, peak "
        f"{mem['causal SDPA'] / 2**20:.1f} MiB):")
    for k in fns:
        target = (" (target ≤ 2 in time)" if k.startswith("stick") and "eager" not in k
                  else " (target ≤ 1.1)" if "structattn" in k else "")
        q1, q3 = res[k]["paired_quartiles"]
        log(f"    {k:<27} {res[k]['median_s'] * 1e3:9.1f} ms  paired {res[k]['paired']:.3f}× "
            f"({q1:.2f}–{q3:.2f})  peak {mem[k] / 2**20:8.1f} MiB "
            f"{mem[k] / mem['causal SDPA']:.3f}×{target}")
        res[k]["peak_bytes"] = mem[k]
    for k, (width, frac, worst, heads) in skipped.items():
        log(f"    {k} (tol {cfg['tol']:g}): window {width} (per head {heads}), {frac:.1%} of "
            f"the pairs skipped, largest bound {worst:.2g}")
        res[k]["window"], res[k]["skipped"], res[k]["largest_bound"] = width, frac, worst
        res[k]["head_windows"] = heads
    inference = tuple(k for k in ("causal SDPA", "FoX, structattn", "ALiBi, structattn",
                                  "stick-breaking, structattn", "FoX, certified",
                                  "ALiBi, certified", "Gaussian, certified") if k in fns)
    fwd = time_fwd_bwd({k: fns[k] for k in inference}, x, cfg["rounds"], backward=False)
    log(f"    forward alone, no gradients (causal SDPA {fwd['causal SDPA']['median_s'] * 1e3:.1f} ms):")
    for k in inference[1:]:
        q1, q3 = fwd[k]["paired_quartiles"]
        log(f"    {k:<27} {fwd[k]['median_s'] * 1e3:9.1f} ms  paired {fwd[k]['paired']:.3f}× "
            f"({q1:.2f}–{q3:.2f})")
    res["forward"] = fwd
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, one round (smoke test)")
    p.add_argument("--long", action="store_true", help="also N = 16,384")
    p.add_argument("--sizes", type=int, nargs="+", metavar="N", help="these N only")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--tol", type=float, default=1e-4,
                   help="the certified layers' tol (posterior mass a window may leave out)")
    p.add_argument("--variants", nargs="+", metavar="NAME",
                   help="only the variants whose names contain one of these (and causal SDPA)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--isa", choices=["native", "avx2"],
                   help="the instruction set: native (as the machine is) or avx2 (structattn's "
                        "kernels built for AVX2 and PyTorch's held to AVX2: an AVX2 machine)")
    args = p.parse_args(argv)
    _results.run_as(args.isa)
    cfg = dict(d_model=256, heads=4, sizes=[1024, 4096], rounds=args.rounds, dense_up_to=4096,
               device=torch.device(args.device), tol=args.tol, variants=args.variants)
    if args.long:
        cfg["sizes"].append(16384)
    if args.sizes:
        cfg["sizes"] = args.sizes
    if args.quick:
        cfg.update(d_model=32, heads=2, sizes=[64], rounds=1)
    lines = []

    def log(s):
        print(s, flush=True)
        lines.append(s)

    dev = cfg["device"]
    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    isa = _results.cpu()
    log(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, {where} "
        f"({isa['cpu_isa']}; kernels built for {isa['kernel_isa']}, PyTorch's dispatch "
        f"{isa['torch_cpu_capability']})")
    results = {"config": cfg, "runs": {n: run(n, cfg, log) for n in cfg["sizes"]}}
    _results.save("distance_priors", results, args.json, quick=args.quick, device=args.device)
    return results


if __name__ == "__main__":
    main()
