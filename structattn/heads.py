"""Moving between ``(*batch, n, heads*d)`` features and ``(*batch, heads, n, d)`` heads."""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

#: one head's features made by ``merge_heads`` (a view: the same memory) → (the heads they
#: were merged from, both tensors' versions): an iteration that merges its heads and splits
#: them again at the next step (``E[∂ψ/∂μ]`` of a bilinear potential, then μ's own factor)
#: gets the heads back, not two more view operations per step (each ~0.4 ms in the fake
#: trace that records a plan)
_MERGED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def split_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``(*batch, n, heads*d) -> (*batch, heads, n, d)`` (one head: a view, one operation).

    Args:
        t: features ``(*batch, n, heads*d)``; the last dim is split into ``heads`` equal parts.
        heads: the number of heads H.

    Returns:
        ``(*batch, heads, n, d)``, with d = ``t.shape[-1] // heads``: head h holds the
            features ``h*d`` to ``(h+1)*d`` of each of the n rows.
    """
    merged = _MERGED.get(t) if heads == 1 and not torch.compiler.is_compiling() else None
    if merged is not None and (merged[0]._version, t._version) == merged[1]:
        return merged[0]
    if heads == 1:
        return t.unsqueeze(-3)
    return t.unflatten(-1, (heads, t.shape[-1] // heads)).transpose(-3, -2)


def merge_heads(t: torch.Tensor) -> torch.Tensor:
    """``(*batch, heads, n, d) -> (*batch, n, heads*d)``, the inverse of ``split_heads``.

    Also works on Pyro's enumerated values, whose size-1 dims broadcast.

    Args:
        t: per-head values ``(*batch, heads, n, d)`` (e.g. ``structattn.value``'s output).

    Returns:
        ``(*batch, n, heads*d)``, each row's heads side by side, head 0 first (one head: the
            values with the heads dim dropped).
    """
    if t.shape[-3] == 1:  # one head: the same values, one operation
        out = t.squeeze(-3)
        if not (torch.compiler.is_compiling() or t.is_inference()):  # (dynamo's graph drops
            # the pair itself; an inference tensor has no version to check)
            _MERGED[out] = (t, (t._version, out._version))
        return out
    return t.transpose(-3, -2).flatten(-2)


def gather_parents(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``t[…, h, index[…, h, i], :]``: per-parent features at each child's chosen parent.

    t: ``(*batch, H, P, d)``; index: broadcastable to ``(*batch, H, C)`` and may carry
    extra leading (enumeration) dims. Returns ``broadcast(index) + (d,)``.
    """
    from pyro.ops.indexing import Vindex

    return Vindex(t.unsqueeze(-3))[..., index, :]
