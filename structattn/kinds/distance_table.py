"""A log prior that is a function of the distance d = i − j alone, read from its table inside
each tile of scores.

``out_i = Σ_j softmax_j(scale·⟨a_i, b_j⟩ + t[d − lowest]) u_j`` over j ≤ i or every j, with
t ``(heads or 1, n)`` the prior's log weight at d = lowest … lowest + n − 1
(``Prior.log_at_offsets``): ALiBi on every parent, a relative-position table, the generalised
Gaussian on the CPU, a user's ``DistancePrior``. The dense reading adds such a prior as a
``(heads, C, P)`` bias, 4 GiB in float32 at C = P = 16,384 and four heads; the compiled
kernel ``csrc/distance_table.cpp`` looks the bias up per tile, forward and backward, with the
table's gradient summed per distance in the same pass — autograd carries it on to the prior's
parameters: O((C + P)·d + heads·n) memory. A custom op (``torch.ops.structattn_distance_table``)
with a fake-tensor rule and an autograd formula, so that a recorded plan, ``torch.compile``
and the backward see one operator. CPU, float32 and float64; elsewhere the table serves.
"""

from __future__ import annotations

import torch

from .. import kernels
from ..checking._validation import is_exporting


def _ops():
    """The kernel's ops, their fake-tensor and autograd rules registered once; None where
    kernels are off or could not be built."""
    return kernels.with_rules("distance_table", _register)


def _register(ops) -> None:
    lib = "structattn_distance_table"

    @torch.library.register_fake(f"{lib}::forward")
    def _(q, k, v, table, shift, lo, hi, scale):
        B, H, C = q.shape[:-1]
        return q.new_empty(B, H, C, v.shape[-1]), q.new_empty(B, H, C)

    @torch.library.register_fake(f"{lib}::backward")
    def _(dout, q, k, v, table, out, lse, shift, lo, hi, scale):
        B, H = q.shape[:2]
        return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
                q.new_empty(B, H, table.shape[-1]))

    def setup(ctx, inputs, output):
        q, k, v, table, shift, lo, hi, scale = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, table, out, lse)
        ctx.band = (shift, lo, hi, scale)
        ctx.mark_non_differentiable(lse)

    def backward(ctx, dout, _):
        q, k, v, table, out, lse = ctx.saved_tensors
        dq, dk, dv, dt = torch.ops.structattn_distance_table.backward(
            dout, q, k, v, table, out, lse, *ctx.band)
        dt = dt.sum(0)  # (H, n): the rows of one head share its table
        if table.shape[0] == 1:
            dt = dt.sum(0, keepdim=True)  # one table for every head
        return dq, dk, dv, dt.to(table.dtype), None, None, None, None

    torch.library.register_autograd(f"{lib}::forward", backward, setup_context=setup)


def applies(a: torch.Tensor, b: torch.Tensor, u: torch.Tensor) -> bool:
    """Whether the kernel reads these factors: on the CPU, in float32 or float64 (one dtype),
    with the kernel built, and not in an exported program (which must run without
    structattn)."""
    if b.shape[-2] == 0 or is_exporting() or torch.compiler.is_exporting():
        return False
    if not all(x.device.type == "cpu" and x.dtype == a.dtype for x in (b, u)):
        return False
    return a.device.type == "cpu" and a.dtype in (torch.float32, torch.float64) \
        and _ops() is not None


def distance_table_attention(a, b, u, offsets, scale: float) -> torch.Tensor:
    """``softmax_j(scale·⟨a_i, b_j⟩ + table[…, i − j − lowest])`` over the parents j with
    lo ≤ i − j ≤ hi, times u, child i at position i among the parents.

    Args:
        a: ``(*lead, C, d_k)`` children's factors; b: ``(*lead, P, d_k)`` parents' factors;
            u: ``(*lead, P, d_v)`` values (the leading dims broadcast, the last one the heads).
        offsets: a ``structattn.priors.tables.Offsets``: ``table (heads or 1, n)``, the log
            weight at d = ``lowest`` … ``lowest`` + n − 1 (−∞ excludes a distance), covering
            every distance of the band ``lo`` … ``hi`` that the grid holds.
        scale: a float (``Operator.fused_factors`` folds a learned one into ``a``).

    Returns ``(*lead, C, d_v)`` in u's dtype; differentiable in a, b, u and the table. A
    child with no parent in the band, or whose every weight is −∞, gets a zero row."""
    return _attend(a, b, u, offsets.table, offsets.lowest, offsets.lo, offsets.hi, scale)


def band_attention(a, b, u, table: torch.Tensor, first: int, width: int,
                   scale: float) -> torch.Tensor:
    """``distance_table_attention`` over the band ``first`` ≤ i − j ≤ ``width`` of a table
    ``(heads or 1, width + 1)`` over d = 0 … ``width`` (a certified window's: the pairs
    outside the band are never scored)."""
    return _attend(a, b, u, table, 0, first, width, scale)


def _attend(a, b, u, table, lowest: int, lo: int, hi: int, scale: float) -> torch.Tensor:
    lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2], u.shape[:-2], table.shape[:1])
    C, d_v = a.shape[-2], u.shape[-1]
    heads = lead[-1]
    q, k, v = (x.expand(*lead, *x.shape[-2:]).reshape(-1, heads, *x.shape[-2:])
               for x in (a, b, u))  # (B, H, n, width): views where the batch dims merge
    out = _ops().forward(q, k, v, table.to(a.dtype), -lowest, lo, hi, float(scale))[0]
    return out.reshape(*lead, C, d_v)
