"""A stock Hugging Face Llama trained from scratch on bytes, converted to FoX and to ALiBi with
``structattn.integrations.transformers.convert``, fine-tuned, read beyond its training length,
and generating through the certified cache.

**Corpus**: ``train_lm.py``'s (``lm_corpus.py``: the standard library's source split by file;
``--corpus [PATH]`` reads the file ``train_lm.py --write-corpus`` wrote, ``--max-files N``
builds a smaller one). Training draws random windows of ``--context`` + 1 bytes from the
training bytes (``train_lm.batch``, a seeded generator); AdamW with ``train_lm.learning_rate``'s
schedule (5% warm-up, cosine decay to 0 over the budget, in minutes or ``--steps``), float32.

**Models**: a ``transformers.LlamaForCausalLM`` from a ``LlamaConfig`` (vocabulary 256 bytes,
hidden ``--hidden``, ``--layers`` layers of ``--heads`` heads, SwiGLU MLP, RMSNorm, RoPE with
base 10,000), random init, trained for ``--minutes``. Then:

- ``convert(model, "forgetting_attention")``: every weight copied, RoPE kept, FoX's forget
  gate added (W_f = 0, bias 8: the gates start almost open, so the model starts next to the
  stock one);
- ``convert(model, "alibi_attention")``: RoPE kept, ALiBi's linear bias added (slopes
  2^(-8h/H)), which changes the function from the first step;
- the stock model trained ``--finetune-minutes`` more (the control: as much training as the
  converted models get in all).

Each converted model is fine-tuned for ``--finetune-minutes`` at ``--finetune-lr``.

**Evaluation**: bits per byte on the first ``--eval-bytes`` validation bytes, read in
consecutive windows of each ``--eval-lengths`` length (``train_lm.whole_windows``, every byte
predicted from those before it in its window; ``train_lm.bits_per_byte``): the training length
and beyond it (2× and 4× by default), for the stock model, each converted model right after
conversion and after fine-tuning, and the control.

**Generation**: each fine-tuned converted model continues ``--prompt`` for ``--generate`` bytes
through ``StructAttnCache(config, tol=--tol)`` passed to ``model.generate(..., cache=cache)``
(sampled at ``--temperature``, seeded), and again through the growing cache with the same seed:
the tokens each layer holds against the tokens read, the tokens evicted, the bound on the
evicted posterior mass, whether it is certified, and whether the bytes agree.

Writes ``hf_convert_lm.json`` and ``hf_convert_lm.png`` (bits per byte against the evaluation
length) to ``--out`` (default ``gallery/output/hf_convert_lm/``). Run::

    python gallery/hf_convert_lm.py --threads 1        # 3 + 3 × 2 minutes of training
    python gallery/hf_convert_lm.py --quick            # tiny, under a minute (the test's)
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import generate_lm  # noqa: E402
import train_lm  # noqa: E402

#: the converted variants: label → the catalogue attention ``convert`` is given
VARIANTS = {"fox": "forgetting_attention", "alibi": "alibi_attention"}


def stock_model(args):
    """A randomly initialised ``LlamaForCausalLM`` over bytes at the sizes asked."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.heads, rope_theta=10000.0, tie_word_embeddings=False,
        # default RoPE does not read it; generate() warns past it
        max_position_embeddings=max(8192, *args.eval_lengths,
                                    len(args.prompt.encode()) + args.generate))
    torch.manual_seed(args.seed)
    return transformers.LlamaForCausalLM(config)


