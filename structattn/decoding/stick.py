"""Stick-breaking's new rows read from the newest cached key backwards, stopping once the
stick left over is below what the dtype can represent.

p(φ_i = j) = σ(ψ_ij) R_ij with R_ij = Π_{j<l<i} σ(−ψ_il), the stick left once every parent
nearer than j has declined: R only shrinks as j moves back, and the parents not read yet hold
at most R of the mass between them. Once R < ε (``torch.finfo(dtype).eps``) on every new
row, what is not read moves the output by less than ε·max|v| — below the dtype's rounding
of the output — so the reading stops there. Every key stays cached: a later query may
decline the recent keys and reach back.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

#: how many cached keys are scored between two looks at the stick left (each look reads one
#: boolean on the host)
BLOCK = 128


def read_backwards(q, keys, scale, pos, valid, block: int | None = None):
    """``(post, read)``: p(φ_i = j) ``(B, H, k, P)`` for new rows ``q (B, H, k, d_k)`` over
    the cached ``keys (B, H, P, d_k)`` (zero where not read), and how many of the P keys were
    read, newest first. ``pos (B, k)``: the rows' positions; ``valid (B, k, P)``: the
    parents that are the row's tokens (a parent j is read by row i where j < pos_i too)."""
    block = BLOCK if block is None else block
    P = keys.shape[-2]
    parents = torch.arange(P, device=q.device)
    before = ((parents[None, None, :] < pos[:, :, None]) & valid).unsqueeze(1)  # (B, 1, k, P)
    # each row's stick left, as Σ softplus(ψ_il) = −log R over the parents read so far
    wide = torch.promote_types(q.dtype, torch.float32)
    spent = q.new_zeros(q.shape[:-1], dtype=wide)  # (B, H, k)
    enough = -math.log(torch.finfo(q.dtype).eps)  # R < ε ⇔ −log R > −log ε
    reaching = (valid.any(-1) & (pos > 0)).unsqueeze(1)  # (B, 1, k): rows with a parent
    post = q.new_zeros(*q.shape[:-1], P)
    hi = P
    while hi > 0:
        lo = max(0, hi - block)
        scores = (q @ keys[..., lo:hi, :].transpose(-1, -2)) * scale  # (B, H, k, b)
        allowed = before[..., lo:hi]
        # softplus(s) = −log σ(−s), exactly (as the full reading's ``stick_breaking_table``)
        sp = -F.logsigmoid(-scores).masked_fill(~allowed, 0.0)
        nearer = spent[..., None].to(sp.dtype) + sp.flip(-1).cumsum(-1).flip(-1)
        log_p = (scores - nearer).masked_fill(~allowed, float("-inf"))
        post[..., lo:hi] = log_p.exp()
        spent = spent + sp.sum(-1, dtype=wide)
        hi = lo
        if hi > 0 and bool(((spent > enough) | ~reaching).all()):
            break
    return post, P - hi
