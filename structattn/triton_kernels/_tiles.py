"""What the Triton kernels share: masked tile loads and stores (a ``(rows, cols)`` tile of row
``g`` of a ``(G, n_rows, n_cols)`` tensor given by its strides, zero outside it), the block
product ``dot`` and the launch settings chosen per dtype and head width (``settings``).

Inputs keep their dtype (bfloat16 and float16 reach the tensor cores as they are); scores,
running statistics and accumulators are float32, or float64 for float64 inputs (``ACC``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import interpreted


@triton.jit
def load_tile(ptr, g, s_g, rows, s_r, n_rows, cols, s_c, n_cols):
    return tl.load(ptr + g * s_g + rows[:, None] * s_r + cols[None, :] * s_c,
                   mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols), other=0.0)


@triton.jit
def store_tile(ptr, value, g, s_g, rows, s_r, n_rows, cols, s_c, n_cols):
    tl.store(ptr + g * s_g + rows[:, None] * s_r + cols[None, :] * s_c, value,
             mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols))


@triton.jit
def add_tile(ptr, value, g, s_g, rows, s_r, n_rows, cols, s_c, n_cols):
    """Atomically add ``value`` into the tile (blocks of children adding to one parent)."""
    tl.atomic_add(ptr + g * s_g + rows[:, None] * s_r + cols[None, :] * s_c, value,
                  mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols))


@triton.jit
def load_row(ptr, g, s_g, rows, s_r, n_rows):
    """A ``(rows,)`` slice of row ``g`` of a ``(G, n_rows)`` tensor, zero outside it."""
    return tl.load(ptr + g * s_g + rows * s_r, mask=rows < n_rows, other=0.0)


@triton.jit
def dot(x, y, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``x @ y`` accumulated in float32 (float64 for float64 inputs). ``PRECISION`` is
    ``"tf32"`` for float32 where torch's float32 matmul precision allows it, else ``"ieee"``
    (half precision goes to the tensor cores either way); ``UPCAST`` computes a half-precision
    product in float32 (Triton's interpreter multiplies bfloat16 blocks wrongly)."""
    if UPCAST:
        return tl.dot(x.to(tl.float32), y.to(tl.float32))
    else:
        return tl.dot(x, y, input_precision=PRECISION)


@triton.jit
def online_softmax(logit, top):
    """One tile of an online softmax (FlashAttention's) over each row's logits ``(BM, BN)``
    (−∞ off its support), given its running maximum ``top`` ``(BM,)``: ``(p, shrink,
    new)`` — the tile's e^{logit − new}, the factor e^{top − new} that rescales the running
    sums, and the new maximum (a row with nothing yet keeps −∞, with p and shrink 0)."""
    new = tl.maximum(top, tl.max(logit, axis=1))
    safe = tl.where(new == -float("inf"), 0.0, new)  # a row with nothing yet
    return tl.exp(logit - safe[:, None]), tl.exp(top - safe), new


_HALF = (torch.float16, torch.bfloat16)


def statistics(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the scores, the per-child statistics and the sums: float64 for float64
    inputs, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def scalar(x: float, like: torch.Tensor) -> torch.Tensor:
    """``x`` as a one-element tensor in ``statistics(like.dtype)`` on ``like``'s device: a
    kernel reads its float arguments in float32, too coarse for float64 inputs."""
    return torch.full((1,), x, dtype=statistics(like.dtype), device=like.device)


def width(n: int) -> int:
    """A factor's width padded to a power of two ≥ 16 (``tl.dot``'s least)."""
    return max(16, triton.next_power_of_2(n))


def settings(dtype: torch.dtype, widest: int, children: int = 128, parents: int = 64) -> dict:
    """The launch settings of a kernel over ``dtype`` inputs whose widest factor is ``widest``
    (padded): ``BM`` children and ``BN`` parents per block, the accumulator ``ACC``, the
    product's ``PRECISION`` and ``UPCAST``, ``num_warps`` and ``num_stages``. Blocks of
    ``children × parents`` in half precision, at most 64 × 32 in float32 and 32 × 32 in float64
    (the tiles of one stage must fit in shared memory); 32 × 32 under the interpreter, where
    the tests' sizes cross the blocks' edges."""
    acc = tl.float64 if dtype == torch.float64 else tl.float32
    tf32 = dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest"
    out = dict(ACC=acc, PRECISION="tf32" if tf32 else "ieee",
               UPCAST=dtype in _HALF and interpreted())
    if interpreted():
        return dict(out, BM=32, BN=32)
    if dtype in _HALF:
        bm, bn, stages = children, parents, (3 if widest <= 64 else 2)
    elif dtype == torch.float32:
        bm, bn, stages = (64 if widest <= 64 else 32), 32, 2
    else:
        bm, bn, stages = 32, 32, 1
    return dict(out, BM=bm, BN=bn, num_warps=8 if widest >= 128 and dtype in _HALF else 4,
                num_stages=stages)


__all__ = ["add_tile", "dot", "load_row", "load_tile", "online_softmax", "scalar", "settings",
           "statistics", "store_tile", "width"]
