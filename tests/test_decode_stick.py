"""Stick-breaking's cached step reads its keys from the newest backwards and stops once the
stick left is below the dtype's precision (``structattn.decoding.stick``): the outputs are
still the full forward's (float64, 1e-10), and where the stick is spent early it reads fewer
keys (``cache.keys_read``)."""

import pytest
import torch

import structattn as sa
from structattn.decoding import stick


def _layer(sharp: float, d=6):
    """Stick-breaking attention whose break logits are ``sharp`` times x_i·x_j (one head,
    W_q = W_k = 1): with x positive and large ``sharp``, each token breaks on its newest
    parent and the stick is spent after it."""
    model = sa.models.stick_breaking_attention(d, heads=1, d_k=d, dtype=torch.float64)
    with torch.no_grad():
        model.W_q.copy_(torch.eye(d, dtype=torch.float64) * sharp ** 0.5)
        model.W_k.copy_(torch.eye(d, dtype=torch.float64) * sharp ** 0.5)
    return sa.compile(model)


def _decode(layer, x, prefill):
    cache = layer.new_cache()
    ys, posts, read = [], [], []
    with torch.no_grad():
        y, p = layer(x[:, :prefill], cache=cache, return_posterior=True)
        ys.append(y)
        posts.append(p)
        for t in range(prefill, x.shape[1]):
            y, p = layer(x[:, t:t + 1], cache=cache, return_posterior=True)
            ys.append(y)
            posts.append(p)
            read.append(cache.keys_read)
    return torch.cat(ys, 1), posts, read


@pytest.mark.parametrize("block", [4, 7, None])
def test_a_spent_stick_stops_the_reading_and_the_outputs_are_the_full_forwards(block,
                                                                             monkeypatch):
    """x positive, break logits ≥ 40: a row's stick left after its newest parent is
    σ(−40) ≈ 4e-18 < ε(float64), so each step reads one block (``BLOCK`` keys) of its 30+."""
    if block is not None:
        monkeypatch.setattr(stick, "BLOCK", block)
    size = stick.BLOCK
    N = 3 * size + 5
    layer = _layer(sharp=40.0)
    x = torch.rand(1, N, 6, dtype=torch.float64) + 1.0  # x_i·x_j ≥ 6: ψ ≥ 240
    y, posts, read = _decode(layer, x, prefill=2 * size + 1)
    full, post = layer(x, return_posterior=True)
    torch.testing.assert_close(y, full, rtol=0, atol=1e-10)
    assert read == [size] * (N - 2 * size - 1)  # one block, of 2·BLOCK + 1 and more keys
    for t, p in zip(range(2 * size + 1, N), posts[1:], strict=True):
        torch.testing.assert_close(p[0, :, 0], post[0, :, t, :t + 1], rtol=0, atol=1e-10)


def test_a_stick_left_over_reads_every_key(monkeypatch):
    """Break logits near 0: half the stick is left at each parent, ε is not reached within
    a block of 4, so the steps read on — and their outputs and posteriors are the full
    forward's."""
    monkeypatch.setattr(stick, "BLOCK", 4)
    layer = _layer(sharp=1e-3)
    x = torch.randn(2, 14, 6, dtype=torch.float64)
    y, posts, read = _decode(layer, x, prefill=5)
    assert read == list(range(6, 15))
    full, post = layer(x, return_posterior=True)
    torch.testing.assert_close(y, full, rtol=0, atol=1e-10)
    torch.testing.assert_close(posts[-1][:, :, 0], post[:, :, -1], rtol=0, atol=1e-10)


def test_ragged_rows_stop_only_once_every_row_has_spent_its_stick(monkeypatch):
    """Row 0's stick is spent at its newest parent, row 1's never is: the call reads row 1's
    every key, and both rows' outputs are their full forwards'."""
    monkeypatch.setattr(stick, "BLOCK", 3)
    layer = _layer(sharp=40.0)
    x = torch.rand(2, 12, 6, dtype=torch.float64) + 1.0
    x[1] = x[1] * 1e-3  # ψ ≈ 0 in row 1
    cache = layer.new_cache()
    with torch.no_grad():
        y0 = layer(x[:, :9], cache=cache, lengths=torch.tensor([9, 4]))
        x_new = torch.stack([x[0, 9:12], x[1, 4:7]])
        y1 = layer(x_new, cache=cache, lengths=torch.tensor([3, 2]))
    assert cache.keys_read == 12
    torch.testing.assert_close(torch.cat([y0[0], y1[0]]), layer(x[:1])[0], rtol=0, atol=1e-10)
    torch.testing.assert_close(y1[1, :2], layer(x[1:, :6])[0, 4:], rtol=0, atol=1e-10)