class ByteLogits(nn.Module):
    """An HF causal LM read as ``train_lm.bits_per_byte`` reads a ``ByteLM``: bytes ``(B, T)``
    → logits ``(B, T, 256)``, its embedding as ``embed``."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.embed = model.get_input_embeddings()

    def forward(self, tokens):
        return self.model(tokens, use_cache=False).logits


def train(model, train_bytes, args, minutes: float, lr: float, label: str) -> dict:
    """AdamW on random windows for ``minutes`` (or ``args.steps`` steps, whichever first),
    ``train_lm.learning_rate``'s schedule over the budget; the mean training loss (bits per
    byte) every ``args.log_every`` steps."""
    gen = torch.Generator().manual_seed(args.seed + len(label))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    model.train()
    budget, start, step, curve, losses = minutes * 60, time.perf_counter(), 0, [], []
    while step < args.steps:
        elapsed = time.perf_counter() - start
        if elapsed >= budget:
            break
        for group in opt.param_groups:
            group["lr"] = train_lm.learning_rate(step, args.steps, lr, elapsed / budget)
        x, y = train_lm.batch(train_bytes, args.batch, args.context, gen)
        loss = F.cross_entropy(model(x, use_cache=False).logits.flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item() / 0.6931471805599453)
        step += 1
        if step % args.log_every == 0:
            curve.append({"step": step, "seconds": time.perf_counter() - start,
                          "train_bpb": sum(losses) / len(losses)})
            print(f"[{label}] step {step}, {curve[-1]['seconds']:.0f} s, "
                  f"train {curve[-1]['train_bpb']:.3f} bits/byte", flush=True)
            losses = []
    seconds = time.perf_counter() - start
    model.eval()
    return {"steps": step, "seconds": seconds, "lr": lr,
            "tokens_per_second": step * args.batch * args.context / max(seconds, 1e-9),
            "curve": curve}


def evaluate(model, val_bytes, args) -> dict:
    """Bits per byte at each evaluation length on the same validation bytes."""
    reader = ByteLogits(model.eval())
    text = val_bytes[:args.eval_bytes + 1]
    start = time.perf_counter()
    out = {str(n): train_lm.bits_per_byte(reader, train_lm.whole_windows(text, n),
                                          batch_size=max(1, args.eval_tokens // n))
           for n in args.eval_lengths}
    out["seconds"] = time.perf_counter() - start
    return out


@torch.no_grad()
def continue_prompt(model, prompt: bytes, args, tol=None) -> dict:
    """The model's continuation of ``prompt`` through a ``StructAttnCache`` (certified with
    ``tol``, else growing), sampled with the seed; what the cache held at the end."""
    from structattn.integrations.transformers import StructAttnCache

    cache = StructAttnCache(model.config, tol=tol)
    ids = torch.tensor([list(prompt)])
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache,
                         max_new_tokens=args.generate, do_sample=True,
                         temperature=args.temperature, pad_token_id=0)
    seconds = time.perf_counter() - start
    made = bytes(out[0, ids.shape[1]:].tolist())
    # the last token generated is not read back: the cache holds or evicted the rest
    return {"tokens": made, "read": cache.get_seq_length(), "held": cache.held(),
            "evicted": cache.evicted, "bound": cache.bound, "certified": cache.certified,
            "seconds": seconds, "ms_per_token": 1000 * seconds / max(1, len(made))}


def generation(model, args) -> dict:
    """The certified cache's continuation beside the growing cache's (same seed)."""
    prompt = args.prompt.encode()
    certified = continue_prompt(model, prompt, args, tol=args.tol)
    full = continue_prompt(model, prompt, args)
    a, b = certified.pop("tokens"), full.pop("tokens")
    agree = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
    return {"prompt": args.prompt, "generated": len(a), "tol": args.tol, **certified,
            "sample": generate_lm.printable(a[:args.sample_bytes]),
            "full_cache": {k: full[k] for k in ("held", "seconds", "ms_per_token")},
            "bytes_agreeing_with_full_cache": agree}


def plot(bpb: dict, args, path: pathlib.Path) -> None:
    """Bits per byte against the evaluation length: the stock model and its control, each
    converted model before and after fine-tuning."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    style = {"stock": ("black", "-", "o"), "stock, trained on": ("grey", "--", "o"),
             "fox, converted": ("tab:blue", ":", "s"), "fox, fine-tuned": ("tab:blue", "-", "s"),
             "alibi, converted": ("tab:orange", ":", "^"),
             "alibi, fine-tuned": ("tab:orange", "-", "^")}
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    lengths = args.eval_lengths
    for name, values in bpb.items():
        colour, line, marker = style[name]
        ax.plot(lengths, [values[str(n)] for n in lengths], color=colour, ls=line,
                marker=marker, label=name)
    ax.axvline(args.context, color="grey", lw=0.8, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [f"{n:,}" for n in lengths])
    ax.set_xlabel(f"evaluation window (bytes); dotted: the training length {args.context}")
    ax.set_ylabel("validation bits per byte")
    ax.set_title(f"HF Llama converted to FoX and ALiBi ({args.minutes:g} min pre-training, "
                 f"{args.finetune_minutes:g} min fine-tuning)", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=3.0, help="pre-training budget")
    p.add_argument("--finetune-minutes", type=float, default=2.0,
                   help="fine-tuning budget of each converted model (and of the control)")
    p.add_argument("--steps", type=int, default=10**9, help="a step budget for each phase")
    p.add_argument("--context", type=int, default=256, help="the training length")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=344)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3, help="pre-training learning rate")
    p.add_argument("--finetune-lr", type=float, default=1e-3)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--eval-lengths", type=int, nargs="+", default=None,
                   help="evaluation windows (default: 1×, 2× and 4× --context)")
    p.add_argument("--eval-bytes", type=int, default=65536,
                   help="the first N validation bytes, read at every length")
    p.add_argument("--eval-tokens", type=int, default=8192, help="bytes per evaluation batch")
    p.add_argument("--prompt", default="def main(argv=None):\n    ")
    p.add_argument("--generate", type=int, default=1024, help="bytes generated")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--tol", type=float, default=1e-3,
                   help="the certified cache's bound on the evicted posterior mass")
    p.add_argument("--sample-bytes", type=int, default=300, help="generated bytes shown")
    p.add_argument("--max-files", type=int, default=None, help="the first N files only")
    train_lm.lm_corpus.add_corpus_argument(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=str(HERE / "output" / "hf_convert_lm"))
    p.add_argument("--quick", action="store_true", help="a tiny run, under a minute (the test's)")
    args = p.parse_args(argv)
    if args.quick:
        args.minutes, args.finetune_minutes, args.steps, args.log_every = 0.1, 0.05, 12, 4
        args.context, args.hidden, args.intermediate, args.layers, args.heads = 32, 32, 64, 2, 2
        args.eval_bytes, args.generate, args.sample_bytes = 1024, 24, 24
        args.max_files = None if args.corpus else 40
    args.eval_lengths = args.eval_lengths or [args.context, 2 * args.context, 4 * args.context]
    for name in ("minutes", "finetune_minutes", "tol", "temperature"):
        if not getattr(args, name) > 0:
            p.error(f"--{name.replace('_', '-')} must be positive; got {getattr(args, name)}")
    if args.eval_bytes < max(args.eval_lengths) + 1:
        p.error(f"--eval-bytes {args.eval_bytes}: fewer than the longest --eval-lengths "
                f"{max(args.eval_lengths)} (+1)")
    return args


