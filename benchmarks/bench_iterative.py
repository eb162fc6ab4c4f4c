"""Iterative models vs the strongest baselines, in one run.

1. slot attention (``recipe="original"``) forward+backward vs the ``slot-attention``
   package (1.5.2) with the same weights, B=16, 1,024 inputs, dim 64, 7 slots,
   3 iterations — target ≤ 1.0×;
2. Hopfield retrieval (T update steps, multi-head) forward+backward vs a hand-written
   loop of ``scaled_dot_product_attention`` calls with the same weights — target ≤ 1.05×;
   and the forward alone;
3. predictive coding with attention (each unit picks one incoming unit; and blocks of units,
   each block picking one block of the layer below): time per inference step vs a
   hand-written dense implementation of the same gradient update — target ≤ 1.05×;
4. the fixed point vs Pyro's ground truth (MAP with a point-mass guide, edges enumerated,
   L-BFGS): wall time of each and the distance between them.

Each variant's peak memory is the growth of the RSS high-water mark during one
forward+backward, measured in a fresh subprocess after a warm-up (``_memory.py``; ``--quick``
measures the four variants in one subprocess, one after the other).
Run: ``python benchmarks/bench_iterative.py [--quick] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
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


def hopfield_by_hand(m, r, Y):
    """ξ ← Kᵀ softmax(βKξ) T times, then W_O concat(Vᵀ softmax(βKξ_T)): one SDPA per step."""
    H, T = m.heads, m.update_steps
    K, V = heads_of(Y @ m.W_k.T, H), heads_of(Y @ m.W_v.T, H)
    xi = heads_of(r @ m.W_q.T, H)
    for _ in range(T):
        xi = F.scaled_dot_product_attention(xi, K, K, scale=m.beta)
    return merge(F.scaled_dot_product_attention(xi, K, V, scale=m.beta)) @ m.W_o.T


# -- the measured variants (each builds its own model from a seed: same weights) -----------

def build(variant, cfg):
    torch.manual_seed(0)
    if variant.startswith("slots"):
        from slot_attention import SlotAttention as Peer

        B, N, D, S, T = cfg["slot_B"], cfg["slot_N"], cfg["slot_dim"], cfg["slots"], cfg["iters"]
        peer = Peer(S, D, iters=T)
        x = torch.randn(B, N, D, requires_grad=True)
        if variant == "slots-peer":
            return (lambda: peer(x)), [x, *peer.parameters()]
        m = sa.models.slot_attention(S, D, iters=T)
        m.load_state_dict(peer.state_dict())
        layer = sa.compile(m)
        return (lambda: layer(x)), [x, *m.parameters()]
    B, M, N, H, d, T = (cfg[k] for k in ("hop_B", "hop_M", "hop_N", "hop_H", "hop_d", "steps"))
    m = sa.models.hopfield(H * d, H * d, heads=H, d_k=d, iteration=sa.IterationOptions(steps=T))
    r = torch.randn(B, M, H * d, requires_grad=True)
    Y = torch.randn(B, N, H * d, requires_grad=True)
    if variant == "hopfield-hand":
        return (lambda: hopfield_by_hand(m, r, Y)), [r, Y, *m.parameters()]
    layer = sa.compile(m)
    return (lambda: layer(r, Y)), [r, Y, *m.parameters()]


def fwd_bwd(fn, params):
    for p in params:
        p.grad = None
    fn().sum().backward()


def child(cfg, variants):
    """Peak memory of one forward+backward of each variant in turn, in this fresh process
    (each after a warm-up): one JSON line per variant."""
    for variant in variants:
        fn, params = build(variant, cfg)
        for _ in range(3):  # a compiled module reads, records its plan, then replays: measure a replay
            fwd_bwd(fn, params)
        print(json.dumps({"variant": variant,
                          "peak_mib": measure_peak_mib(lambda fn=fn, p=params: fwd_bwd(fn, p))}))


def peaks_in_subprocesses(variants: dict, cfg, fresh: bool = True) -> dict:
    """name → peak MiB of the variant ``variants[name]``, each in a fresh subprocess, or, where
    not ``fresh`` (the smoke test), all in one subprocess."""
    groups = [[v] for v in variants.values()] if fresh else [list(variants.values())]
    peaks = {}
    for group in groups:
        out = subprocess.run([sys.executable, __file__, "--child", json.dumps(cfg), *group],
                             capture_output=True, text=True, check=True)
        for line in out.stdout.strip().splitlines():
            if line.startswith("{"):
                row = json.loads(line)
                peaks[row["variant"]] = row["peak_mib"]
    return {name: peaks[v] for name, v in variants.items()}


def time_pair(fns: dict, warmup: int, repeats: int, backward: bool = True) -> dict:
    """Median seconds per call, variants interleaved (order flipped each round)."""
    def once(fn, params):
        if backward:
            fwd_bwd(fn, params)
        else:
            with torch.no_grad():
                fn()

    for fn, params in fns.values():
        for _ in range(warmup):
            once(fn, params)
    times = {k: [] for k in fns}
    names = list(fns)
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            t = time.perf_counter()
            once(*fns[name])
            times[name].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def section(title, ours, theirs, label, cfg, log, target, measured=None):
    """``measured``: variant → peak MiB measured already (the smoke test's, all in one
    subprocess); else each variant's is measured here in its own."""
    fns = {"structattn": build(ours, cfg), "baseline": build(theirs, cfg)}
    with torch.no_grad():
        torch.manual_seed(1)
        a = fns["structattn"][0]()
        torch.manual_seed(1)
        b = fns["baseline"][0]()
    err = float((a - b).abs().max())
    if err > 1e-3:
        raise AssertionError(f"{title}: structattn and {label} disagree by {err:.2e}")
    t = time_pair(fns, cfg["warmup"], cfg["repeats"])
    tf = time_pair(fns, cfg["warmup"], cfg["repeats"], backward=False)
    peaks = ({"structattn": measured[ours], "baseline": measured[theirs]} if measured else
             peaks_in_subprocesses({"structattn": ours, "baseline": theirs}, cfg))
    ratio, ratio_f = t["structattn"] / t["baseline"], tf["structattn"] / tf["baseline"]
    log(f"{title}: fwd+bwd structattn {t['structattn'] * 1e3:.1f} ms, {label} "
        f"{t['baseline'] * 1e3:.1f} ms, ratio {ratio:.3f} (target ≤ {target}) "
        f"{'OK' if ratio <= target else 'MISS'}; forward only {tf['structattn'] * 1e3:.1f} vs "
        f"{tf['baseline'] * 1e3:.1f} ms ({ratio_f:.3f}×); peak +{peaks['structattn']:.0f} vs "
        f"+{peaks['baseline']:.0f} MiB; max|Δ| {err:.1e}")
    return {"fwd_bwd_s": t, "forward_s": tf, "ratio": ratio, "forward_ratio": ratio_f,
            "peak_mib": peaks, "max_abs_diff": err}


