"""Masked tile loads and stores shared by the Triton kernels: a ``(rows, cols)`` tile of row
``g`` of a ``(G, n_rows, n_cols)`` tensor given by its strides, zero outside it."""

import triton
import triton.language as tl


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


__all__ = ["add_tile", "load_row", "load_tile", "store_tile"]
