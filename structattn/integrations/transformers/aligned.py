"""A stationary prior read over already-projected q, k, v whose queries are the last keys.

``aligned_attention(q, k, v, prior)``: C queries over P ≥ C keys (a cache's past and the new
tokens), query i at position P − C + i among the keys — the last query is the last key —
reading the keys j ≤ P − C + i under the prior's log weight at the distance (P − C + i) − j:

    out_i = Σ_j softmax_j(scale·⟨q_i, k_j⟩ + ℓ_h((P − C + i) − j)) v_j.

The prior states ℓ as its table over the offsets (``Prior.log_at_offsets``, O(P) per head),
asked of the prior for the square P × P problem and re-indexed for the last C rows: the
distance-table kernel (``structattn.kinds.distance_table``: CPU, float32 and float64) looks it
up per tile of scores, never a C×P bias. Elsewhere (CUDA, half precision, no compiled
kernel), or with a mask that removes a pair the prior reads (padding), it is one
``scaled_dot_product_attention`` call with the C×P bias built from that table, the mask
intersected with it. A query left without a key gets a zero row, as the kernel gives.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...checking._validation import shape_str
from ...kinds import distance_table
from ...priors.base import Prior
from ...priors.tables import Offsets


def aligned_attention(query, key, value, prior, attention_mask=None, scale=None, *,
                      owner: str = "aligned_attention") -> torch.Tensor:
    """``(B, H, C, d_v)``: the C queries, the last C positions of the P keys, under ``prior``.

    Args:
        query: ``(B, H, C, d)``; key: ``(B, H_kv, P, d)``; value: ``(B, H_kv, P, d_v)``, with
            P ≥ C and H a multiple of H_kv (grouped queries: query head h reads key head
            h // (H / H_kv)).
        prior: a ``structattn.priors.Prior`` whose log weight is a function of i − j alone on
            j ≤ i or a window of the past (it states ``log_at_offsets``): ALiBi,
            ``RelativePosition``, ``GeneralisedGaussian``, any stationary ``DistancePrior``;
            its table has 1 or H rows.
        attention_mask: None, or a 4-D mask ``(B or 1, 1 or H, C, P)``: boolean (True: read)
            or additive; intersected with the prior's support.
        scale: the logits' scale; None: d^−1/2.
        owner: how errors name the caller.

    Raises:
        ValueError: naming the argument: shapes that disagree, C > P, a prior that is not
            stationary or not causal, or whose heads are not 1 or H, a mask of another
            shape, or one under which the last query does not read the last key in any row
            (a cache whose key buffer runs past its tokens, as a ``StaticCache``'s does).
    """
    B, H, C, P = _check_shapes(query, key, value, owner)
    stated = _offsets(prior, P, H, query.device, owner)
    shift = P - C  # query i is at position shift + i among the keys
    key, value = _grouped(key, H), _grouped(value, H)
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    mask = _mask(attention_mask, stated, B, H, C, P, owner)
    if mask is None and distance_table.applies(query, key, value):
        local = Offsets(stated.table, stated.lowest - shift, stated.lo - shift, stated.hi - shift)
        return distance_table.distance_table_attention(query, key, value, local, scale)
    bias = _bias(stated, shift, C, P, query)
    if mask is not None:
        bias = bias.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool \
            else bias + mask.to(query.dtype)
    bias = bias if bias.dim() == 4 else bias[None]
    empty = torch.isneginf(bias).all(-1, keepdim=True)  # a query with no key: a zero row
    out = F.scaled_dot_product_attention(query, key, value,
                                         attn_mask=bias.masked_fill(empty, 0.0), scale=scale)
    return out.masked_fill(empty, 0.0)


def _check_shapes(query, key, value, owner):
    """``(B, H, C, P)``, or a ValueError naming the tensor that disagrees."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or not t.is_floating_point():
            got = shape_str(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{owner}: {name} must be a floating-point tensor (batch, heads, "
                             f"tokens, head_dim); got {got}")
    B, H, C, d = query.shape
    Bk, Hkv, P, dk = key.shape
    if value.shape[:3] != key.shape[:3] or Bk != B or dk != d:
        raise ValueError(f"{owner}: query {shape_str(query.shape)}, key {shape_str(key.shape)} "
                         f"and value {shape_str(value.shape)} disagree: key and value must have the "
                         f"same (batch, heads, tokens), query the same batch and key's head_dim")
    if Hkv < 1 or H % Hkv:
        raise ValueError(f"{owner}: the query heads ({H}) must be a multiple of the key/value "
                         f"heads ({Hkv})")
    if C > P:
        raise ValueError(f"{owner}: {C} queries over {P} keys; the queries are the last C of "
                         f"the keys (a cache's keys include the new tokens), so C ≤ P")
    return B, H, C, P


def _offsets(prior, P: int, H: int, device, owner: str) -> Offsets:
    """The prior's table over the offsets for P × P (``PriorTables.offsets``), checked: a
    stationary prior on j ≤ i or a window of the past, with 1 or H rows."""
    if not isinstance(prior, Prior):
        raise ValueError(f"{owner}: the prior must be a structattn.priors.Prior; got "
                         f"{type(prior).__name__}")
    stated = prior.tables(P, P, device).offsets()
    if stated is None:
        raise ValueError(f"{owner}: {prior.describe()} is not stationary on j ≤ i (it states no "
                         f"table over the offsets i − j, Prior.log_at_offsets, for its support), "
                         f"so its weights cannot follow the queries along a cache; the interface "
                         f"reads ALiBi, RelativePosition, GeneralisedGaussian, a DistancePrior")
    if stated.lo < 0:
        raise ValueError(f"{owner}: {prior.describe()} reads every parent (causal=False), the "
                         f"future too; a causal model's attention reads j ≤ i: build the prior "
                         f"with causal=True")
    rows = stated.table.shape[0]
    if rows not in (1, H):
        raise ValueError(f"{owner}: {prior.describe()} has {rows} heads of parameters but the "
                         f"attention has {H} query heads; give 1 or {H}")
    return stated


def _grouped(x: torch.Tensor, heads: int) -> torch.Tensor:
    """The key/value heads repeated for the query heads that read them: ``(B, H, P, d)``."""
    B, Hkv, P, d = x.shape
    if Hkv == heads:
        return x
    return x[:, :, None].expand(B, Hkv, heads // Hkv, P, d).reshape(B, heads, P, d)


def _band(stated: Offsets, shift: int, C: int, P: int, device):
    """``(d, inside)``: each pair's distance (shift + i) − j ``(C, P)`` and whether the
    prior's support reads it."""
    d = (torch.arange(C, device=device) + shift)[:, None] - torch.arange(P, device=device)
    return d, (d >= stated.lo) & (d <= stated.hi)


def _bias(stated: Offsets, shift: int, C: int, P: int, query) -> torch.Tensor:
    """The log prior of the C × P block ``(H or 1, C, P)`` from the O(P) table, −∞ off the
    support."""
    d, inside = _band(stated, shift, C, P, query.device)
    table = stated.table.to(device=query.device, dtype=query.dtype)
    bias = table[:, (d - stated.lowest).clamp(0, table.shape[-1] - 1)]
    return bias.masked_fill(~inside, float("-inf"))


def _mask(mask, stated, B, H, C, P, owner):
    """HF's 4-D mask, checked; None where it removes no pair the prior reads (the kernel
    then reads the prior alone)."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.shape[-2:] != (C, P) \
            or mask.shape[0] not in (1, B) or mask.shape[1] not in (1, H):
        got = shape_str(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"{owner}: attention_mask must be None or a 4-D boolean or additive "
                         f"mask (batch or 1, 1 or heads, {C}, {P}); got {got}")
    reads = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    if not bool(reads[..., -1, -1].any()):
        raise ValueError(f"{owner}: under attention_mask the last query reads the last key in "
                         f"no row; the queries are aligned with the last keys, so a cache "
                         f"whose key buffer runs past its tokens (a StaticCache) or a batch "
                         f"whose every row ends in padding is refused: use a DynamicCache, "
                         f"trim the padding")
    _, inside = _band(stated, P - C, C, P, mask.device)
    removes = ~reads & inside if mask.dtype == torch.bool else (mask != 0) & inside
    return mask if bool(removes.any()) else None