def pcn_by_hand(m, x, steps, eta):
    """The attention PCN's inference written out: for each latent layer (in order), the
    gradient of F = −Σ log (1/n) Σ_j exp(−(k/2)e_ij²), e_ij = z_i − w_ij f(z_j) − b_i, from
    its own family (as child) and the next (as parent), then z ← z − η ∂F/∂z."""
    k, f = m.precision, torch.tanh
    Ws, bs = list(m.weights), list(m.biases)
    zs = [x]
    for l in range(1, len(Ws) + 1):
        zs.append((f(zs[-1]) @ Ws[l - 1].T) / Ws[l - 1].shape[1] + bs[l - 1])

    def post_and_err(l):  # family l: children z_l, parents z_{l−1}
        fz = f(zs[l - 1])[..., None, :]
        e = zs[l][..., :, None] - Ws[l - 1] * fz - bs[l - 1][:, None]  # (B, n_l, n_{l−1})
        return torch.softmax(-0.5 * k * e * e, -1), e, fz

    for _ in range(steps):
        for l in range(1, len(zs)):
            p, e, _ = post_and_err(l)
            grad = k * (p * e).sum(-1)  # as a child
            if l + 1 < len(zs):  # as a parent of layer l + 1
                p2, e2, _ = post_and_err(l + 1)
                grad = grad - k * (p2 * Ws[l] * e2).sum(-2) * (1 - f(zs[l]) ** 2)
            zs[l] = zs[l] - eta * grad
    return zs[-1]


