"""The new tokens' queries, keys and values per head, as the full forward computes them at
their positions: ``project`` (absolute positions added, rotary ones applied) and ``rotated``.

A decoding step rotates one token per row at a time: its angles come from a table of
cos(p·θ_k), sin(p·θ_k) over the positions read so far (``_ANGLES``, per base, rotated
dimensions, device and dtype; grown by doubling), computed with the formula the full forward
uses (``potentials.Rotary``: p·θ_k in float64, then cos and sin, then the dtype), so a step's
rotation is the full forward's, bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..heads import split_heads
from ..potentials import Rotary
from ..potentials.rotary import rotary_angles, rotate_half

#: (base, dims, device, dtype) → (cos, sin), each ``(positions, dims)``
_ANGLES: dict = {}


def project(model, x, pos, upto: int | None = None):
    """Queries and keys (on x + e at the tokens' positions, for absolute positions; rotated
    at their positions, for rotary ones) and values, per head; ``upto``: a bound on the
    positions (> pos.max()), where the caller knows one."""
    H = model.heads
    xk = x
    e = getattr(model, "positions", None)
    if e is not None:
        xk = x + e[pos.clamp(max=e.shape[0] - 1)]
    q = split_heads(F.linear(xk, model.W_q), H)
    key = split_heads(F.linear(xk, model.W_k), H)
    value = split_heads(F.linear(x, model.W_v), H)
    q, key = rotated(model, q, key, pos, upto)
    return q, key, value


def rotated(model, q, key, pos, upto: int | None = None):
    """Queries and keys ``(B, H, k, d_k)`` rotated at their positions ``pos (B, k)``, for
    rotary positions (else as they are). With ``upto`` (> every position) the angles come
    from the table; without it (a recorded or compiled step: no host read of the positions)
    they are computed from ``pos``, as ``potentials.Rotary`` does."""
    if model.rope_base is None:
        return q, key
    if upto is None:
        return _rotated_from_positions(model, q, key, pos)
    dims = model.rope_dims or model.d_k
    cos, sin = _angles(model.rope_base, dims, upto, q)
    cos, sin = cos[pos][:, None], sin[pos][:, None]  # (B, 1, k, dims)
    return rotate_half(q, cos, sin, dims), rotate_half(key, cos, sin, dims)


def _rotated_from_positions(model, q, key, pos):
    H = model.heads
    rot = Rotary(model.W_q, model.W_k, heads=H, base=model.rope_base, dims=model.rope_dims)
    B, _, k, _ = q.shape
    flat = pos.reshape(-1)  # (B·k,): rotate every token at its own position

    def turn(t):
        t = rot.rotate(t.transpose(0, 1).reshape(H, B * k, -1), flat)
        return t.reshape(H, B, k, -1).transpose(0, 1)
    return turn(q), turn(key)


def _angles(base: float, dims: int, upto: int, like: torch.Tensor):
    """cos and sin ``(≥ upto, dims)`` of p·θ_k over the positions p (``rotary_angles``)."""
    dtype = torch.promote_types(like.dtype, torch.float32)
    key = (base, dims, like.device, dtype)
    held = _ANGLES.get(key)
    if held is None or held[0].shape[0] < upto:
        n = max(upto, 2 * (0 if held is None else held[0].shape[0]), 64)
        p = torch.arange(n, device=like.device, dtype=torch.float64)
        held = _ANGLES[key] = rotary_angles(p, base, dims, dtype)
    return held
