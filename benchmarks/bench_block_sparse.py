"""Certified block-sparse causal attention on real text activations, against causal SDPA.

The queries, keys and values are those of a trained byte-level language model
(``gallery/train_lm.py``, variant ``causal``: softmax attention over the whole past, no prior,
no positions), read from each layer on N consecutive bytes of the Python standard library's
own source (its validation split). Per layer, forward+backward:

- ``causal SDPA``: ``scaled_dot_product_attention(is_causal=True)`` on those q, k, v;
- ``block-sparse``: ``structattn.block_sparse.block_sparse_attention`` with the uniform causal
  prior at ε (default 1e-4): the key blocks each block of children reads, certified to leave
  out ≤ ε of every child's posterior mass.

Printed: the time of each, their ratio, the fraction of (child block, earlier key block)
pairs skipped, the largest certified bound, and the largest difference between the two
outputs. Without ``--checkpoint`` the model is trained first (``--steps`` steps at context
512, about 2.5 minutes on two cores). Run:
``python benchmarks/bench_block_sparse.py [--n 16384] [--checkpoint PATH] [--quick]``.
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "gallery"))

import _results  # noqa: E402


def trained_model(checkpoint: str | None, steps: int, d_model: int, layers: int, heads: int):
    """A causal ByteLM from ``checkpoint``, or trained now (train_lm.py's own loop)."""
    import train_lm

    if checkpoint is None:
        out = tempfile.mkdtemp(prefix="structattn-lm-")
        subprocess.run([sys.executable, str(HERE.parent / "gallery" / "train_lm.py"),
                        "--attention", "causal", "--steps", str(steps), "--context", "512",
                        "--d-model", str(d_model), "--layers", str(layers), "--heads", str(heads),
                        "--final-eval", "windows", "--eval-every", str(steps),
                        "--out", out], check=True)
        checkpoint = os.path.join(out, "causal_T512", "checkpoint.pt")
    model = train_lm.ByteLM(d_model, layers, heads, "causal")
    model.load_state_dict(torch.load(checkpoint, weights_only=True)["model"])
    return model.eval(), train_lm


@torch.no_grad()
def activations(model, tokens: torch.Tensor) -> list:
    """Per layer, the attention's ``(q, k, v)`` ``(H, N, d_k)`` and its scale, on ``tokens``."""
    import structattn as sa

    found = []
    x = model.embed(tokens[None])
    for block in model.blocks:
        decl = block.declaration
        h = block.ln1(x)
        q, k, v = (sa.split_heads(F.linear(h, W), decl.heads)[0].contiguous()
                   for W in (decl.W_q, decl.W_k, decl.W_v))
        tau = decl.temperature  # None: √d_k
        found.append((q, k, v, 1 / (math.sqrt(decl.d_k) if tau is None else float(tau))))
        x = block(x)
    return found


def timed(fn, rounds):
    best = math.inf
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=16384, help="tokens (bytes) per sequence")
    p.add_argument("--eps", type=float, default=1e-4)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--checkpoint", help="a causal ByteLM's checkpoint.pt (train_lm.py)")
    p.add_argument("--steps", type=int, default=1000, help="training steps without a checkpoint")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="tiny model and sequence (smoke test)")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    d_model, layers, heads = (32, 1, 2) if args.quick else (128, 2, 4)
    n = 512 if args.quick else args.n
    steps = 3 if args.quick else args.steps
    model, train_lm = trained_model(args.checkpoint, steps, d_model, layers, heads)
    _, val, _ = train_lm.stdlib_corpus(max_files=40 if args.quick else None)
    tokens = val[:n].long()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; causal ByteLM "
          f"d_model={d_model}, {layers} layers, {heads} heads; N = {len(tokens):,} bytes of the "
          f"standard library's validation split; ε = {args.eps}, blocks of {args.block}")
    from structattn.block_sparse import block_sparse_attention

    rows = []
    for layer, (q, k, v, scale) in enumerate(activations(model, tokens)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]

        def sdpa(leaves=leaves, scale=scale):  # (1, H, N, d): the CPU's flash kernel
            F.scaled_dot_product_attention(*(t[None] for t in leaves), is_causal=True,
                                           scale=scale).sum().backward()

        report = {}

        def sparse(leaves=leaves, scale=scale, report=report):
            out, cert = block_sparse_attention(*leaves, scale, None, args.eps, block=args.block)
            out.sum().backward()
            report["cert"] = cert

        t_sdpa, t_sparse = timed(sdpa, args.rounds), timed(sparse, args.rounds)
        with torch.no_grad():
            want = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True,
                                                  scale=scale)[0]
            got, _ = block_sparse_attention(q, k, v, scale, None, args.eps, block=args.block)
        cert = report["cert"]
        row = {"layer": layer, "n": len(tokens), "sdpa_s": t_sdpa, "block_sparse_s": t_sparse,
               "ratio": t_sparse / t_sdpa, "skipped": cert.skipped,
               "largest_bound": float(cert.bound.max()),
               "largest_difference": float((got - want).abs().max())}
        rows.append(row)
        print(f"layer {layer}: causal SDPA {t_sdpa:.3f} s, block-sparse {t_sparse:.3f} s "
              f"({row['ratio']:.2f}×), {100 * cert.skipped:.1f}% of the key blocks skipped, "
              f"largest bound {row['largest_bound']:.1e}, largest difference "
              f"{row['largest_difference']:.1e}", flush=True)
    _results.save("block_sparse", {"eps": args.eps, "block": args.block, "rows": rows},
                  args.json, quick=args.quick)


if __name__ == "__main__":
    main()
