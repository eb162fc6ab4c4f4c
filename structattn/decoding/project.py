"""The new tokens' queries, keys and values per head, as the full forward computes them at
their positions: ``project`` (absolute positions added, rotary ones applied) and ``rotated``."""

from __future__ import annotations

import torch.nn.functional as F

from ..heads import split_heads
from ..potentials import Rotary


def project(model, x, pos):
    """Queries and keys (on x + e at the tokens' positions, for absolute positions; rotated
    at their positions, for rotary ones) and values, per head."""
    H = model.heads
    xk = x
    e = getattr(model, "positions", None)
    if e is not None:
        xk = x + e[pos.clamp(max=e.shape[0] - 1)]
    q = split_heads(F.linear(xk, model.W_q), H)
    key = split_heads(F.linear(xk, model.W_k), H)
    value = split_heads(F.linear(x, model.W_v), H)
    q, key = rotated(model, q, key, pos)
    return q, key, value


def rotated(model, q, key, pos):
    """Queries and keys ``(B, H, k, d_k)`` rotated at their positions ``pos (B, k)``, for
    rotary positions (else as they are)."""
    if model.rope_base is None:
        return q, key
    H = model.heads
    rot = Rotary(model.W_q, model.W_k, heads=H, base=model.rope_base, dims=model.rope_dims)
    B, _, k, _ = q.shape
    flat = pos.reshape(-1)  # (B·k,): rotate every token at its own position

    def turn(t):
        t = rot.rotate(t.transpose(0, 1).reshape(H, B * k, -1), flat)
        return t.reshape(H, B, k, -1).transpose(0, 1)
    return turn(q), turn(key)
