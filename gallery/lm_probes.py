"""What a trained byte-level language model reads: certified and credible windows at each
length, and a passkey planted in real text.

For one run of ``gallery/train_lm.py`` (its ``checkpoint.pt``), on the validation bytes:

- **certified windows** (``alibi``, ``fox``, ``fox+rope``, ``gaussian``): the trained
  parameters read with ``tol=ε`` (``--tol``, default 1e-4). At each length L (``--lengths``)
  and on ``--windows`` windows of L validation bytes, each layer's heads' certified widths
  W (``trace.truncation``: every token's posterior mass beyond W is proved ≤ ε), their median
  and largest over the windows, and the share of (token, past token) pairs the window skips;
- **credible windows** (``expanding_mf``, ``expanding_exact``): the upper end of each token's
  90% credible context length (``sa.windows.credible_context``), its median and 90th
  percentile over the tokens, per layer;
- **passkey** (every variant): ``passkey_probe``'s trial at ``--distances``: the share of the
  five digits predicted (teacher-forced) and the last layer's posterior mass on the planted
  digits, against a uniform causal posterior's.

Writes ``probes.json`` beside the checkpoint (or to ``--json``). Run:
``python gallery/lm_probes.py gallery/output/lm_table/seed0/fox_T512``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import passkey_probe  # noqa: E402
import train_lm  # noqa: E402

import structattn as sa  # noqa: E402
from structattn.kinds.certificate_costs import set_aside  # noqa: E402

CREDIBLE = ["expanding_mf", "expanding_exact"]


def load(run: pathlib.Path, tol: float | None = None):
    """``(ByteLM, result)``: the run's trained model (read with ``tol`` if given) and its
    ``result.json`` (the sizes it was trained with)."""
    result = json.loads((run / "result.json").read_text())
    a = result["args"]
    model = train_lm.ByteLM(a["d_model"], a["layers"], a["heads"], result["variant"],
                            a["window"], tol=tol)
    state = torch.load(run / "checkpoint.pt", weights_only=True, map_location="cpu")
    model.load_state_dict(state["model"])
    return model.eval(), result


def spaced_windows(data: torch.Tensor, length: int, count: int) -> torch.Tensor:
    """``count`` windows of ``length`` bytes spread evenly over ``data``: ``(count, length)``."""
    if len(data) <= length:
        raise ValueError(f"lm_probes: a window of {length} bytes needs more than {len(data)} "
                         f"validation bytes")
    starts = torch.linspace(0, len(data) - length - 1, count).long()
    return data[starts[:, None] + torch.arange(length)].long()


@torch.no_grad()
def layer_inputs(model: train_lm.ByteLM, tokens: torch.Tensor, **call):
    """Yields ``(layer, block, input to its attention, what the attention returned besides
    its output)`` along one forward pass; ``call``: the attention's options
    (``return_trace=True``, ``return_posterior=True``), each layer's attention run once."""
    h = model.embed(tokens)
    for k, block in enumerate(model.blocks):
        a = block.ln1(h)
        out, *extra = block.attn(a, **call) if call else (block.attn(a),)
        yield k, block, a, tuple(extra)
        h = h + out
        h = h + block.mlp(block.ln2(h))


@torch.no_grad()
def certified_widths(model, val, lengths, count) -> list[dict]:
    """Per length and layer: the heads' certified widths over ``count`` windows (the CPU's
    cost rules set aside: what the certificate proves, not what a fast reading reads)."""
    with set_aside():
        return _certified_widths(model, val, lengths, count)


