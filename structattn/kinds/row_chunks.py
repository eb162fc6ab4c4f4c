"""A prior that states only ``log_weight`` (no per-token terms, no table over the offsets), read
a block of children at a time, each block's weights recomputed in the backward.

``out_i = Σ_j softmax_j(scale·⟨a_i, b_j⟩ + log w_ij) u_j`` over the support, where log w_ij
is the prior's ``log_weight`` on a block of ``rows`` children × every parent (−∞ outside
``contains``): one masked SDPA call per block, under ``torch.utils.checkpoint``, so that the
backward evaluates the block's weights again rather than keeping them. Memory O(rows·P) per
head at a time instead of the (…, C, P) table; time O(C·P) evaluations of ``log_weight``, as
the table's. The prior's parameters get their gradients from the blocks.

A plan could not keep the recomputation (a recorded graph is plain operators: the backward
would keep every block), so a call that reads this way is read every call, never recorded
(the error stops the recording); an exported program and ``torch.compile`` read the dense
table.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..checking._validation import is_exporting, is_recording

#: the children per block: (heads, ROWS, P) weights at a time
ROWS = 256


def applies() -> bool:
    """Whether this reading may serve: not while a plan is recorded (it raises there: read
    every call instead), nor in an exported program or under ``torch.compile``."""
    if is_recording():
        raise NotImplementedError(
            "a prior stating only log_weight is read a block of children at a time with each "
            "block recomputed in the backward, which a recorded plan cannot keep: this "
            "reading is read every call, not recorded")
    return not (is_exporting() or torch.compiler.is_exporting()
                or torch.compiler.is_compiling())


def block_weights(tables, i0: int, i1: int, dtype) -> torch.Tensor:
    """The unnormalised log prior of children i0 … i1 − 1 over every parent, −∞ outside the
    support: ``(…, i1 − i0, P)`` (the prior's own leading dims)."""
    device = tables.device
    child = torch.arange(i0, i1, device=device)[:, None]
    parent = torch.arange(tables.num_parents, device=device)[None, :]
    lw = tables.prior.log_weight(child, parent, (tables.num_children, tables.num_parents))
    lw = lw.to(device=device, dtype=dtype)
    inside = tables.support.contains(child, parent)
    return lw.masked_fill(~inside, float("-inf"))


def attention(a, b, u, tables, scale: float) -> torch.Tensor:
    """``softmax(scale·a bᵀ + log w) u`` block by block (module docstring).

    Args:
        a: ``(*lead, C, d_k)``; b: ``(*lead, P, d_k)``; u: ``(*lead, P, d_v)``.
        tables: the family's ``PriorTables`` (its prior, support, sizes and device).
        scale: a float.

    Returns ``(*lead, C, d_v)``; a child whose every weight is −∞ gets a zero row (``empty
    = "zero"``: the caller's ``keep`` zeroes it as well)."""
    dtype = torch.promote_types(a.dtype, torch.float32)

    def one(a_rows, b, u, i0, i1):
        lw = block_weights(tables, i0, i1, dtype)  # (…, n, P)
        none = torch.isneginf(lw).all(-1, keepdim=True)
        lw = lw.masked_fill(none, 0.0)  # a row without parents: finite, zeroed below
        lw = lw[(None,) * max(0, a_rows.dim() - lw.dim())].to(a_rows.dtype)
        out = F.scaled_dot_product_attention(a_rows, b, u, attn_mask=lw, scale=scale)
        return out.masked_fill(none, 0.0)

    C = a.shape[-2]
    outs = [checkpoint(one, a[..., i0:min(C, i0 + ROWS), :], b, u, i0, min(C, i0 + ROWS),
                       use_reentrant=False)
            for i0 in range(0, C, ROWS)]
    return torch.cat(outs, -2)
