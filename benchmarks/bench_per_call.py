"""What one call costs: compiled-once layers vs hand-written modules at small sizes, in one run.

A compiled module reads its declaration on a signature's first call, records a plan on the
second and replays only the plan's tensor work after that (``structattn/compiling/replay.py``). At small
sizes the fixed cost per call is what shows, so that is what this measures:

1. self-attention per call vs a hand-written module (``nn.Linear`` projections without bias +
   ``F.scaled_dot_product_attention``), forward and forward+backward, at B=1, N=16, d=64 with
   1 and 4 heads and at B=8, N=128, d=256 — validation on (targets ≤ 1.15× small, ≤ 1.02×
   large), off (≤ 1.05×), and the first call's reading for reference; at the small sizes the
   forward is timed three ways — under ``torch.no_grad()`` (``forward``), under
   ``torch.inference_mode()`` (``inference_mode``) and with autograd recording
   (``forward_grad``, no backward) — with validation on ≤ 1.05× under ``no_grad`` and
   ``inference_mode`` — and as a training loop that evaluates between steps calls it, a
   forward with gradients and one under ``no_grad`` in turn (``grad_then_no_grad``);
2. iterative models at B=1: Hopfield at T = 1, 3, 10 vs a hand-written loop of the same
   update (one SDPA per step); collapsed slot attention vs a hand-written EM loop (≤ 1.15×);
   slot attention (original recipe) vs the ``slot-attention`` package at its benchmark size
   and at B=1, N=64, D=32, 4 slots (≤ 1.0×);
3. expanding attention on the paper's toy task (T = 50, the final token, ``last=1``) vs one
   hand-written SDPA call for that token (≤ 1.0×);
4. start-up: ``import torch``, ``import structattn`` over it (≤ 0.5 s) and ``structattn
   --help`` over that (≤ 1 s), each the median of fresh processes.

Timing: the variants run interleaved (order reversed each round), each round times a block
of calls; medians over rounds, and the median of per-round ratios (``paired``), which is
less sensitive to the machine drifting. ``--clock cpu`` times the process's CPU time instead
of the wall clock (on the CPU only): on a machine other work shares, the time this process
waits for a core is then left out. Run:
``python benchmarks/bench_per_call.py [--quick] [--clock wall|cpu] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import _results  # noqa: E402  (this script's own folder)
from _device import sync  # noqa: E402  (the script's own folder)

import structattn as sa  # noqa: E402

heads_of, merge = sa.split_heads, sa.merge_heads  # (…, n, H·d) ↔ (…, H, n, d)


# -- hand-written baselines (the same weight tensors as the declarations) --------------------

class HandAttention(nn.Module):
    """What one writes by hand: four bias-free ``nn.Linear`` and one SDPA call."""

    def __init__(self, m):
        super().__init__()
        d, H = m.W_q.shape[1], m.heads
        self.heads, self.scale = H, 1 / math.sqrt(m.d_k)
        self.q, self.k, self.v = (nn.Linear(d, w.shape[0], bias=False) for w in (m.W_q, m.W_k, m.W_v))
        self.o = nn.Linear(m.W_o.shape[1], m.W_o.shape[0], bias=False)
        for lin, w in ((self.q, m.W_q), (self.k, m.W_k), (self.v, m.W_v), (self.o, m.W_o)):
            lin.weight = w  # shared: the same tensors, the same gradients

    def forward(self, x):
        H = self.heads
        q, k, v = heads_of(self.q(x), H), heads_of(self.k(x), H), heads_of(self.v(x), H)
        return self.o(merge(F.scaled_dot_product_attention(q, k, v, scale=self.scale)))


def hopfield_by_hand(m, r, Y):
    """ξ ← Kᵀ softmax(βKξ) T times, then W_O concat(Vᵀ softmax(βKξ_T)): one SDPA per step."""
    H, T = m.heads, m.update_steps
    K, V = heads_of(F.linear(Y, m.W_k), H), heads_of(F.linear(Y, m.W_v), H)
    xi = heads_of(F.linear(r, m.W_q), H)
    for _ in range(T):
        xi = F.scaled_dot_product_attention(xi, K, K, scale=m.beta)
    return F.linear(merge(F.scaled_dot_product_attention(xi, K, V, scale=m.beta)), m.W_o)


def collapsed_slots_by_hand(m, x, z):
    """EM on a Gaussian mixture over the keys, slots as means: p_js ∝ exp(−‖z_s − k_j‖²/2τ),
    z_s ← (μ/σ² + Σ_j p_js k_j/τ) / (1/σ² + Σ_j p_js/τ), ``iters`` times."""
    k = m.to_k(m.norm_input(x))  # (B, N, D)
    tau, mu, prec = m.temperature, m.slots_mu, m.slots_logsigma.exp() ** -2
    for _ in range(m.iters):
        logits = -(torch.cdist(k, z) ** 2) / (2 * tau)  # (B, N, S)
        p = logits.softmax(-1)
        z = (mu * prec + p.transpose(-1, -2) @ k / tau) / (prec + p.sum(-2)[..., None] / tau)
    return z


# -- timing --------------------------------------------------------------------------------

#: how a call is timed: the forward under ``torch.no_grad()``, under
#: ``torch.inference_mode()``, with autograd recording, forward + backward, and a forward with
#: gradients then one under ``torch.no_grad()`` (the time of the two)
MODES = {"forward": torch.no_grad, "inference_mode": torch.inference_mode,
         "forward_grad": torch.enable_grad, "fwd+bwd": None, "grad_then_no_grad": None}


#: what a block of calls is timed by: the wall clock, or the process's CPU time
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def _once(fn, params, mode):
    if mode == "grad_then_no_grad":
        fn()
        with torch.no_grad():
            fn()
    elif mode == "fwd+bwd":
        for p in params:
            p.grad = None
        out = fn()
        (out[0] if isinstance(out, tuple) else out).sum().backward()
    else:
        with MODES[mode]():
            fn()


def time_calls(fns: dict, *, mode: str, rounds: int, block: int, device,
               clock=time.perf_counter) -> dict:
    """Per call: median seconds per variant and the median per-round ratio to ``"baseline"``
    (on a GPU each block is timed from a synchronised start to a synchronised end);
    ``clock``: the wall clock, or ``time.process_time`` for the CPU time."""
    for fn, params in fns.values():
        for _ in range(3):  # read, record, replay: a plan is recorded on the second call
            _once(fn, params, mode)
    times = {k: [] for k in fns}
    names = list(fns)
    gc.disable()
    try:
        for r in range(rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                fn, params = fns[name]
                sync(device)
                t = clock()
                for _ in range(block):
                    _once(fn, params, mode)
                sync(device)
                times[name].append((clock() - t) / block)
    finally:
        gc.enable()
    base = times["baseline"]
    return {k: {"median_s": statistics.median(v),
                "paired": statistics.median(a / b for a, b in zip(v, base, strict=True))}
            for k, v in times.items()}


def _report(log, title, res, targets):
    base = res["baseline"]["median_s"]
    log(f"{title}: baseline {base * 1e6:.1f} µs")
    for name, r in res.items():
        if name == "baseline":
            continue
        tgt = targets.get(name)
        verdict = "" if tgt is None else f" (target ≤ {tgt}: {'OK' if r['paired'] <= tgt else 'MISS'})"
        log(f"    {name:28s} {r['median_s'] * 1e6:9.1f} µs  {r['median_s'] / base:6.3f}×  "
            f"paired {r['paired']:6.3f}×{verdict}")


def time_both(log, title: str, fns: dict, cfg, targets: dict, block: int, out: dict,
              key: str, modes=("forward", "fwd+bwd")) -> None:
    """``fns`` timed in each of ``modes`` (``MODES``; by default the forward under no_grad
    and forward+backward), reported; results in ``out`` under ``{key}_{mode}``.
    ``targets``: variant → target, or (variant, mode) → target for one mode."""
    for mode in modes:
        res = time_calls(fns, mode=mode, rounds=cfg["rounds"], block=block,
                         device=cfg["device"], clock=CLOCKS[cfg["clock"]])
        _report(log, title.format(what=mode), res,
                {**{k: v for k, v in targets.items() if isinstance(k, str)},
                 **{k[0]: v for k, v in targets.items() if isinstance(k, tuple) and k[1] == mode}})
        out[f"{key}_{mode}"] = res


def _layer_variants(layer, args, *, params):
    """The compiled layer replayed (checks on / off) and its first-call reading."""
    def off():
        with sa.validation(False):
            return layer(*args)
    return {"structattn": ((lambda: layer(*args)), params),
            "structattn, validation off": (off, params),
            "first call (reading)": ((lambda: layer.interpret(*args)), params)}


def section_attention(cfg, log):
    out = {}
    for B, N, d, H in cfg["attention_sizes"]:
        torch.manual_seed(0)
        m = sa.models.self_attention(d, heads=H).to(cfg["device"])
        layer, hand = sa.compile(m), HandAttention(m)
        x = torch.randn(B, N, d, device=cfg["device"], requires_grad=True)
        torch.testing.assert_close(layer(x), hand(x), rtol=1e-5, atol=1e-5)
        params = [x, *m.parameters()]
        small = B * N * d <= 4096
        targets = {"structattn": 1.15 if small else 1.02, "structattn, validation off": 1.05,
                   ("structattn", "forward"): 1.05 if small else 1.02,
                   ("structattn", "inference_mode"): 1.05 if small else 1.02,
                   ("structattn", "grad_then_no_grad"): 1.05}
        fns = {"baseline": ((lambda hand=hand, x=x: hand(x)), params),
               **_layer_variants(layer, (x,), params=params)}
        time_both(log, f"self-attention B={B} N={N} d={d} H={H}, {{what}}, vs hand-written "
                       f"nn.Linear + SDPA", fns, cfg, targets,
                  cfg["block"] if small else max(1, cfg["block"] // 20), out, f"B{B}_N{N}_d{d}_H{H}",
                  modes=tuple(MODES) if small else ("forward", "fwd+bwd"))
    return out


def section_iterative(cfg, log):
    out = {}
    torch.manual_seed(0)
    M, N, d, dev = cfg["hop_M"], cfg["hop_N"], cfg["hop_d"], cfg["device"]
    r = torch.randn(1, M, d, device=dev, requires_grad=True)
    Y = torch.randn(1, N, d, device=dev, requires_grad=True)
    for T in (1, 3, 10):
        m = sa.models.hopfield(d, d, iteration=sa.IterationOptions(steps=T)).to(dev)
        layer = sa.compile(m)
        torch.testing.assert_close(layer(r, Y), hopfield_by_hand(m, r, Y), rtol=1e-4, atol=1e-5)
        params = [r, Y, *m.parameters()]
        fns = {"baseline": ((lambda m=m: hopfield_by_hand(m, r, Y)), params),
               **_layer_variants(layer, (r, Y), params=params)}
        time_both(log, f"Hopfield T={T}, B=1 M={M} N={N} d={d}, {{what}}, vs hand-written SDPA "
                       f"loop", fns, cfg, {"structattn": 1.15}, cfg["block"], out, f"hopfield_T{T}")

    S, D, n = cfg["slots"], cfg["slot_dim"], cfg["slot_N"]
    torch.manual_seed(0)
    m = sa.models.slot_attention(S, D, recipe="collapsed", iters=3).to(dev)
    x = torch.randn(1, n, D, device=dev, requires_grad=True)
    z0 = torch.randn(1, S, D, device=dev)
    layer = sa.compile(m)
    torch.testing.assert_close(layer(x, z0), collapsed_slots_by_hand(m, x, z0), rtol=1e-4,
                               atol=1e-5)
    params = [x, *m.parameters()]
    fns = {"baseline": ((lambda: collapsed_slots_by_hand(m, x, z0)), params),
           **_layer_variants(layer, (x, z0), params=params)}
    time_both(log, f"collapsed slot attention, 3 iters, B=1 N={n} D={D} S={S}, {{what}}, vs "
                   f"hand-written EM loop", fns, cfg, {"structattn": 1.15}, cfg["block"], out,
              "collapsed_slots")

    from slot_attention import SlotAttention as Peer

    for B, n, D, S in cfg["peer_sizes"]:
        torch.manual_seed(0)
        peer = Peer(S, D, iters=3).to(dev)
        m = sa.models.slot_attention(S, D, iters=3).to(dev)
        m.load_state_dict(peer.state_dict())
        layer = sa.compile(m)
        x = torch.randn(B, n, D, device=dev, requires_grad=True)
        torch.manual_seed(1)
        a = layer(x)
        torch.manual_seed(1)
        torch.testing.assert_close(a, peer(x), rtol=1e-4, atol=1e-5)
        params = [x, *m.parameters()]
        fns = {"baseline": ((lambda peer=peer, x=x: peer(x)), [x, *peer.parameters()]),
               **_layer_variants(layer, (x,), params=params)}
        small = B * n * D <= 4096
        time_both(log, f"slot attention (original), 3 iters, B={B} N={n} D={D} S={S}, {{what}}, "
                       f"vs slot-attention 1.5.2", fns, cfg, {"structattn": 1.0},
                  cfg["block"] if small else 1, out, f"slots_peer_B{B}_N{n}")
    return out


def section_expanding(cfg, log):
    torch.manual_seed(0)
    T, d = cfg["exp_T"], cfg["exp_d"]
    m = sa.models.expanding_attention(d).to(cfg["device"])
    layer = sa.compile(m)
    x = torch.randn(1, T, d, device=cfg["device"])
    H = m.heads

    def sdpa_final_token():  # the same projections, the final token reading the whole past
        q = heads_of(F.linear(x[:, -1:], m.W_q), H)
        k, v = heads_of(F.linear(x, m.W_k), H), heads_of(F.linear(x, m.W_v), H)
        y = merge(F.scaled_dot_product_attention(q, k, v, scale=1 / math.sqrt(m.d_k)))
        return y if m.W_o is None else F.linear(y, m.W_o)

    fns = {"baseline": (sdpa_final_token, [x]), "structattn": ((lambda: layer(x, last=1)), [x]),
           "first call (reading)": ((lambda: layer.interpret(x, last=1)), [x])}
    res = time_calls(fns, mode="forward", rounds=cfg["rounds"], block=cfg["block"],
                     device=cfg["device"], clock=CLOCKS[cfg["clock"]])
    _report(log, f"expanding attention, toy task T={T} d={d}, final token (last=1), forward, "
                 f"vs one SDPA call for it", res, {"structattn": 1.0})
    (plan,) = layer.plans.values()
    log(f"    (plan: {'replayed' if plan.graph is not None else 'read every call: ' + plan.reason})")
    return res


def _median_run(code: str, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        subprocess.run(code, shell=True, check=True, capture_output=True)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


_IMPORTS = ("import time; t0 = time.perf_counter(); import torch; t1 = time.perf_counter(); "
            "import structattn; t2 = time.perf_counter(); print(t1 - t0, t2 - t1)")


def section_startup(cfg, log):
    """Import times measured inside fresh processes (the interpreter's own start-up, which
    varies by tens of milliseconds, is not in them); the CLI's ``--help`` from outside."""
    py, n = sys.executable, cfg["startup_repeats"]
    cli = os.path.join(os.path.dirname(py), "structattn")
    runs = [subprocess.run([py, "-c", _IMPORTS], check=True, capture_output=True, text=True)
            .stdout.split() for _ in range(n)]
    t_torch = statistics.median(float(r[0]) for r in runs)
    t_sa = statistics.median(float(r[1]) for r in runs)
    t_python = _median_run(f"{py} -c pass", n)
    t_cli = _median_run(f"{cli} --help", n) if os.path.exists(cli) else float("nan")
    over = t_cli - (t_python + t_torch + t_sa)
    log(f"start-up (median of {n} fresh processes): import torch {t_torch:.2f} s; import "
        f"structattn +{t_sa:.2f} s over torch (target ≤ 0.5: {'OK' if t_sa <= 0.5 else 'MISS'}); "
        f"structattn --help {t_cli:.2f} s in all, {over:+.2f} s over python + both imports "
        f"(target ≤ 1: {'OK' if over <= 1 else 'MISS'})")
    return {"python_s": t_python, "torch_s": t_torch, "structattn_over_torch_s": t_sa,
            "cli_help_s": t_cli}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="few rounds (smoke test)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--skip", nargs="*", default=[],
                   choices=["attention", "iterative", "expanding", "startup"])
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda; start-up is measured "
                                                   "on the CPU only")
    p.add_argument("--clock", choices=list(CLOCKS), default="wall",
                   help="wall (default) or cpu: the process's CPU time, on the CPU only")
    args = p.parse_args(argv)
    if args.clock == "cpu" and args.device != "cpu":
        p.error(f"--clock cpu times the CPU only; got --device {args.device}")
    cfg = dict(attention_sizes=[(1, 16, 64, 1), (1, 16, 64, 4), (8, 128, 256, 4)],
               hop_M=4, hop_N=16, hop_d=32, slots=4, slot_dim=32, slot_N=64,
               peer_sizes=[(1, 64, 32, 4), (16, 1024, 64, 7)], exp_T=50, exp_d=16,
               rounds=15, block=100, startup_repeats=5, device=torch.device(args.device),
               clock=args.clock)
    if args.quick:
        # a small size (every mode) and one above 4,096 elements (the large sizes' path)
        cfg.update(attention_sizes=[(1, 16, 64, 1), (2, 40, 64, 4)], peer_sizes=[(1, 64, 32, 4)],
                   rounds=2, block=2, startup_repeats=1)
    lines = []

    def log(s):
        print(s, flush=True)
        lines.append(s)

    dev = cfg["device"]
    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    log(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cores, "
        f"float32, {where}")
    if dev.type != "cpu" and "startup" not in args.skip:
        args.skip.append("startup")
    results = {"config": cfg}
    sections = {"attention": section_attention, "iterative": section_iterative,
                "expanding": section_expanding, "startup": section_startup}
    for name, fn in sections.items():
        if name not in args.skip:
            results[name] = fn(cfg, log)
    _results.save("per_call", results, args.json, quick=args.quick, device=args.device)
    return results


if __name__ == "__main__":
    main()