def _certified_widths(model, val, lengths, count) -> list[dict]:
    rows = []
    for length in lengths:
        widths, skipped = {}, {}
        for w in spaced_windows(val, length, count):
            for k, block, a, (trace,) in layer_inputs(model, w[None], return_trace=True):
                (cut,) = trace.truncation.values()
                heads = cut.heads if cut.heads is not None else torch.full(
                    (a.shape[0], block.declaration.heads), cut.width)
                widths.setdefault(k, []).append(heads.reshape(-1).double())
                skipped.setdefault(k, []).append(float(cut.skipped))
        for k in sorted(widths):
            per_head = torch.stack(widths[k])  # (windows, heads)
            rows.append({"length": length, "layer": k,
                         "median_width": per_head.median(0).values.tolist(),
                         "largest_width": per_head.max(0).values.tolist(),
                         "skipped": sum(skipped[k]) / len(skipped[k])})
    return rows


@torch.no_grad()
def credible_windows(model, val, lengths, count, level=0.9) -> list[dict]:
    """Per length and layer: each token's credible context length's upper end, summarised."""
    rows = []
    for length in lengths:
        highs = {}
        for w in spaced_windows(val, length, count):
            for k, block, a, _ in layer_inputs(model, w[None]):
                ctx = sa.windows.credible_context(block.attn, a, level)
                highs.setdefault(k, []).append(ctx.length_high.reshape(ctx.length_high.shape[-2],
                                                                       -1).double())
        for k in sorted(highs):
            per_head = torch.cat(highs[k], dim=-1)  # (heads, tokens)
            rows.append({"length": length, "layer": k, "level": level,
                         "median_length_high": per_head.median(-1).values.tolist(),
                         "p90_length_high": per_head.quantile(0.9, dim=-1).tolist()})
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", help="a train_lm run's folder (checkpoint.pt and result.json)")
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192, 16384])
    p.add_argument("--windows", type=int, default=4, help="validation windows per length")
    p.add_argument("--tol", type=float, default=1e-4)
    p.add_argument("--distances", type=int, nargs="+", default=[64, 256, 1024, 4096, 8192])
    p.add_argument("--trials", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-files", type=int, default=None, help="the first N files only")
    train_lm.lm_corpus.add_corpus_argument(p)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None, help="where to write (default: RUN/probes.json)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    run = pathlib.Path(args.run)
    model, result = load(run)
    variant = result["variant"]
    _, val, manifest = train_lm.lm_corpus.corpus_of(args, "lm_probes")
    if manifest["sha256"] != result["manifest_sha256"]:
        here, there = manifest["sha256"][:16], result["manifest_sha256"][:16]
        read = f"the corpus file {args.corpus}" if args.corpus \
            else "this Python's standard library"
        raise SystemExit(f"lm_probes: {read} (corpus {here}) is not the one {run} trained on "
                         f"({there}); --corpus PATH reads a corpus file")
    out = {"variant": variant, "seed": result["args"]["seed"], "args": vars(args),
           "passkey": passkey_probe.passkey_rows(model, val, args.distances, args.trials,
                                                 args.seed)}
    for r in out["passkey"]:
        print(f"[{variant}] passkey at {r['distance']}: {r['accuracy']:.2f} of the digits, "
              f"planted-edge mass {r['planted_edge_mass']:.2e} (uniform "
              f"{r['uniform_mass']:.1e})", flush=True)
    if variant in train_lm.CERTIFIED:
        cut, _ = load(run, tol=args.tol)
        out["certified"] = certified_widths(cut, val, args.lengths, args.windows)
        for r in out["certified"]:
            print(f"[{variant}] certified widths at {r['length']}, layer {r['layer']}: median "
                  f"{r['median_width']}, largest {r['largest_width']}", flush=True)
    if variant in CREDIBLE:
        out["credible"] = credible_windows(model, val, args.lengths, args.windows)
        for r in out["credible"]:
            print(f"[{variant}] 90% credible context at {r['length']}, layer {r['layer']}: "
                  f"median upper end {[round(v, 1) for v in r['median_length_high']]}",
                  flush=True)
    path = pathlib.Path(args.json) if args.json else run / "probes.json"
    path.write_text(json.dumps(out, indent=1))
    print("wrote", path)
    return out


if __name__ == "__main__":
    main()
