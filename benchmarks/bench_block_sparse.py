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

``--synthetic``: instead, the inputs where the bounds are hard — ALiBi and FoX layers
(d_model = 64, 4 heads, d_k = 16) with W_q × 10 (sharp queries), on N (default 4,096) i.i.d.
N(0, 1) tokens or the same plus a mean that drifts along the sequence (twice an AR(1)
sequence, correlation 0.999 a step), the last token's match planted 3/4 of the sequence back;
and the uniform causal prior on the ALiBi layer's factors. Per prior and input kind: the
fraction of (child block, earlier key block) pairs the certificate skips
(``certify_blocks``), against the oracle's (per child block, the earlier key blocks in
increasing order of their largest true float64 posterior mass, skipped while every child's
skipped mass stays ≤ ε); the largest true mass skipped; the layer's own skip (a head reading
over half its past reads all of it); the certificate's CPU seconds and the layer's forward +
backward CPU seconds, and the same layer's reading all of the past (no ``tol``) (one thread,
median of ``--rounds``). Writes
``results/block_sparse_synthetic.json``.
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


def tokens(kind: str, n: int, d: int, gen) -> torch.Tensor:
    """``(N, d)`` i.i.d. N(0, 1) tokens, or (``"drifting"``) the same plus a drifting mean."""
    x = torch.randn(n, d, generator=gen)
    if kind == "drifting":
        rho = 0.999
        mean = torch.empty(n, d)
        mean[0] = torch.randn(d, generator=gen)
        step = torch.randn(n, d, generator=gen) * math.sqrt(1 - rho ** 2)
        for t in range(1, n):
            mean[t] = rho * mean[t - 1] + step[t]
        x = x + 2 * mean
    return x


