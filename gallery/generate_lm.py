"""Generating with the byte-level language model through a decoding cache, and three caches
compared on one long text: the full cache, a certified one and a sink-plus-window one.

The models are ``gallery/train_lm.py``'s ``ByteLM`` (pre-LayerNorm blocks, each attention a
compiled structattn layer), read from ``--lm DIR`` (``DIR/<variant>_T<context>/checkpoint.pt``
and its ``result.json``, as ``train_lm.py --out DIR`` writes them) or trained there first for
``--minutes`` (``--variants``: ``fox`` and ``alibi`` by default). Each layer has its own cache;
a step embeds one byte, reads it through every layer with ``layer(z, cache=…)`` and returns
the next byte's logits.

- **Generation**: a prompt is read in one call (the prefill), then one byte per step, greedy
  or sampled at ``--temperature``, through growing caches (``layer.new_cache()``).
- **Three caches on the validation text**, fed byte by byte to ``--length`` bytes, in
  lockstep (each position's step by each cache in turn, so that their timings share the
  machine's load):

  - *full*: ``layer.new_cache()``, every byte kept; it reads O(t) keys at step t, so it stops
    at ``--full-to`` (16,384 by default);
  - *certified*: ``layer.new_cache(tol=1e-4, input_norm=…, block=64)``: the oldest blocks are
    evicted once their posterior mass is proved ≤ tol at every later query. The ceiling on
    the layer's input is proved too: the input is LayerNorm's, ‖γ ⊙ n + β‖ ≤ √d·max|γ| + ‖β‖
    for the normalised ‖n‖ ≤ √d;
  - *sink + window* (StreamingLLM's recipe, Xiao et al.): the first ``--sinks`` bytes and
    the last ``--window`` ones, the rest dropped — uncertified: nothing bounds the posterior
    mass it drops. The kept slots are contiguous, so ALiBi's distances are counted within the
    cache, as StreamingLLM counts positions (FoX's gate sums are the bytes' own).

  Per position: the tokens each cache holds (its largest layer's) and the milliseconds of the
  step; per cache: bits per byte over the bytes the full cache read and over all of them.
- **The passkey** (``passkey_probe.py``'s trial: ``pass key: 12345.``, ``d`` bytes of real
  text, the cue) read byte by byte through the certified cache: the digits read back
  (teacher-forced, as ``passkey_probe.py``) against the full forward's, the tokens evicted,
  and the largest bound on the evicted mass the trace reports.

Writes ``generate_lm.json``, ``generate_lm.md`` and ``generate_lm.png`` to ``--out``. Run::

    python gallery/generate_lm.py --quick             # tiny models, 2,048 bytes (the tests')
    python gallery/generate_lm.py --lm DIR --length 65536
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import pathlib
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import structattn as sa

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import passkey_probe  # noqa: E402
import train_lm  # noqa: E402

CACHES = ("full", "certified", "sink+window")


# -- the model and its caches ----------------------------------------------------------


def model_for(variant: str, args) -> train_lm.ByteLM:
    """The variant's ``ByteLM`` from ``args.lm``, trained there first (``--minutes``) where it
    holds no checkpoint; its sizes are the ones it was trained at (``result.json``)."""
    folder = pathlib.Path(args.lm) / f"{variant}_T{args.context}"
    ckpt = folder / "checkpoint.pt"
    if not ckpt.exists():
        train_lm.main(["--attention", variant, "--context", str(args.context),
                       "--d-model", str(args.d_model), "--layers", str(args.layers),
                       "--heads", str(args.heads), "--steps", str(args.steps),
                       "--eval-every", str(args.steps), "--final-eval", "windows",
                       "--out", str(folder.parent)]
                      + (["--minutes", str(args.minutes)] if args.minutes else [])
                      + train_lm.lm_corpus.corpus_arguments(args))
    sizes = dict(d_model=args.d_model, layers=args.layers, heads=args.heads, window=64)
    if (folder / "result.json").exists():
        trained = json.loads((folder / "result.json").read_text())["args"]
        sizes = {k: trained[k] for k in sizes}
    model = train_lm.ByteLM(sizes["d_model"], sizes["layers"], sizes["heads"], variant,
                            window=sizes["window"])
    model.load_state_dict(torch.load(ckpt, weights_only=True, map_location="cpu")["model"])
    return model.eval()


def input_ceiling(ln: torch.nn.LayerNorm) -> float:
    """A bound on ‖LN(x)‖ for every x: √d·max|γ| + ‖β‖ (the normalised vector has norm
    √(d·var/(var + eps)) ≤ √d), its float32 rounding charged with a factor 1 + 1e-4."""
    d = ln.normalized_shape[0]
    gamma = ln.weight.detach().double().abs().max() if ln.weight is not None else 1.0
    beta = ln.bias.detach().double().norm() if ln.bias is not None else 0.0
    return float((math.sqrt(d) * gamma + beta) * (1 + 1e-4))


def new_caches(model: train_lm.ByteLM, kind: str, args) -> list:
    """One cache per layer: ``kind`` one of ``CACHES``."""
    if kind == "certified":
        return [b.attn.new_cache(tol=args.tol, input_norm=input_ceiling(b.ln1), block=args.block)
                for b in model.blocks]
    return [b.attn.new_cache() for b in model.blocks]


def keep_sinks_and_window(cache, sinks: int, window: int) -> None:
    """StreamingLLM's cache, uncertified: keep the first ``sinks`` tokens and the last
    ``window``, dropping those between (called after each step: the next step reads them and
    its own token). The sinks' keys, values and prior state are copied
    over the oldest tokens to drop, then the cache's front is dropped (``drop_front``): the
    kept tokens sit in contiguous slots."""
    drop = len(cache) - sinks - window
    if drop <= 0:
        return
    for name in ("keys", "values"):
        t = getattr(cache, name)
        t[..., drop:drop + sinks, :] = t[..., :sinks, :].clone()
    if cache.state is not None:
        cache.state[..., drop:drop + sinks] = cache.state[..., :sinks].clone()
    cache.drop_front(drop)


@torch.no_grad()
def read(model: train_lm.ByteLM, caches: list, tokens: torch.Tensor) -> torch.Tensor:
    """The next-byte logits ``(1, k, 256)`` after ``tokens (1, k)``, read after everything the
    caches hold (one cache per layer, extended in place)."""
    h = model.embed(tokens)
    for block, cache in zip(model.blocks, caches, strict=True):
        h = h + block.attn(block.ln1(h), cache=cache)
        h = h + block.mlp(block.ln2(h))
    return model.ln(h) @ model.embed.weight.T


# -- generation ------------------------------------------------------------------------


@torch.no_grad()
def generate(model, prompt: bytes, n: int, temperature: float = 0.0, seed: int = 0) -> bytes:
    """``n`` bytes after ``prompt``: the prompt read in one call, then one byte per step through
    growing caches; greedy at temperature 0, else sampled from softmax(logits / temperature)."""
    gen = torch.Generator().manual_seed(seed)
    caches = new_caches(model, "full", None)
    logits = read(model, caches, torch.tensor([list(prompt)]))[0, -1]
    out = []
    for _ in range(n):
        if temperature > 0:
            byte = int(torch.multinomial(F.softmax(logits / temperature, -1), 1, generator=gen))
        else:
            byte = int(logits.argmax())
        out.append(byte)
        logits = read(model, caches, torch.tensor([[byte]]))[0, -1]
    return bytes(out)


def printable(text: bytes) -> str:
    return text.decode("utf-8", errors="replace").replace("\x00", "␀")


# -- three caches on one text -----------------------------------------------------------


@torch.no_grad()
def decode(model, text: torch.Tensor, args) -> dict:
    """The validation ``text (n + 1,)`` read byte by byte by the three caches in lockstep: per
    cache, the tokens held after each step (the largest layer's), each step's seconds, and
    the bits of each next byte."""
    n = len(text) - 1
    full_to = min(n, args.full_to)
    caches = {kind: new_caches(model, kind, args) for kind in CACHES}
    held = {kind: [] for kind in CACHES}
    seconds = {kind: [] for kind in CACHES}
    bits = {kind: [] for kind in CACHES}
    tokens = text.long()
    with sa.validation(False):
        for t in range(n):
            x = tokens[None, t:t + 1]
            for kind in CACHES:
                if kind == "full" and t >= full_to:
                    continue
                start = time.perf_counter()
                logits = read(model, caches[kind], x)[0, 0]
                if kind == "sink+window":
                    for cache in caches[kind]:
                        keep_sinks_and_window(cache, args.sinks, args.window)
                seconds[kind].append(time.perf_counter() - start)
                held[kind].append(max(len(c) for c in caches[kind]))
                bits[kind].append(float(-F.log_softmax(logits.double(), -1)[tokens[t + 1]])
                                  / math.log(2))
    traces = [c.trace for c in caches["certified"]]
    return {"bytes": n, "full_to": full_to, "held": held, "seconds": seconds, "bits": bits,
            "bound_max": max((s.bound for tr in traces for s in tr), default=0.0),
            "certified": all(s.certified for tr in traces for s in tr),
            "evicted": [c.evicted for c in caches["certified"]]}


def summary(run: dict, window: int) -> dict:
    """Per cache: bits per byte over the full cache's bytes and over all, the tokens held at
    the last position, and the median ms per step over the ``window`` steps before the full
    cache's last and before the last."""
    out = {}
    m = run["full_to"]
    for kind in CACHES:
        b, s = run["bits"][kind], run["seconds"][kind]
        out[kind] = {"bpb_to_full_to": statistics.fmean(b[:m]),
                     "bpb_all": statistics.fmean(b), "bytes": len(b),
                     "held_last": run["held"][kind][-1], "held_max": max(run["held"][kind]),
                     "ms_at_full_to": 1e3 * statistics.median(s[max(0, m - window):m]),
                     "ms_last": 1e3 * statistics.median(s[-window:])}
    return out


def series(run: dict) -> dict:
    """What the picture draws, per cache: the tokens held and the median ms per step over
    log-spaced runs of steps, at each run's last position."""
    out = {}
    for kind in CACHES:
        xs, ms = _smooth([1e3 * v for v in run["seconds"][kind]])
        out[kind] = {"position": xs, "held": [run["held"][kind][x - 1] for x in xs],
                     "ms_per_byte": ms}
    return out


# -- the passkey through the certified cache ---------------------------------------------


@torch.no_grad()
def passkey(model, text: torch.Tensor, distances, args) -> list[dict]:
    """Per distance: ``passkey_probe.trial``'s sequence read byte by byte through the certified
    cache; the share of the five digits read back (teacher-forced), the full forward's share
    (``passkey_probe.probe``), the tokens the cache evicted and the largest bound on the
    evicted mass (every layer's trace)."""
    gen = torch.Generator().manual_seed(args.seed)
    rows = []
    for d in distances:
        tokens, keys, answers = passkey_probe.trial(text, d, gen)
        caches = new_caches(model, "certified", args)
        with sa.validation(False):
            logits = torch.cat([read(model, caches, tokens[None, t:t + 1])[0]
                                for t in range(len(tokens) - 1)])  # (T − 1, 256)
        guess = logits[answers - 1].argmax(-1)
        reference, _ = passkey_probe.probe(model, tokens, keys, answers)
        traces = [c.trace for c in caches]
        rows.append({"distance": d, "accuracy": float((guess == tokens[answers]).float().mean()),
                     "full_forward_accuracy": reference,
                     "retrieved": bool((guess == tokens[answers]).all()),
                     "key_evicted": min(c.evicted for c in caches) > int(keys[-1]),
                     "evicted": [c.evicted for c in caches],
                     "held": [len(c) for c in caches],
                     "bound_max": max((s.bound for tr in traces for s in tr), default=0.0),
                     "certified": all(s.certified for tr in traces for s in tr)})
    return rows


# -- the picture ----------------------------------------------------------------------------


def _smooth(values, bins=48):
    """Medians over ``bins`` runs of steps spaced evenly on a log scale, at each run's last
    position (1-based)."""
    edges = sorted({int(round(len(values) ** (k / bins))) for k in range(bins + 1)} | {0})
    xs, ys = [], []
    for lo, hi in itertools.pairwise(edges):
        xs.append(hi)
        ys.append(statistics.median(values[lo:hi]))
    return xs, ys


def plot(results: dict, args, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = list(results)
    fig, axes = plt.subplots(len(variants), 2, figsize=(12, 3.8 * len(variants)), squeeze=False)
    colours = {"full": "tab:blue", "certified": "tab:green", "sink+window": "tab:orange"}
    style = {"full": dict(lw=3.5, alpha=0.45), "certified": dict(lw=1.4),
             "sink+window": dict(lw=1.4, ls="--")}  # the full cache's line under the others
    for row, variant in enumerate(variants):
        run, summ = results[variant]["decode"], results[variant]["summary"]
        left, right = axes[row]
        for kind in CACHES:
            s = summ[kind]
            label = {"full": f"full cache (to {run['full_to']:,}): "
                             f"{s['bpb_to_full_to']:.4f} bits/byte",
                     "certified": f"certified, tol {args.tol:g}: {s['bpb_to_full_to']:.4f} "
                                  f"({s['bpb_all']:.4f} to {s['bytes']:,})",
                     "sink+window": f"{args.sinks} sinks + window {args.window:,}, "
                                    f"uncertified: {s['bpb_to_full_to']:.4f} "
                                    f"({s['bpb_all']:.4f} to {s['bytes']:,})"}[kind]
            positions = range(1, len(run["held"][kind]) + 1)
            left.plot(positions, run["held"][kind], color=colours[kind], label=label,
                      **style[kind])
            xs, ys = _smooth([1e3 * v for v in run["seconds"][kind]])
            right.plot(xs, ys, color=colours[kind], label=kind, **style[kind])
        left.set_xscale("log", base=2)
        left.set_yscale("log", base=2)
        left.set_ylabel("tokens held (largest layer)")
        left.set_title(f"{variant}: cache size; bits per byte fed byte by byte "
                       f"(to {run['full_to']:,}; to the end)", fontsize=9)
        left.legend(fontsize=7, loc="upper left")
        right.set_xscale("log", base=2)
        right.set_yscale("log")
        right.set_ylabel("ms per byte (medians over log-spaced runs)")
        right.set_title(f"{variant}: time per step (layers: {args.layers_read[variant]}, "
                        f"threads: {args.threads})", fontsize=9)
        right.legend(fontsize=7, loc="upper left")
        for ax in (left, right):
            ax.set_xlabel("position (bytes)")
            ax.axvline(run["full_to"], color="grey", lw=0.6, ls=":")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- the script --------------------------------------------------------------------------


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", nargs="+", default=["fox", "alibi"],
                   choices=["fox", "alibi", "gaussian"],
                   help="variants whose prior certifies eviction")
    p.add_argument("--lm", default=str(HERE / "output" / "generate_lm" / "lm"),
                   help="train_lm.py's --out: DIR/<variant>_T<context>/checkpoint.pt")
    p.add_argument("--context", type=int, default=256, help="the training length")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--steps", type=int, default=100000)
    p.add_argument("--minutes", type=float, default=2.0,
                   help="training budget where --lm holds no checkpoint")
    p.add_argument("--max-files", type=int, default=None, help="the first N files only")
    train_lm.lm_corpus.add_corpus_argument(p)
    p.add_argument("--prompt", default="def main(argv=None):\n    ")
    p.add_argument("--generate", type=int, default=200, help="bytes generated")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--length", type=int, default=4096, help="validation bytes fed")
    p.add_argument("--full-to", type=int, default=16384, help="bytes the full cache reads")
    p.add_argument("--tol", type=float, default=1e-4)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--window", type=int, default=1020)
    p.add_argument("--distances", type=int, nargs="+", default=[256, 2048, 8192])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(HERE / "output" / "generate_lm"))
    p.add_argument("--quick", action="store_true", help="tiny models and text (the tests')")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.minutes, args.d_model, args.layers, args.heads = 3, None, 16, 1, 2
        args.context, args.generate = 32, 12
        args.max_files = None if args.corpus else 40
        args.length, args.window, args.block, args.distances = 1024, 60, 16, [64]
    torch.set_num_threads(args.threads)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.quick and args.lm == p.get_default("lm"):
        args.lm = str(out / "lm")
    _, val, _ = train_lm.lm_corpus.corpus_of(args, "generate_lm")
    if len(val) < args.length + 1:
        p.error(f"--length {args.length}: the validation text holds {len(val):,} bytes")
    text = val[:args.length + 1]
    results, args.layers_read = {}, {}
    load = os.getloadavg()[0]  # the machine's 1-minute load average, before and after
    for variant in args.variants:
        model = model_for(variant, args)
        args.layers_read[variant] = len(model.blocks)
        prompt = args.prompt.encode()
        greedy = generate(model, prompt, args.generate)
        sampled = generate(model, prompt, args.generate, args.temperature, args.seed)
        print(f"[{variant}] greedy:\n{printable(prompt + greedy)}\n[{variant}] sampled at "
              f"temperature {args.temperature}:\n{printable(prompt + sampled)}", flush=True)
        run = decode(model, text, args)
        summ = summary(run, window=max(1, min(256, args.length // 8)))
        for kind, s in summ.items():
            print(f"[{variant}] {kind:>11}: {s['bpb_to_full_to']:.5f} bits/byte to "
                  f"{run['full_to']:,}, {s['bpb_all']:.5f} to {s['bytes']:,}; holds "
                  f"{s['held_last']:,} at the end (most {s['held_max']:,}); "
                  f"{s['ms_at_full_to']:.3f} ms/byte at {run['full_to']:,}, "
                  f"{s['ms_last']:.3f} at the end", flush=True)
        print(f"[{variant}] certified: bound ≤ {run['bound_max']:.3g}, certified "
              f"{run['certified']}, evicted {run['evicted']} per layer", flush=True)
        keys = passkey(model, val, args.distances, args)
        for r in keys:
            print(f"[{variant}] passkey at {r['distance']:,}: digits {r['accuracy']:.2f} "
                  f"(full forward {r['full_forward_accuracy']:.2f}), key evicted "
                  f"{r['key_evicted']}, bound ≤ {r['bound_max']:.3g}, certified "
                  f"{r['certified']}", flush=True)
        results[variant] = {"greedy": printable(greedy), "sampled": printable(sampled),
                            "decode": run, "summary": summ, "passkey": keys}
    written = [out / "generate_lm.json", out / "generate_lm.md", out / "generate_lm.png"]
    settings = {k: shown(v) if k in ("lm", "out", "corpus") else v
                for k, v in vars(args).items()}
    written[0].write_text(json.dumps({"args": settings, "results": {
        v: {k: r[k] for k in ("greedy", "sampled", "summary", "passkey")}
        | {"bound_max": r["decode"]["bound_max"], "certified": r["decode"]["certified"],
           "evicted": r["decode"]["evicted"], "full_to": r["decode"]["full_to"],
           "series": series(r["decode"])} for v, r in results.items()},
        "load_average": [load, os.getloadavg()[0]]}, indent=1))
    written[1].write_text(table(results, args))
    plot(results, args, written[2])
    print("wrote", *map(str, written))
    return [str(w) for w in written]


def shown(path):
    """A path as the record keeps it: relative to the repository where it lies inside it,
    else its last two parts (a local folder says nothing on another machine)."""
    if path is None:
        return None
    path = pathlib.Path(path).resolve()
    try:
        return str(path.relative_to(HERE.parent))
    except ValueError:
        return str(pathlib.Path("…", *path.parts[-2:]))


def table(results: dict, args) -> str:
    lines = ["| variant | cache | bits/byte to the full cache's end | bits/byte, all | "
             "tokens held at the end | ms/byte at the full cache's end | ms/byte at the end |",
             "|---|---|---|---|---|---|---|"]
    for variant, r in results.items():
        for kind, s in r["summary"].items():
            lines.append(f"| {variant} | {kind} | {s['bpb_to_full_to']:.4f} | "
                         f"{s['bpb_all']:.4f} ({s['bytes']:,}) | {s['held_last']:,} | "
                         f"{s['ms_at_full_to']:.3f} | {s['ms_last']:.3f} |")
    lines += ["", "| variant | passkey distance | digits (certified cache) | digits (full "
              "forward) | key evicted | bound on the evicted mass | certified |",
              "|---|---|---|---|---|---|---|"]
    for variant, r in results.items():
        for k in r["passkey"]:
            lines.append(f"| {variant} | {k['distance']:,} | {k['accuracy']:.2f} | "
                         f"{k['full_forward_accuracy']:.2f} | {k['key_evicted']} | "
                         f"{k['bound_max']:.2e} | {k['certified']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
