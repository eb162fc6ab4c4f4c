"""The LM's anchors (gallery/lm_anchors.py): interpolated Kneser–Ney byte n-grams, vectorised,
against the same estimator written out with dictionaries over a small corpus."""

import collections
import math
import pathlib
import sys

import numpy as np
import pytest

GALLERY = pathlib.Path(__file__).resolve().parents[1] / "gallery"


@pytest.fixture(scope="module")
def anchors():
    sys.path.insert(0, str(GALLERY))
    import lm_anchors
    return lm_anchors


def kn_written_out(train: bytes, order: int, text: bytes) -> float:
    """Interpolated Kneser–Ney as the module states it, one dictionary per order."""
    counts = {}
    for k in range(1, order + 1):
        grams = collections.Counter(train[i:i + k] for i in range(len(train) - k + 1))
        if k < order:  # continuation counts: distinct left extensions
            longer = {train[i:i + k + 1] for i in range(len(train) - k)}
            grams = collections.Counter(g[1:] for g in longer)
        n1 = sum(1 for v in grams.values() if v == 1)
        n2 = sum(1 for v in grams.values() if v == 2)
        d = n1 / (n1 + 2 * n2) if n1 + n2 else 0.5
        total, kinds = collections.Counter(), collections.Counter()
        for g, v in grams.items():
            total[g[:-1]] += v
            kinds[g[:-1]] += 1
        counts[k] = (grams, total, kinds, d)

    def prob(history: bytes, w: int) -> float:
        p = 1 / 256
        for k in range(1, order + 1):
            if len(history) < k - 1:
                break
            h = history[len(history) - (k - 1):] if k > 1 else b""
            grams, total, kinds, d = counts[k]
            if total[h] > 0:
                p = (max(grams[h + bytes([w])] - d, 0) + d * kinds[h] * p) / total[h]
        return p

    bits = [-math.log2(prob(text[:t], text[t])) for t in range(1, len(text))]
    return sum(bits) / len(bits)


@pytest.mark.parametrize("order", [1, 2, 3, 5])
def test_kneser_ney_equals_the_estimator_written_out(anchors, order):
    source = (GALLERY / "train_lm.py").read_bytes()
    train, text = source[:6000], source[6000:7500]
    want = kn_written_out(train, order, text)
    got = anchors.KneserNey(np.frombuffer(train, dtype=np.uint8), order).bits(
        np.frombuffer(text, dtype=np.uint8))
    assert got == pytest.approx(want, rel=1e-12)


def test_higher_orders_predict_text_better_and_bad_orders_are_refused(anchors):
    source = np.frombuffer((GALLERY / "train_lm.py").read_bytes(), dtype=np.uint8)
    train, text = source[:20000], source[20000:24000]
    bpb = [anchors.KneserNey(train, k).bits(text) for k in (1, 3)]
    assert bpb[1] < bpb[0] < 8
    with pytest.raises(ValueError, match=r"order must be in 1..7"):
        anchors.KneserNey(train, 8)