def main(argv=None):
    args = parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from structattn.integrations.transformers import convert

    train_bytes, val_bytes, manifest = train_lm.lm_corpus.corpus_of(args, "hf_convert_lm")
    if len(val_bytes) < args.eval_bytes + 1:
        raise SystemExit(f"hf_convert_lm: --eval-bytes {args.eval_bytes}: the validation text "
                         f"holds {len(val_bytes):,} bytes")
    load = os.getloadavg()[0]
    model = stock_model(args)
    training = {"stock": train(model, train_bytes, args, args.minutes, args.lr, "stock")}
    bpb, timing = {"stock": evaluate(model, val_bytes, args)}, {}
    results = {}
    for label, attention in VARIANTS.items():
        converted = convert(model, attention)
        bpb[f"{label}, converted"] = evaluate(converted, val_bytes, args)
        training[label] = train(converted, train_bytes, args, args.finetune_minutes,
                                args.finetune_lr, label)
        bpb[f"{label}, fine-tuned"] = evaluate(converted, val_bytes, args)
        results[label] = generation(converted, args)
        g = results[label]
        print(f"[{label}] generated {g['generated']} bytes through StructAttnCache(tol="
              f"{args.tol:g}): {g['read']} tokens read, held {g['held']} per layer, evicted "
              f"{g['evicted']}, bound {g['bound']:.3g}, certified {g['certified']}; "
              f"{g['ms_per_token']:.1f} ms/byte (growing cache "
              f"{g['full_cache']['ms_per_token']:.1f}); {g['bytes_agreeing_with_full_cache']} "
              f"bytes agree with the growing cache's\n{args.prompt}{g['sample']}", flush=True)
    training["stock, trained on"] = train(model, train_bytes, args, args.finetune_minutes,
                                          args.finetune_lr, "stock, trained on")
    bpb["stock, trained on"] = evaluate(model, val_bytes, args)
    for name, values in bpb.items():
        timing[name] = values.pop("seconds")
        print(f"{name:>18}: " + ", ".join(f"{values[str(n)]:.4f} at {n}"
                                          for n in args.eval_lengths), flush=True)
    written = [out / "hf_convert_lm.json", out / "hf_convert_lm.png"]
    settings = {k: generate_lm.shown(v) if k in ("out", "corpus") else v
                for k, v in vars(args).items()}
    written[0].write_text(json.dumps({
        "args": settings, "corpus_sha256": manifest["corpus_sha256"],
        "params": sum(p.numel() for p in model.parameters()),
        "params_converted": {k: sum(p.numel() for p in convert(model, a).parameters())
                             for k, a in VARIANTS.items()},
        "bpb": bpb, "eval_seconds": timing, "training": training, "generation": results,
        "load_average": [load, os.getloadavg()[0]]}, indent=1))
    plot(bpb, args, written[1])
    print("wrote", *map(str, written))
    return [str(w) for w in written]


if __name__ == "__main__":
    main()