def pcn_blocks_by_hand(m, x, steps, eta):
    """The block attention PCN's inference written out: layer l as B_l blocks ``(B, C, d)``,
    e_ij = z_i − W_ij f(z_j) − b_i per pair of blocks, p_ij = softmax_j(−(k/2)‖e_ij‖²);
    ∂F/∂z_i = k Σ_j p_ij e_ij (as a child) − k f'(z_j) ⊙ Σ_i p_ij W_ijᵀ e_ij (as a parent)."""
    k, f = m.precision, torch.tanh
    Ws, bs = list(m.weights), list(m.biases)
    zs = [x.unflatten(-1, (m.blocks[0], -1))]
    for l in range(1, len(Ws) + 1):
        W = Ws[l - 1]
        zs.append(torch.einsum("cpkd,bpd->bck", W, f(zs[-1])) / W.shape[1] + bs[l - 1])

    def post_and_err(l):  # family l: children z_l, parents z_{l−1}
        pred = torch.einsum("cpkd,bpd->bcpk", Ws[l - 1], f(zs[l - 1]))
        e = zs[l][:, :, None] - pred - bs[l - 1][:, None]  # (B, C, P, d_c)
        return torch.softmax(-0.5 * k * (e * e).sum(-1), -1), e

    for _ in range(steps):
        for l in range(1, len(zs)):
            p, e = post_and_err(l)
            grad = k * torch.einsum("bcp,bcpk->bck", p, e)  # as a child
            if l + 1 < len(zs):  # as a parent of layer l + 1
                p2, e2 = post_and_err(l + 1)
                grad = grad - k * torch.einsum("bcp,cpkd,bcpk->bpd", p2, Ws[l], e2) \
                    * (1 - f(zs[l]) ** 2)
            zs[l] = zs[l] - eta * grad
    return zs[-1].flatten(-2)


def section_pcn(cfg, log):
    out = {}
    for name, blocks, by_hand in (("units", None, pcn_by_hand),
                                  ("blocks", cfg["pcn_blocks"], pcn_blocks_by_hand)):
        torch.manual_seed(0)
        sizes, B, T = cfg["pcn_sizes"], cfg["pcn_B"], cfg["pcn_steps"]
        m = sa.models.predictive_coding(sizes, blocks=blocks, steps=T, step_size=0.1)
        x = torch.rand(B, sizes[0])
        layer = sa.compile(m)
        fns = {"structattn": (lambda layer=layer, x=x: layer(x), []),
               "baseline": (lambda m=m, x=x, f=by_hand, T=T: f(m, x, T, 0.1), [])}
        with torch.no_grad():
            err = float((fns["structattn"][0]() - fns["baseline"][0]()).abs().max())
        if err > 1e-3:
            raise AssertionError(f"predictive coding ({name}): structattn and the hand-written "
                                 f"loop disagree by {err:.2e}")
        t = time_pair(fns, cfg["warmup"], cfg["repeats"], backward=False)
        ratio = t["structattn"] / t["baseline"]
        what = "units" if blocks is None else f"blocks {blocks}"
        log(f"predictive coding with attention {sizes}, {what} (B={B}, {T} inference steps, no "
            f"grad): {t['structattn'] / T * 1e3:.2f} ms per step vs hand-written dense update "
            f"{t['baseline'] / T * 1e3:.2f} ms, ratio {ratio:.3f} (target ≤ 1.05) "
            f"{'OK' if ratio <= 1.05 else 'MISS'}; max|Δ| {err:.1e}")
        out[name] = {"per_step_s": {k: v / T for k, v in t.items()}, "ratio": ratio,
                     "max_abs_diff": err}
    return out


