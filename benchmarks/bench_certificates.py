"""Certified truncation against reading everything: the certified layer never slower, per input.

A distance prior with ``tol`` reads only what its certificate proves it may skip (a window
back from each token, ``certificate="window"``, or the key blocks each block of tokens needs,
``certificate="blocks"``); where the input lets it skip little, the certificate must find that
out cheaply and read exactly (``structattn/certificates/``). Compared, in one run, per prior,
certificate, input and N: the compiled layer with ``tol=1e-4`` against the same layer (same
weights) without ``tol``, its exact reading — forward under ``torch.no_grad()`` and
forward + backward; paired medians of per-round ratios (the two interleaved), and the fraction
of (token, past token) pairs skipped.

Priors (d_model 256, 4 heads of 64, float32, B = 1): FoX (``forgetting_attention``), causal
ALiBi (the paper's slopes 2^(−8h/H)) and BAM's generalised Gaussian (window certificate only:
its log prior does not separate). Inputs: ``decaying`` — FoX's default gate (σ(3) ≈ 0.95 at
initialisation), ALiBi and the Gaussian (width 16) on random tokens: the certificates skip
most pairs; ``flat`` — where they skip nothing: FoX with slow gates (gate bias 12: σ ≈ 1 −
6e-6), ALiBi on tokens scaled ×6 (scores spread over hundreds: no window below the whole past
is certified), the Gaussian with width 8,192. Target: certified ≤ 1.05× exact in both modes
everywhere. Run: ``python benchmarks/bench_certificates.py [--quick] [--sizes N …]
[--rounds R] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import _results  # noqa: E402  (this script's own folder)

import structattn as sa  # noqa: E402

TOL = 1e-4
D_MODEL, HEADS = 256, 4


def _model(prior: str, inputs: str, **opts):
    """The layer of ``prior`` for the ``inputs`` kind, with ``opts`` (tol, certificate)."""
    torch.manual_seed(0)
    if prior == "FoX":
        return sa.models.forgetting_attention(D_MODEL, heads=HEADS,
                                              gate_bias=3.0 if inputs == "decaying" else 12.0,
                                              **opts)
    if prior == "ALiBi":
        return sa.models.alibi_attention(D_MODEL, heads=HEADS, **opts)
    opts.pop("certificate", None)
    return sa.models.generalised_gaussian_attention(
        D_MODEL, heads=HEADS, width=16.0 if inputs == "decaying" else 8192.0, **opts)


def _tokens(prior: str, inputs: str, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, n, D_MODEL, generator=g)
    return x * 6.0 if (prior, inputs) == ("ALiBi", "flat") else x


def _step(layer, x, mode: str):
    if mode == "forward":
        with torch.no_grad():
            return layer(x)
    for p in layer.parameters():
        p.grad = None
    layer(x).sum().backward()
    return None


def compare(prior: str, certificate: str, inputs: str, n: int, rounds: int, log) -> dict:
    """The certified layer against the exact one on the same weights and tokens."""
    exact_model = _model(prior, inputs)
    cert_model = _model(prior, inputs, tol=TOL, certificate=certificate)
    cert_model.load_state_dict(exact_model.state_dict())
    exact, cert = sa.compile(exact_model), sa.compile(cert_model)
    x = _tokens(prior, inputs, n)
    row = {}
    for mode in ("forward", "fwd+bwd"):
        for layer in (exact, cert):
            for _ in range(2):  # read, record (where it records)
                _step(layer, x, mode)
        times = {"exact": [], "certified": []}
        gc.disable()
        try:
            for r in range(rounds):
                order = (("exact", exact), ("certified", cert))
                for name, layer in (order if r % 2 == 0 else order[::-1]):
                    t = time.perf_counter()
                    _step(layer, x, mode)
                    times[name].append(time.perf_counter() - t)
        finally:
            gc.enable()
        row[mode] = {"exact_s": statistics.median(times["exact"]),
                     "certified_s": statistics.median(times["certified"]),
                     "paired": statistics.median(c / e for c, e in zip(
                         times["certified"], times["exact"], strict=True))}
    with torch.no_grad():
        trace = cert.interpret(x, return_trace=True)[1] if _traces(cert, x) else None
    row["skipped"] = _skipped(trace)
    skipped = "—" if row["skipped"] is None else f"{row['skipped']:.3f}"
    log(f"{prior:6s} {certificate:7s} {inputs:9s} N={n:6d}  skipped {skipped:>6s}  "
        f"forward {row['forward']['exact_s']:7.3f} s exact, {row['forward']['certified_s']:7.3f} s "
        f"certified ({row['forward']['paired']:5.2f}×)  fwd+bwd {row['fwd+bwd']['exact_s']:7.3f} "
        f"s, {row['fwd+bwd']['certified_s']:7.3f} s ({row['fwd+bwd']['paired']:5.2f}×)")
    return row


def _traces(layer, x) -> bool:
    try:
        layer.interpret(x[:, :8], return_trace=True)
        return True
    except (ValueError, TypeError):
        return False


def _skipped(trace):
    """The fraction of pairs the certificate skipped, from the reading's trace."""
    if trace is None:
        return None
    for value in _walk(trace):
        skipped = getattr(value, "skipped", None)
        if isinstance(skipped, float):
            return skipped
    return None


def _walk(x):
    if isinstance(x, dict):
        for v in x.values():
            yield from _walk(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _walk(v)
    else:
        yield x
        if hasattr(x, "__dict__") and not isinstance(x, torch.Tensor):
            yield from _walk(vars(x))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="N = 256, one round (smoke test)")
    p.add_argument("--sizes", type=int, nargs="*", default=[2048, 8192, 16384])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--only", nargs="*", default=None, help="priors to run (FoX ALiBi Gaussian)")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    sizes, rounds = ([256], 1) if args.quick else (args.sizes, args.rounds)
    log = print
    log(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, CPU, "
        f"tol={TOL}")
    rows = []
    for prior, certificates in (("FoX", ("window", "blocks")), ("ALiBi", ("window", "blocks")),
                                ("Gaussian", ("window",))):
        if args.only and prior not in args.only:
            continue
        for certificate in certificates:
            for inputs in ("decaying", "flat"):
                for n in sizes:
                    rows.append({"prior": prior, "certificate": certificate, "inputs": inputs,
                                 "n": n, **compare(prior, certificate, inputs, n, rounds, log)})
    worst = max(max(r["forward"]["paired"], r["fwd+bwd"]["paired"]) for r in rows)
    log(f"worst certified / exact: {worst:.3f}× (target ≤ 1.05×)")
    _results.save("certificates", {"tol": TOL, "rounds": rounds, "rows": rows}, args.json,
                  quick=args.quick)
    return rows


if __name__ == "__main__":
    main()
