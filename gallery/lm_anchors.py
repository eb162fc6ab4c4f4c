"""Anchors for the byte-level LM (``train_lm.py``): what the same validation bytes cost under
models that know nothing of attention — the general-purpose compressors zlib, bz2 and xz, and
byte n-grams with interpolated Kneser–Ney smoothing trained on the training split.

Interpolated Kneser–Ney, one absolute discount D per order (Chen & Goodman's estimate
D = n1 / (n1 + 2·n2) from the counts of n-grams seen once and twice), context h of k − 1 bytes:

    P_k(w | h) = max(c_k(h w) − D_k, 0) / c_k(h·) + D_k · N1+(h ·) / c_k(h·) · P_{k−1}(w | h'),

with h' the context without its oldest byte; c_k the raw counts at the highest order and the
continuation counts N1+(· h w) — how many distinct bytes precede h w — below it; a context
never seen falls through to the order below; order 0 is uniform over the 256 bytes. Counting
is vectorised over integer keys of the n-grams (``numpy.unique``), so order 5 over 30 MB runs
in seconds. Bits per byte are averaged over every validation byte (the first bytes' contexts
are shorter: they read the orders they have).

``--orders`` are n-gram orders n (a context of n − 1 bytes): the defaults 4 and 6 read 3 and 5
bytes of context. Run: ``python gallery/lm_anchors.py [--orders 4 6] [--out DIR]`` (the
standard library's source, split as ``train_lm.py`` splits it); writes
``DIR/lm_anchors.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib

import numpy as np


def _keys(data: np.ndarray, k: int) -> np.ndarray:
    """The k-gram ending at each position t ≥ k − 1 as one integer (oldest byte highest)."""
    keys = np.zeros(len(data) - k + 1, dtype=np.int64)
    for j in range(k):
        keys = keys * 256 + data[j:len(data) - k + 1 + j].astype(np.int64)
    return keys


def _count(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted distinct keys and their counts."""
    return np.unique(keys, return_counts=True)


def _lookup(table_keys: np.ndarray, table_values: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """``table[key]`` for each key (0 where absent), from a sorted key table."""
    at = np.searchsorted(table_keys, keys)
    at = np.minimum(at, len(table_keys) - 1)
    found = table_keys[at] == keys
    return np.where(found, table_values[at], 0)


class KneserNey:
    """Interpolated Kneser–Ney byte model of order ``order`` trained on ``data`` (uint8)."""

    def __init__(self, data: np.ndarray, order: int):
        if not 1 <= order <= 7:
            raise ValueError(f"KneserNey: order must be in 1..7 (keys are 64-bit); got {order}")
        self.order = order
        self.tables = []  # per order k = 1..n: (gram keys, counts, context keys, totals, types, D)
        grams = {k: _count(_keys(data, k)) for k in range(1, order + 1)}
        for k in range(1, order + 1):
            if k == order:  # raw counts at the highest order
                g_keys, g_counts = grams[k]
            else:  # continuation counts: distinct bytes before each k-gram
                longer = grams[k + 1][0]  # distinct (k+1)-grams
                g_keys, g_counts = _count(longer % (256 ** k))
            n1, n2 = np.sum(g_counts == 1), np.sum(g_counts == 2)
            discount = n1 / (n1 + 2 * n2) if n1 + n2 else 0.5
            ctx = g_keys // 256  # the context of each k-gram (k − 1 bytes)
            c_keys, first = np.unique(ctx, return_index=True)
            totals = np.add.reduceat(g_counts, first)
            types = np.diff(np.append(first, len(ctx)))  # distinct next bytes per context
            self.tables.append((g_keys, g_counts, c_keys, totals, types, float(discount)))

    def bits(self, data: np.ndarray) -> float:
        """Mean bits per byte over every byte of ``data`` after the first."""
        n = len(data)
        prob = np.full(n - 1, 1.0 / 256)  # order 0: uniform
        for k in range(1, self.order + 1):
            g_keys, g_counts, c_keys, totals, types, d = self.tables[k - 1]
            # positions t (predicting data[t]) whose k-gram (context of k − 1 bytes) fits
            start = k - 1  # the first target with k − 1 bytes of history is data[k − 1]
            if start >= n:
                break
            first_target = max(start, 1)
            keys = _keys(data[first_target - (k - 1):], k)  # k-grams ending at each target
            ctx = keys // 256
            c = _lookup(g_keys, g_counts, keys).astype(np.float64)
            total = _lookup(c_keys, totals, ctx).astype(np.float64)
            kinds = _lookup(c_keys, types, ctx).astype(np.float64)
            lower = prob[first_target - 1:]
            seen = total > 0
            mixed = np.where(seen, (np.maximum(c - d, 0) + d * kinds * lower)
                             / np.where(seen, total, 1.0), lower)
            prob[first_target - 1:] = mixed
        return float(-np.log2(prob).mean())


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--orders", type=int, nargs="+", default=[4, 6],
                   help="n-gram orders n (a context of n − 1 bytes)")
    p.add_argument("--max-files", type=int, default=None, help="the first N files only")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "output", "lm"))
    import train_lm

    train_lm.lm_corpus.add_corpus_argument(p)
    args = p.parse_args(argv)
    train, val, manifest = train_lm.lm_corpus.corpus_of(args, "lm_anchors")
    train_np, val_np = train.numpy(), val.numpy()
    result = {"manifest_sha256": manifest["sha256"], "validation_bytes": len(val_np),
              "compressors": train_lm.compression_anchors(val), "kneser_ney": {}}
    for order in args.orders:
        bpb = KneserNey(train_np, order).bits(val_np)
        result["kneser_ney"][str(order)] = bpb
        print(f"Kneser–Ney {order}-gram ({order - 1}-byte context): {bpb:.3f} bits/byte")
    for name, bpb in result["compressors"].items():
        print(f"{name}: {bpb:.3f} bits/byte")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lm_anchors.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()

