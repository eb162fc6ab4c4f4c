"""A byte-level language model on the Python standard library's own source, with the attention
of each layer any compiled structattn model chosen by name.

**Corpus** (``lm_corpus.py``): the ``.py`` files of a standard library, sorted by path; every
20th file (from the first) is held out for validation, so the split is by file; a manifest
lists each file's path, size and SHA-256. The corpus is one fixed text, named by its hash
(sha256 of the train and validation bytes' digests): the LM table's, ``CORPUS_SHA256``, is
Python 3.11.7's standard library (1,790 files, 30.0 MB train / 1.5 MB validation), where
another Python's differs (3.12's: 435 KB of validation bytes). ``--write-corpus [PATH]``
writes the corpus built from this Python's library to a file (default
``gallery/corpus/stdlib.corpus.gz``, ~6 MB, git-ignored) that ``--corpus [PATH]`` reads on
any machine; a corpus whose hash is not ``CORPUS_SHA256`` is refused unless ``--any-corpus``
is given (``--max-files``, for tiny runs, is such a corpus). ``--text FILE`` trains on any
text file instead (its last 5% validates), unchecked.

**Model** (``ByteLM``): byte embedding (256) → ``--layers`` pre-LayerNorm blocks, each
``x ← x + attn(LN(x))``, ``x ← x + MLP(LN(x))`` (4× wide, GELU) → LayerNorm → a head tied to
the embedding. No position embedding: every variant's order information is its own (its prior,
its rotary potential, or the causal mask). ``attn`` = ``sa.compile`` of (``ATTENTIONS``):

- ``causal``: ``self_attention(causal=True)`` — causal attention with no positions (NoPE);
- ``rope``: ``rope_attention`` — rotary positions on a causal uniform prior, the Transformer
  baseline the priors' papers compare against; ``fox+rope``: the forget gate with rotary
  positions (FoX's "Pro" recipe);
- ``sliding``: a uniform prior over the ``--window`` previous tokens, declared here in ten
  lines (``SlidingWindow``: a window support, lowered as banded SDPA);
- ``alibi``, ``relative`` (learned logits per clipped distance, ±``--window``), ``fox`` (the
  forget gate), ``gaussian`` (BAM's generalised Gaussian), ``stick_breaking``;
- ``expanding_exact`` (the beta-geometric posterior, certified windows at tol 1e-3) and
  ``expanding_mf`` (mean-field windows, certified; ``grad="last"``).

The projections are the same (W_Q, W_K, W_V, W_O per layer), so the variants differ in
parameter count only by their priors' own parameters (reported).

**Training**: AdamW (lr ``--lr``, linear warm-up over 5% of the budget, cosine decay to 0 at
its end), random windows of ``--context`` + 1 bytes from the training bytes (a seeded
generator), a budget of ``--steps`` steps or ``--minutes`` of training time, whichever comes
first — the schedule follows whichever is further along, so a time budget decays over its
minutes (and, timed, is not reproducible bit for bit, where a step budget is); validation bits
per byte every ``--eval-every`` steps on fixed windows (the curve) and on them at the last
step (``final_val_bpb``, also where a time budget ended between evaluations), and at the end
on every validation byte once (``--final-eval whole``, the default: the table's figure, beside the
compressors zlib, bz2 and xz on the same bytes), and with ``--eval-lengths`` in windows longer
than the training length (``lm_extrapolation.png``); a checkpoint (model, optimiser,
generator, step, elapsed time, history) every ``--save-every`` steps and at the end, which
``--resume`` continues from to the same numbers as an uninterrupted run (tested). Under
``torchrun`` (gloo) every rank draws the same global batch and trains on its share; DDP
averages the gradients. ``--dtype bfloat16`` trains and reads the model under
``torch.autocast`` in bfloat16 on its device (float32 parameters and optimiser; ``float32``,
the default, has no autocast).

**Report** (``--out DIR``): ``DIR/<variant>/result.json`` per variant (validation curve
against step and training time, tokens per second, peak RSS, parameter count, each head's
mean attention distance on validation windows and, for the geometric–Beta prior, each head's
learned prior: a, b, its mean and 90% quantile of distance), ``DIR/lm_results.md`` (one table)
and two pictures: validation bits per byte against training time, and each expanding head's
learned prior over distance beside where its attention mass falls.

Run::

    python gallery/train_lm.py --attention causal expanding_mf --context 512 --steps 2000
    python gallery/train_lm.py --attention causal --context 512 --steps 4000 --resume
    torchrun --nproc_per_node=2 gallery/train_lm.py --attention causal --steps 200
    python gallery/train_lm.py --device cuda --dtype bfloat16 --attention rope fox+rope \
        --minutes 30 --steps 1000000 --corpus  # one GPU; its name and peak memory in the table
    python gallery/train_lm.py --write-corpus   # the corpus built here, for --corpus elsewhere
    python gallery/train_lm.py --report-only --out DIR   # tables and pictures from DIR
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import pathlib
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import structattn as sa
from structattn.kinds.window import Window
from structattn.priors import Prior

# the benchmarks' peak-memory measurement (a variant's own peak, not the process's)
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
from _memory import peak_rss_kib, release_and_reset_peak  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
# the corpus (lm_corpus.py); its names stay this module's too (lm_probes, tests)
import lm_corpus  # noqa: E402
from lm_corpus import stdlib_corpus, stdlib_files, text_corpus  # noqa: E402, F401

# -- the attention variants ------------------------------------------------------------


class SlidingWindow(Prior):
    """p(φ_i = i − d) uniform over 1 ≤ d ≤ width (the first token: no past, zero value)."""

    empty = "zero"
    block_size = 64

    def __init__(self, width: int):
        self.width = width

    def support(self, num_children, num_parents):
        return Window(self.width, offset=num_parents - num_children)

    def log_by_distance(self, window, device, dtype):
        d = torch.arange(window + 1, device=device)
        return torch.zeros(1, window + 1, device=device, dtype=dtype).masked_fill(
            d == 0, float("-inf"))


class SlidingWindowAttention(sa.models.SelfAttention):
    """Each token reads one of its ``window`` predecessors, uniformly a priori."""

    def __init__(self, d_model, *, window=64, **kwargs):
        super().__init__(d_model, causal=True, **kwargs)
        self.window = window

    def model(self, x):
        tokens = self.tokens(x)
        return self.attend(self.family_name, tokens, tokens, SlidingWindow(self.window))


def make_attention(name: str, d: int, heads: int, window: int, layer: int, tol=None):
    """Layer ``layer``'s attention declaration; ``tol``: the certified window's posterior mass
    left out, for the variants whose prior takes one (``CERTIFIED``; the trained parameters
    are the same with or without it)."""
    kw = dict(heads=heads, name=f"attn{layer}")
    cert = {} if tol is None else dict(tol=tol)
    models = sa.models
    table = {
        "causal": lambda: models.self_attention(d, causal=True, **kw),
        "sliding": lambda: SlidingWindowAttention(d, window=window, **kw),
        "alibi": lambda: models.alibi_attention(d, **kw, **cert),
        "relative": lambda: models.relative_position_attention(d, max_distance=window,
                                                               causal=True, **kw),
        "fox": lambda: models.forgetting_attention(d, **kw, **cert),
        "rope": lambda: models.rope_attention(d, **kw),  # the usual Transformer baseline
        "fox+rope": lambda: models.forgetting_attention(  # FoX's "Pro" recipe
            d, rope_base=10000.0, **kw, **cert),
        "gaussian": lambda: models.generalised_gaussian_attention(
            d, width=float(window), **kw, **cert),
        "stick_breaking": lambda: models.stick_breaking_attention(d, **kw),
        "expanding_exact": lambda: models.expanding_attention(d, inference=None, tol=1e-3,
                                                              a=4.0, b=1.0, **kw),
        "expanding_mf": lambda: models.expanding_attention(
            d, inference=sa.MeanFieldWindows(grad="last"), a=4.0, b=1.0, **kw),
    }
    if name not in table:
        raise ValueError(f"--attention: unknown variant {name!r}; choose from {sorted(table)}")
    if tol is not None and name not in CERTIFIED:
        raise ValueError(f"make_attention: {name!r} has no certified window (tol); those that "
                         f"do: {CERTIFIED}")
    return table[name]()


CERTIFIED = ["alibi", "fox", "fox+rope", "gaussian"]  # priors whose tol certifies a window
ATTENTIONS = ["causal", "rope", "sliding", "alibi", "relative", "fox", "fox+rope", "gaussian",
              "stick_breaking", "expanding_exact", "expanding_mf"]


# -- the model --------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, d, heads, attention, window, layer, tol=None):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.declaration = make_attention(attention, d, heads, window, layer, tol)
        self.attn = sa.compile(self.declaration)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class ByteLM(nn.Module):
    """Bytes ``(B, T)`` long → next-byte logits ``(B, T, 256)``."""

    def __init__(self, d=128, layers=2, heads=4, attention="causal", window=64, tol=None):
        super().__init__()
        self.embed = nn.Embedding(256, d)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.blocks = nn.ModuleList(Block(d, heads, attention, window, k, tol)
                                    for k in range(layers))
        self.ln = nn.LayerNorm(d)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.ln(x) @ self.embed.weight.T


# -- training ---------------------------------------------------------------------------


def windows_at(data: torch.Tensor, starts: torch.Tensor, context: int):
    """``(x, y)``: the ``context`` bytes from each start and the bytes that follow each one."""
    chunk = data[starts[:, None] + torch.arange(context + 1)].long()
    return chunk[:, :-1], chunk[:, 1:]


def batch(data: torch.Tensor, size: int, context: int, gen: torch.Generator):
    return windows_at(data, torch.randint(0, len(data) - context - 1, (size,), generator=gen),
                      context)


def validation_windows(data: torch.Tensor, count: int, context: int):
    """Fixed windows spread evenly over the validation bytes."""
    last = len(data) - context - 1
    return windows_at(data, torch.linspace(0, max(last, 0), count).long(), context)


def whole_windows(data: torch.Tensor, context: int):
    """The whole validation set, once: consecutive windows of ``context`` bytes, each byte
    predicted from the bytes before it in its window (the last partial window dropped)."""
    return windows_at(data, torch.arange((len(data) - 1) // context) * context, context)


def compression_anchors(data: torch.Tensor) -> dict:
    """Bits per byte of general-purpose compressors on the same validation bytes: what a
    model must beat before its figures say anything about language."""
    import bz2
    import lzma
    import zlib

    raw = bytes(data.tolist())
    n = max(1, len(raw))
    return {"zlib -9": 8 * len(zlib.compress(raw, 9)) / n,
            "bz2 -9": 8 * len(bz2.compress(raw, 9)) / n,
            "xz -9": 8 * len(lzma.compress(raw, preset=9)) / n}


@torch.no_grad()
def bits_per_byte(model, windows, batch_size=8, dtype="float32") -> float:
    x, y = windows
    device = model.embed.weight.device
    total = 0.0
    for k in range(0, len(x), batch_size):
        with precision(device, dtype):
            logits = model(x[k:k + batch_size].to(device))
        total += F.cross_entropy(logits.float().flatten(0, 1),
                                 y[k:k + batch_size].to(device).flatten(),
                                 reduction="sum").item()
    return total / y.numel() / math.log(2)


def precision(device: torch.device, dtype: str):
    """The context a forward runs in: ``torch.autocast`` in bfloat16 on ``device`` for
    ``"bfloat16"``, nothing for ``"float32"``."""
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=getattr(torch, dtype))


def learning_rate(step, steps, lr, progress=None):
    """Linear warm-up over the first 5% of the budget, then cosine decay to 0 at its end.
    The budget is ``steps`` steps; given ``progress`` (the fraction of a ``--minutes`` budget
    trained) further along than the steps, the same shape over the minutes: a time budget
    decays over its own minutes, not over a step count it never reaches."""
    warm = max(1, steps // 20)
    if progress is not None and progress > step / max(1, steps):
        if progress < 0.05:
            return lr * min(1.0, max(progress / 0.05, (step + 1) / warm))
        return 0.5 * lr * (1 + math.cos(math.pi * min(1.0, (progress - 0.05) / 0.95)))
    if step < warm:
        return lr * (step + 1) / warm
    return 0.5 * lr * (1 + math.cos(math.pi * (step - warm) / max(1, steps - warm)))


def reset_peak_rss() -> float:
    """Reset the RSS high-water mark to the current RSS (``benchmarks/_memory.py``: freed heap
    returned, then /proc/self/clear_refs) and return it, MiB: a variant's peak is the growth
    over it, not the process's (which holds earlier variants)."""
    gc.collect()
    release_and_reset_peak()
    return peak_rss_mib()