def sharp_layer(prior: str, kind: str, n: int, seed: int = 0):
    """``(layer, x, (a, b, scale, h))``: a float32 ALiBi or FoX layer with W_q × 10 and its
    tokens (the last one's match planted 3/4 back), and its per-head factors and h."""
    import structattn as sa
    from structattn.priors import ALiBi, ForgettingGate

    torch.manual_seed(seed)
    make = sa.models.forgetting_attention if prior == "forget" else sa.models.alibi_attention
    m = make(64, heads=4, d_k=16, tol=1e-4, certificate="blocks")
    with torch.no_grad():
        m.W_q.mul_(10)
        x = tokens(kind, n, 64, torch.Generator().manual_seed(seed))
        x[n - 1 - (3 * n) // 4] = torch.linalg.solve(m.W_k, 0.3 * m.W_q @ x[-1])
        a, b = (F.linear(x, W).unflatten(-1, (4, 16)).movedim(-2, 0) for W in (m.W_q, m.W_k))
        h = (ForgettingGate(m.log_gates(x)) if prior == "forget" else ALiBi(4, causal=True)
             ).terms(n, n, x.device)[1].float() if prior != "uniform" else None
    return m, x, (a.contiguous(), b.contiguous(), 0.25, h)


def oracle_skip(p: torch.Tensor, L: int, eps: float) -> float:
    """The oracle's fraction of (child block, earlier key block) pairs skipped, from the true
    posterior ``p`` ``(H, N, N)`` (module docstring)."""
    H, n, _ = p.shape
    nb = n // L
    skipped = total = 0
    for g in range(H):
        mass = p[g].view(n, nb, L).sum(-1)
        for c in range(1, nb):
            rows = mass[c * L:(c + 1) * L, :c]
            fits = (rows[:, rows.amax(0).argsort()].cumsum(-1) <= eps).all(0)
            skipped += int(fits.long().cumprod(0).sum())
            total += c
    return skipped / total


def cpu_seconds(fn, rounds):
    """The median CPU time of ``fn()`` over ``rounds`` calls."""
    times = []
    for _ in range(rounds):
        t = time.process_time()
        fn()
        times.append(time.process_time() - t)
    return sorted(times)[len(times) // 2]


def synthetic(args):
    """The ``--synthetic`` rows (module docstring)."""
    import structattn as sa
    from structattn.block_sparse import causal_posterior, certify_blocks

    torch.set_num_threads(1)
    n = 512 if args.quick else args.n or 4096
    print(f"torch {torch.__version__}, 1 thread; N = {n:,}, ε = {args.eps}, blocks of "
          f"{args.block}, d_model = 64, 4 heads, d_k = 16, W_q × 10, a match planted "
          f"{(3 * n) // 4} back")
    rows = []
    for prior in ("alibi", "forget", "uniform"):
        for kind in ("iid", "drifting"):
            m, x, (a, b, scale, h) = sharp_layer(prior, kind, n)
            cert = certify_blocks(a, b, scale, h, args.eps, block=args.block)
            t_cert = cpu_seconds(lambda a=a, b=b, h=h, scale=scale: certify_blocks(
                a, b, scale, h, args.eps, block=args.block), args.rounds)
            p = causal_posterior(a.double(), b.double(), scale,
                                 torch.zeros(n, dtype=torch.float64) if h is None
                                 else h.double())
            blk = torch.arange(n) // cert.block
            lost = float((p * ~cert.read[..., blk, :][..., blk]).sum(-1).max())
            row = {"prior": prior, "inputs": kind, "n": n, "skipped": cert.skipped,
                   "oracle": oracle_skip(p, cert.block, args.eps), "largest_skipped_mass": lost,
                   "certificate_cpu_s": t_cert}
            row["of_oracle"] = row["skipped"] / row["oracle"] if row["oracle"] else None
            if prior != "uniform":
                layer = sa.compile(m)

                def step(layer=layer, x=x, report=row, name=m.family_name):
                    xx = x[None].clone().requires_grad_()
                    y, trace = layer(xx, return_trace=True)
                    y.sum().backward()
                    report["layer_skipped"] = trace.truncation[name].skipped

                row["layer_fwd_bwd_cpu_s"] = cpu_seconds(step, args.rounds)
                m.tol, m.certificate = None, "window"  # the whole past, the fused reading
                whole = sa.compile(m)

                def past(whole=whole, x=x):
                    whole(x[None].clone().requires_grad_()).sum().backward()

                row["whole_past_fwd_bwd_cpu_s"] = cpu_seconds(past, args.rounds)
            rows.append(row)
            ratio = "—" if row["of_oracle"] is None else f"{100 * row['of_oracle']:.0f}%"
            print(f"{prior:8s} {kind:9s} skipped {100 * row['skipped']:5.1f}% of the key blocks, "
                  f"the oracle {100 * row['oracle']:5.1f}% ({ratio}); largest true mass skipped "
                  f"{lost:.1e}; certificate {t_cert:.2f} s"
                  + (f"; layer skipped {100 * row['layer_skipped']:.1f}%, forward+backward "
                     f"{row['layer_fwd_bwd_cpu_s']:.2f} s (the whole past "
                     f"{row['whole_past_fwd_bwd_cpu_s']:.2f} s)" if "layer_skipped" in row
                     else ""),
                  flush=True)
    _results.save("block_sparse_synthetic", {"eps": args.eps, "block": args.block, "rows": rows},
                  args.json, quick=args.quick)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, help="tokens per sequence (16,384 bytes; --synthetic: 4,096)")
    p.add_argument("--eps", type=float, default=1e-4)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--checkpoint", help="a causal ByteLM's checkpoint.pt (train_lm.py)")
    p.add_argument("--steps", type=int, default=1000, help="training steps without a checkpoint")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="tiny model and sequence (smoke test)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--synthetic", action="store_true",
                   help="sharp queries on i.i.d. and drifting tokens, against the oracle")
    args = p.parse_args(argv)
    if args.synthetic:
        return synthetic(args)
    d_model, layers, heads = (32, 1, 2) if args.quick else (128, 2, 4)
    n = 512 if args.quick else args.n or 16384
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