def section_ground_truth(cfg, log):
    """Compiled fixed point vs Pyro's MAP (float64, a small problem with a unique optimum)."""
    torch.manual_seed(0)
    B, M, N, d = cfg["gt_B"], cfg["gt_M"], cfg["gt_N"], cfg["gt_d"]
    m = sa.models.hopfield(d, heads=1, beta=0.5 / d,
                           iteration=sa.IterationOptions(steps=10_000, tol=1e-12),
                           dtype=torch.float64)
    r, Y = torch.randn(B, M, d, dtype=torch.float64), torch.randn(B, N, d, dtype=torch.float64)
    layer = sa.compile(m)
    t = time.perf_counter()
    with torch.no_grad():
        _, trace = layer(r, Y, return_trace=True)
    t_compiled = time.perf_counter() - t
    t = time.perf_counter()
    found = sa.inference.map_estimate(m, r, Y)
    t_pyro = time.perf_counter() - t
    gap = float((trace.states["state"][-1] - found.latents["state"]).abs().max())
    log(f"Hopfield fixed point vs Pyro MAP (B={B} M={M} N={N} d={d}, float64): compiled "
        f"{trace.steps} CCCP steps in {t_compiled * 1e3:.1f} ms, Pyro TraceEnum_ELBO + L-BFGS "
        f"{t_pyro * 1e3:.0f} ms ({t_pyro / t_compiled:.0f}×); max |Δ state| {gap:.1e}")
    return {"compiled_s": t_compiled, "pyro_s": t_pyro, "steps": trace.steps, "max_abs_diff": gap}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)  # CFG VARIANT …
    args = p.parse_args(argv)
    if args.child:
        return child(json.loads(args.child[0]), args.child[1:])
    cfg = dict(slot_B=16, slot_N=1024, slot_dim=64, slots=7, iters=3, hop_B=8, hop_M=128,
               hop_N=1024, hop_H=4, hop_d=64, steps=3, gt_B=4, gt_M=16, gt_N=64, gt_d=16,
               pcn_sizes=[64, 128, 10], pcn_blocks=[1, 8, 1], pcn_B=256, pcn_steps=20,
               warmup=2, repeats=10)
    if args.quick:
        cfg.update(slot_B=2, slot_N=32, slot_dim=8, slots=3, hop_B=2, hop_M=4, hop_N=16, hop_H=2,
                   hop_d=4, gt_B=1, gt_M=2, gt_N=5, gt_d=3, pcn_sizes=[6, 4, 3],
                   pcn_blocks=[2, 2, 1], pcn_B=4,
                   pcn_steps=3, warmup=1, repeats=2)
    lines = []

    def log(s):
        print(s, flush=True)
        lines.append(s)

    log(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cores, "
        f"float32, CPU")
    variants = ("slots-structattn", "slots-peer", "hopfield-structattn", "hopfield-hand")
    measured = peaks_in_subprocesses({v: v for v in variants}, cfg, fresh=False) \
        if args.quick else None
    results = {
        "config": cfg,
        "slots": section(f"slot attention (B={cfg['slot_B']}, N={cfg['slot_N']}, "
                         f"dim={cfg['slot_dim']}, S={cfg['slots']}, {cfg['iters']} iters)",
                         "slots-structattn", "slots-peer", "slot-attention 1.5.2", cfg, log, 1.0,
                         measured),
        "hopfield": section(f"Hopfield (B={cfg['hop_B']}, M={cfg['hop_M']}, N={cfg['hop_N']}, "
                            f"H={cfg['hop_H']}, d_k={cfg['hop_d']}, T={cfg['steps']})",
                            "hopfield-structattn", "hopfield-hand", "hand-written SDPA loop",
                            cfg, log, 1.05, measured),
        "predictive_coding": section_pcn(cfg, log),
        "ground_truth": section_ground_truth(cfg, log),
    }
    _results.save("iterative", results, args.json, quick=args.quick)
    return results


if __name__ == "__main__":
    main()