def peak_rss_mib() -> float:
    """The RSS high-water mark (VmHWM, else ru_maxrss), MiB."""
    return peak_rss_kib()[0] / 1024


def distributed():
    """(rank, world) and the process group under torchrun, else (0, 1)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo")
    return int(os.environ.get("RANK", "0")), world


def train(args, variant: str, data, out_dir: pathlib.Path | None, log=print,
          anchors: dict | None = None) -> dict:
    """Train one variant; returns its result (also written to ``out_dir/result.json``), with
    ``anchors`` (the compressors on the same validation bytes) beside it."""
    rank, world = distributed()
    train_bytes, val_bytes, manifest = data
    rss_before = reset_peak_rss()
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    model = ByteLM(args.d_model, args.layers, args.heads, variant, args.window).to(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(args.seed)
    step, elapsed, history = 0, 0.0, []
    ckpt = None if out_dir is None else out_dir / "checkpoint.pt"
    if args.resume and ckpt is not None and ckpt.exists():
        state = torch.load(ckpt, weights_only=True, map_location=device)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        gen.set_state(state["generator"].cpu())
        step, elapsed, history = state["step"], state["elapsed"], state["history"]
        log(f"[{variant}] resumed at step {step} ({elapsed:.0f} s trained)")
    net = model
    if world > 1:
        net = nn.parallel.DistributedDataParallel(model)
    windows = validation_windows(val_bytes, args.eval_windows, args.context)
    share = args.batch // world
    budget = args.minutes * 60 if args.minutes else math.inf
    steps = args.steps
    progress = _progress(steps, step, variant, rank)

    def save():
        if ckpt is None or rank != 0:
            return
        # written aside, then renamed: a run killed while saving keeps its last checkpoint
        part = ckpt.with_name(ckpt.name + ".part")
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                    "generator": gen.get_state(), "step": step, "elapsed": elapsed,
                    "history": history}, part)
        os.replace(part, ckpt)

    stop = steps if args.stop_after is None else min(steps, args.stop_after)
    start = step
    while step < stop and elapsed < budget:
        x, y = batch(train_bytes, args.batch, args.context, gen)
        x, y = (t[rank * share:(rank + 1) * share].to(device) for t in (x, y))
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, steps, args.lr,
                                        None if budget == math.inf else elapsed / budget)
        t = time.perf_counter()
        with precision(device, args.dtype):
            logits = net(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if device.type == "cuda":  # the step's kernels finished before it is timed
            torch.cuda.synchronize(device)
        elapsed += time.perf_counter() - t
        step += 1
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"[{variant}] the training loss is {loss.item()} at step "
                                     f"{step}")
        if step % args.eval_every == 0 or step == steps:
            history.append({"step": step, "seconds": elapsed, "train_loss": loss.item(),
                            "val_bpb": bits_per_byte(model, windows, dtype=args.dtype)})
            progress.set_postfix(val_bpb=f"{history[-1]['val_bpb']:.3f}")
        if args.save_every and step % args.save_every == 0:
            save()
        progress.update(1)
    progress.close()
    save()
    if not history or history[-1]["step"] != step:  # a time budget ended between evaluations
        # (after the checkpoint: a resumed run's curve is an uninterrupted one's)
        history.append({"step": step, "seconds": elapsed,
                        "train_loss": loss.item() if step > start else None,
                        "val_bpb": bits_per_byte(model, windows, dtype=args.dtype)})
    train_peak_rss = peak_rss_mib() - rss_before  # before the long evaluation windows
    # the figure to read: every validation byte, once (the curve above samples windows)
    whole = None
    if args.final_eval == "whole":
        whole_set = whole_windows(val_bytes, args.context)
        whole = {"val_bpb": bits_per_byte(model, whole_set, dtype=args.dtype),
                 "bytes": int(whole_set[1].numel())}
    # length extrapolation: the same model read in windows longer than it was trained on
    by_length = []
    for length in args.eval_lengths or ():
        part = val_bytes[:args.eval_bytes] if args.eval_bytes else val_bytes
        windows_l = whole_windows(part, length)
        if len(windows_l[0]) == 0:
            continue
        for block in model.blocks:  # one length's plans at a time: a dense prior's (H, L, L)
            block.attn.reset()  # table is a plan's constant, 4 GiB per layer at 16,384
        with sa.validation(False):  # the parameters were checked at every training step
            bpb = bits_per_byte(model, windows_l, batch_size=max(1, 4096 // length),
                                dtype=args.dtype)
        by_length.append({"context": length, "bytes": int(windows_l[1].numel()),
                          "val_bpb": bpb})
        log(f"[{variant}] read at {length} bytes: {by_length[-1]['val_bpb']:.3f} bits/byte "
            f"({by_length[-1]['bytes']:,} bytes)")
    result = {"variant": variant, "context": args.context, "params": params,
              "steps": step, "train_seconds": elapsed, "world_size": world,
              "whole_validation": whole, "by_length": by_length, "anchors": anchors,
              "tokens_per_second": step * args.batch * args.context / max(elapsed, 1e-9),
              "peak_rss_mib": train_peak_rss, "eval_peak_rss_mib": peak_rss_mib() - rss_before,
              "history": history,
              "device": (torch.cuda.get_device_name(device) if device.type == "cuda"
                         else "cpu"),
              "peak_gpu_mib": (torch.cuda.max_memory_allocated(device) / 2 ** 20
                               if device.type == "cuda" else None),
              "final_val_bpb": history[-1]["val_bpb"] if history else None,
              "manifest_sha256": manifest["sha256"],
              "corpus_sha256": manifest["corpus_sha256"], "dtype": args.dtype,
              "args": vars(args),
              "heads": head_report(model, windows)}
    if out_dir is not None and rank == 0:
        (out_dir / "result.json").write_text(json.dumps(result, indent=1))
    return result


def _progress(total, done, variant, rank):
    from tqdm import tqdm

    return tqdm(total=total, initial=done, desc=variant, disable=rank != 0 or total < 20,
                leave=False)


@torch.no_grad()
def head_report(model: ByteLM, windows, count: int = 4) -> list:
    """Per layer and head: the mean distance back at which attention mass falls on validation
    windows, and for the geometric–Beta prior its learned a, b, mean and 90% distance."""
    x = windows[0][:count].to(model.embed.weight.device)
    h = model.embed(x)
    report = []
    for layer, block in enumerate(model.blocks):
        z = block.ln1(h)
        out = block.attn(z, return_posterior=True)
        post = out[1]  # (B, H, T, T)
        T = post.shape[-1]
        pos = torch.arange(T, device=post.device)
        dist = (pos[:, None] - pos[None, :]).clamp(min=0).to(post.dtype)
        mass = post.sum(-1).clamp(min=1e-12)
        mean_distance = ((post * dist).sum(-1) / mass).mean((0, 2))  # (H,)
        entry = {"layer": layer, "mean_attention_distance": mean_distance.tolist()}
        decl = block.declaration
        if isinstance(decl, sa.models.ExpandingAttention):
            prior = decl.prior()
            tail = prior.log_tail(pos[:, None], post.device, torch.float64).exp()  # (T, H)
            cdf = 1 - tail
            entry.update(a=decl.a.tolist(), b=decl.b.tolist(),
                         prior_mean_distance=decl.expected_distance(T).tolist(),
                         prior_q90_distance=[int((cdf[:, k] < 0.9).sum()) for k in
                                             range(cdf.shape[1])],
                         prior_pmf=prior.log_pmf(pos[1:], post.device).exp().tolist(),
                         attention_by_distance=_mass_by_distance(post).tolist())
        report.append(entry)
        h = h + out[0]
        h = h + block.mlp(block.ln2(h))
    return report


def _mass_by_distance(post):
    """``(H, T)``: the share of attention mass at each distance d = i − j, summed over queries
    and averaged over the batch (one gather: column d of row i is parent i − d)."""
    T = post.shape[-1]
    i = torch.arange(T, device=post.device)[:, None]
    d = torch.arange(T, device=post.device)[None, :]
    by_distance = post.gather(-1, (i - d).clamp(min=0).expand(*post.shape)) * (d <= i)
    out = by_distance.sum(-2).mean(0)  # (H, T)
    return out / out.sum(-1, keepdim=True).clamp(min=1e-12)


# -- reporting --------------------------------------------------------------------------


def report(out: pathlib.Path) -> list[str]:
    """``lm_results.md`` and the two pictures from every ``*/result.json`` under ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [json.loads(p.read_text()) for p in sorted(out.glob("*/result.json"))]
    if not results:
        return []
    base = {r["context"]: r["tokens_per_second"] for r in results if r["variant"] == "causal"}
    # the time budget: every run's training time is cut at the shortest run's (per context)
    shortest = {}
    for r in results:
        shortest[r["context"]] = min(shortest.get(r["context"], math.inf), r["train_seconds"])
    lines = ["| variant | context | params | steps | train s | bits/byte, whole validation set | "
             "val bits/byte (equal steps, sampled windows) | "
             "val bits/byte at the shortest run's time | tokens/s | vs causal | peak RSS MiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    anchors = next((r["anchors"] for r in results if r.get("anchors")), None)
    for name, bpb in (anchors or {}).items():
        lines.append(f"| {name} (compressor) | — | — | — | — | {bpb:.3f} | — | — | — | — | — |")

    def whole(r):
        w = r.get("whole_validation")
        return f"{w['val_bpb']:.3f}" if w else "—"

    for r in sorted(results, key=lambda r: (r["context"], r["final_val_bpb"] or 9)):
        rel = base.get(r["context"])
        ratio = "" if rel is None else f"{r['tokens_per_second'] / rel:.2f}×"
        cut = [e for e in r["history"] if e["seconds"] <= shortest[r["context"]] * 1.001]
        at_time = f"{cut[-1]['val_bpb']:.3f} (step {cut[-1]['step']})" if cut else "—"
        where = "" if r.get("device", "cpu") == "cpu" else f" ({r['device']})"
        gpu = "" if r.get("peak_gpu_mib") is None else f" (GPU {r['peak_gpu_mib']:.0f})"
        lines.append(f"| {r['variant']}{where} | {r['context']} | {r['params']:,} | "
                     f"{r['steps']} | {r['train_seconds']:.0f} | {whole(r)} | "
                     f"{r['final_val_bpb']:.3f} | {at_time} | "
                     f"{r['tokens_per_second']:.0f} | {ratio} | {r['peak_rss_mib']:.0f}{gpu} |")
    written = [out / "lm_results.md"]
    written[0].write_text("\n".join(lines) + "\n")
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for r in results:
        h = r["history"]
        ax.plot([e["seconds"] for e in h], [e["val_bpb"] for e in h],
                label=f"{r['variant']} (T={r['context']})")
    ax.set_xscale("log")  # the variants' speeds span two orders of magnitude
    ax.set_xlabel("training time (s, log scale)")
    ax.set_ylabel("validation bits per byte")
    ax.set_title("byte-level LM on the Python standard library")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside, not over, the curves
    fig.tight_layout()
    written.append(out / "lm_val_bpb.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)
    extrapolated = [r for r in results if r.get("by_length")]
    if extrapolated:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for r in extrapolated:
            pts = sorted(r["by_length"], key=lambda e: e["context"])
            ax.plot([e["context"] for e in pts], [e["val_bpb"] for e in pts], marker="o",
                    label=f"{r['variant']} (trained at {r['context']})")
        ax.axvline(extrapolated[0]["context"], color="grey", lw=0.8, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("evaluation window (bytes, log scale); dotted: the training length")
        ax.set_ylabel("validation bits per byte")
        ax.set_title("reading beyond the training length")
        ax.legend(fontsize=8)
        fig.tight_layout()
        written.append(out / "lm_extrapolation.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    expanding = [(r, e) for r in results for e in r["heads"] if "prior_pmf" in e]
    if expanding:
        heads = len(expanding[0][1]["a"])
        fig, axes = plt.subplots(len(expanding), heads, figsize=(3.2 * heads, 2.6 * len(expanding)),
                                 squeeze=False)
        for row, (r, e) in enumerate(expanding):
            for k in range(heads):
                ax = axes[row, k]
                pmf = e["prior_pmf"][k]
                ax.semilogy(range(1, len(pmf) + 1), pmf, label="learned prior")
                att = e["attention_by_distance"][k]
                ax.semilogy(range(len(att)), [max(v, 1e-8) for v in att], label="attention mass")
                ax.set_title(f"{r['variant']} T={r['context']} layer {e['layer']} head {k}\n"
                             f"a={e['a'][k]:.2f} b={e['b'][k]:.2f} mean "
                             f"{e['prior_mean_distance'][k]:.1f}", fontsize=8)
                ax.set_xlabel("distance")
        axes[0, 0].legend(fontsize=7)
        fig.tight_layout()
        written.append(out / "lm_expanding_priors.png")
        fig.savefig(written[-1], dpi=100)
        plt.close(fig)
    return [str(p) for p in written]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--attention", nargs="+", default=["causal"], choices=ATTENTIONS)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--window", type=int, default=64, help="sliding window, relative clip")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--minutes", type=float, default=None, help="training-time budget")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-windows", type=int, default=32,
                   help="validation windows sampled for the curve during training")
    p.add_argument("--final-eval", choices=["whole", "windows"], default="whole",
                   help="the final figure: every validation byte (default) or the windows")
    p.add_argument("--eval-lengths", type=int, nargs="*", default=None, metavar="N",
                   help="also read the trained model in windows of these lengths (length "
                        "extrapolation: e.g. 512 2048 8192)")
    p.add_argument("--eval-bytes", type=int, default=None,
                   help="the first N validation bytes for --eval-lengths (default: all)")
    p.add_argument("--save-every", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--text", help="train on this text file instead of the standard library")
    p.add_argument("--corpus", nargs="?", const=str(lm_corpus.CORPUS_FILE), metavar="PATH",
                   help="train on the corpus file --write-corpus wrote (default path: "
                        "gallery/corpus/stdlib.corpus.gz)")
    p.add_argument("--write-corpus", nargs="?", const=str(lm_corpus.CORPUS_FILE),
                   metavar="PATH", help="write the corpus built here to PATH and stop")
    p.add_argument("--any-corpus", action="store_true",
                   help="train on a corpus that is not the LM table's (its hash differs)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="float32 (default) or bfloat16: torch.autocast on the device")
    p.add_argument("--max-files", type=int, default=None, help="the first N files only")
    p.add_argument("--resume", action="store_true", help="continue from DIR/<variant>/checkpoint.pt")
    p.add_argument("--stop-after", type=int, default=None,
                   help="stop after this many steps of the --steps schedule (then --resume)")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "output", "lm"))
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cpu",
                   help="where the model trains: cpu (default) or cuda (one GPU; under torchrun, "
                        "cpu only)")
    args = p.parse_args(argv)
    if args.device != "cpu" and not (args.device.startswith("cuda") and
                                     torch.cuda.is_available()):
        p.error(f"--device {args.device}: no CUDA device here (torch.cuda.is_available() is "
                f"False); train on --device cpu")
    if args.device != "cpu" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        p.error("--device cuda trains on one GPU; under torchrun, train on --device cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        return report(out)
    rank, world = distributed()
    say = print if rank == 0 else (lambda *a, **k: None)
    if args.text and (args.corpus or args.write_corpus):
        p.error("--text trains on a text file; --corpus and --write-corpus are the standard "
                "library's corpus: give one or the other")
    if args.corpus and args.max_files:
        p.error(f"--max-files {args.max_files}: builds a corpus from this Python's standard "
                f"library; --corpus reads a whole one: give one or the other")
    try:
        data = (text_corpus(args.text) if args.text else lm_corpus.read_corpus(args.corpus)
                if args.corpus else stdlib_corpus(max_files=args.max_files))
    except (OSError, ValueError) as err:
        p.error(str(err))
    manifest = data[2]
    digest = manifest["corpus_sha256"]
    if args.write_corpus:
        lm_corpus.write_corpus(args.write_corpus, *data)
        say(f"wrote {args.write_corpus}: {manifest['files']} files, "
            f"{manifest['train_bytes']:,} train / {manifest['validation_bytes']:,} validation "
            f"bytes, corpus sha256 {digest}"
            + (" (the LM table's)" if digest == lm_corpus.CORPUS_SHA256 else
               f" (not the LM table's, {lm_corpus.CORPUS_SHA256[:16]}…)"))
        return args.write_corpus
    if not args.text and digest != lm_corpus.CORPUS_SHA256 and not args.any_corpus:
        raise SystemExit(f"train_lm.py: the corpus's sha256 is {digest[:16]}…, not the LM table's "
                         f"{lm_corpus.CORPUS_SHA256[:16]}… (Python 3.11.7's standard library): "
                         f"give --corpus PATH (written there by --write-corpus), or --any-corpus "
                         f"to train on this one")
    if rank == 0:
        (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    say(f"corpus: {manifest['files']} files, {manifest['train_bytes']:,} train / "
        f"{manifest['validation_bytes']:,} validation bytes, sha256 {digest[:16]}, "
        f"world size {world}")
    anchors = compression_anchors(data[1]) if args.final_eval == "whole" else None
    if anchors:
        say("compressors on the validation bytes: " + ", ".join(
            f"{k} {v:.3f} bits/byte" for k, v in anchors.items()))
    results = []
    for variant in args.attention:
        folder = out / f"{variant}_T{args.context}"
        folder.mkdir(exist_ok=True)
        r = train(args, variant, data, folder, log=say, anchors=anchors)
        results.append(r)
        whole = r["whole_validation"]
        say(f"[{variant}] T={args.context}: {r['steps']} steps, {r['train_seconds']:.1f} s, "
            f"val {r['final_val_bpb']:.3f} bits/byte on the sampled windows"
            + ("" if whole is None else f", {whole['val_bpb']:.3f} on every validation byte")
            + f", {r['tokens_per_second']:.0f} tokens/s, peak RSS {r['peak_rss_mib']:.0f} MiB, "
            f"{r['params']:,} parameters")
    if rank == 0:
        for path in report(out):
            print("wrote", path)
    if world > 1:
        torch.distributed.barrier()
    return results


if __name__ == "__main__":
    main()
