"""structattn inside Hugging Face transformers against stock transformers, on the same config.

Three measurements, float32, one model size (vocab 256, hidden 256, MLP 688, 4 layers, 4 heads
of 64; ``--quick``: a tiny one):

- **training step** (forward with labels, backward, AdamW), batch 4 × 512 tokens: a stock
  ``LlamaForCausalLM`` (``attn_implementation="sdpa"``) against ``convert(stock,
  "self_attention")`` — the same function (uniform causal prior, RoPE as the potential);
  target ≤ 1.05×;
- **generate()**: 600 new tokens, greedy, batch 1 after a 16-token prompt, under ``no_grad``:
  stock with its ``DynamicCache`` against the converted model with its growing
  ``StructAttnCache`` (and with ``StructAttnCache(capacity=…)``, StaticCache's role); the
  tokens are checked equal first; target ≤ 1.2×;
- **a long generation's memory**: 4,096 new tokens (``--quick``: 256) from a FoX model
  (``StructAttnForCausalLM``, default gate) with the certified cache (``tol=1e-4``) against
  stock's ``DynamicCache``: tokens held per layer and the cache's bytes as it goes.

Timing: the two run interleaved (order reversed each round), medians over rounds and the
median of the per-round ratios. Run: ``python benchmarks/bench_transformers.py [--quick]
[--rounds N] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import transformers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import _results  # noqa: E402  (this script's own folder)

from structattn.integrations.transformers import (  # noqa: E402
    StructAttnCache,
    StructAttnConfig,
    StructAttnForCausalLM,
    convert,
)

SIZES = {"full": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                      num_attention_heads=4, batch=4, context=512, new=600, long=4096),
         "quick": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2, batch=2, context=32, new=16, long=256)}


def stock_model(size) -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=size["hidden_size"],
        intermediate_size=size["intermediate_size"], num_hidden_layers=size["num_hidden_layers"],
        num_attention_heads=size["num_attention_heads"], max_position_embeddings=8192)
    return transformers.LlamaForCausalLM(config).float()


def paired(first, second, rounds: int) -> dict:
    """Median seconds of each and the median per-round ratio second / first."""
    a, b = [], []
    for r in range(rounds):
        order = ((first, a), (second, b)) if r % 2 == 0 else ((second, b), (first, a))
        for fn, times in order:
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return {"stock_s": statistics.median(a), "structattn_s": statistics.median(b),
            "ratio": statistics.median(y / x for x, y in zip(a, b, strict=True))}


def training_step(size, rounds) -> dict:
    torch.manual_seed(0)
    stock = stock_model(size).train()
    stock.set_attn_implementation("sdpa")
    ours = convert(stock, "self_attention").train()
    ids = torch.randint(0, 256, (size["batch"], size["context"]))

    def step(model, optimiser):
        def run():
            optimiser.zero_grad(set_to_none=True)
            model(ids, labels=ids).loss.backward()
            optimiser.step()
        return run

    with torch.no_grad():
        gap = (stock(ids).logits - ours(ids).logits).abs().max().item()
    runs = [step(m, torch.optim.AdamW(m.parameters(), lr=1e-4)) for m in (stock, ours)]
    for run in runs:  # warm-up: the plans, the optimiser's state
        run(), run()
    return {"batch": size["batch"], "tokens": size["context"], "largest_logit_gap": gap,
            **paired(*runs, rounds)}


def generation(size, rounds) -> dict:
    torch.manual_seed(0)
    stock = stock_model(size).eval()
    stock.set_attn_implementation("sdpa")
    ours = convert(stock, "self_attention")
    prompt = torch.randint(0, 256, (1, 16))
    new = size["new"]
    options = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)

    def generate(model, cache=None):
        def run():
            with torch.no_grad():
                return model.generate(prompt, **options,
                                      **({} if cache is None else {"cache": cache()}))
        return run

    fixed = generate(ours, lambda: StructAttnCache(ours.config, capacity=16 + new))
    same = torch.equal(generate(stock)(), generate(ours)()) and torch.equal(generate(stock)(),
                                                                           fixed())
    return {"new_tokens": new, "same_tokens": same,
            "growing": paired(generate(stock), generate(ours), rounds),
            "capacity": paired(generate(stock), fixed, rounds)}


def cache_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def long_generation(size) -> dict:
    """Tokens held and cache bytes along a long generation: FoX's certified cache vs stock."""
    torch.manual_seed(0)
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    fox = StructAttnForCausalLM(StructAttnConfig(vocab_size=256, attention="forgetting_attention",
                                                 **{k: size[k] for k in keys})).eval()
    stock = stock_model(size).eval()
    total, rows = size["long"], []
    checkpoints = {total // 4, total // 2, total}
    fox_cache = StructAttnCache(fox.config, tol=1e-4)
    stock_cache = transformers.DynamicCache(config=stock.config)
    token = torch.randint(0, 256, (1, 1))
    start = time.perf_counter()
    with torch.no_grad():
        for t in range(1, total + 1):
            following = fox(token, cache=fox_cache, use_cache=True).logits[:, -1:].argmax(-1)
            stock(token, cache=stock_cache, use_cache=True)
            token = following
            if t in checkpoints:
                decode = fox_cache.decode_caches()
                rows.append({"generated": t, "fox_held": fox_cache.held()[0],
                             "fox_evicted": fox_cache.evicted[0], "fox_bound": fox_cache.bound,
                             "fox_certified": fox_cache.certified,
                             "fox_cache_mib": cache_bytes(
                                 [c.keys for c in decode] + [c.values for c in decode]
                                 + [c.state for c in decode]) / 2**20,
                             "stock_held": stock_cache.get_seq_length(),
                             "stock_cache_mib": cache_bytes(
                                 [layer.keys for layer in stock_cache.layers]
                                 + [layer.values for layer in stock_cache.layers]) / 2**20})
                print(rows[-1], flush=True)
    return {"tol": 1e-4, "seconds": time.perf_counter() - start, "rows": rows}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    size = SIZES["quick" if args.quick else "full"]
    rounds = args.rounds or (1 if args.quick else 5)
    torch.set_num_threads(os.cpu_count() or 1)
    results = {"transformers": transformers.__version__, "size": size}
    results["training_step"] = training_step(size, rounds)
    print("training step", results["training_step"], flush=True)
    results["generate"] = generation(size, rounds)
    print("generate", results["generate"], flush=True)
    results["long_generation"] = long_generation(size)
    _results.save("transformers", results, args.json, quick=args.quick)


if __name__ == "__main__":
    main()
