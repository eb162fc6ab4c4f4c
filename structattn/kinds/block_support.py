"""Attention over a support read by blocks: each block of children reads only the key blocks
that hold one of its pairs (``structattn.kinds.blocks.SupportBlocks``), never the (C, P) mask.

    out_i = Σ_{j ∈ Φ_i} softmax_j(scale·⟨a_i, b_j⟩) u_j,   out_i = 0 for a child with no parent.

On the CPU in float32 and float64 the compiled kernel ``csrc/block_support.cpp`` reads the
tiles, forward and backward (FlashAttention's, recomputing each visited tile), wrapped as one
custom op with its fake-tensor and autograd rules (``structattn_block_support::forward``), so
that a recorded plan and ``torch.compile`` see one operator. Elsewhere — kernels off
(``structattn.kernels.disabled()``), a failed build, another device or dtype, an exported
program — a Python loop over child blocks computes the same numbers to rounding,
differentiably through autograd.

Cost: O(nnz·BQ·BK·(d + d_v)) time for nnz listed tiles; memory O((C + P)·d) in the kernel,
O(nnz·BQ·BK) in the Python loop with gradients (its tiles' scores), beside the structure's
O(n_partial·BQ·BK + C).
"""

from __future__ import annotations

import math
import numbers

import torch

from .. import kernels
from ..checking._validation import is_exporting, shape_str
from .blocks import SupportBlocks

__all__ = ["block_support_attention", "uses_kernel"]


def _ops():
    """The kernel's ops, with their fake-tensor and autograd rules registered once; None
    where kernels are off or could not be built."""
    return kernels.with_rules("block_support", _register)


def _register(ops) -> None:
    lib = "structattn_block_support"

    @torch.library.register_fake(f"{lib}::forward")
    def _(q, k, v, offsets, blocks, mask_index, masks, block_q, block_k, scale):
        B, H, C = q.shape[:-1]
        return q.new_empty(B, H, C, v.shape[-1]), q.new_empty(B, H, C)

    @torch.library.register_fake(f"{lib}::backward")
    def _(dout, q, k, v, out, lse, offsets, blocks, mask_index, masks, block_q, block_k, scale):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def setup(ctx, inputs, output):
        q, k, v, offsets, blocks, mask_index, masks, block_q, block_k, scale = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, offsets, blocks, mask_index, masks)
        ctx.block_q, ctx.block_k, ctx.scale = block_q, block_k, scale
        ctx.mark_non_differentiable(lse)

    def backward(ctx, dout, _):
        q, k, v, out, lse, offsets, blocks, mask_index, masks = ctx.saved_tensors
        dq, dk, dv = torch.ops.structattn_block_support.backward(
            dout, q, k, v, out, lse, offsets, blocks, mask_index, masks, ctx.block_q,
            ctx.block_k, ctx.scale)
        return dq, dk, dv, None, None, None, None, None, None, None

    torch.library.register_autograd(f"{lib}::forward", backward, setup_context=setup)


def uses_kernel(a: torch.Tensor, b: torch.Tensor, u: torch.Tensor) -> bool:
    """Whether the compiled kernel reads these factors: CPU tensors in float32 or float64,
    kernels on and built, not in an exported program (which must run without structattn).

    Args:
        a (torch.Tensor): the children's factors; b (torch.Tensor): the parents';
            u (torch.Tensor): the values.

    Returns:
        bool: True where ``block_support_attention`` calls the kernel, False where it runs
        its Python loop.
    """
    if not all(x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64)
               for x in (a, b, u)):
        return False
    if not kernels._enabled() or is_exporting() or torch.compiler.is_exporting():
        return False
    return _ops() is not None


def _check(a, b, u, blocks, scale) -> None:
    """Clear errors, each naming its argument: types, dtypes, shapes against the structure."""
    if not isinstance(blocks, SupportBlocks):
        raise ValueError(f"block_support_attention: blocks must be a SupportBlocks "
                         f"(structattn.kinds.blocks.classify); got {type(blocks).__name__}")
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise ValueError(f"block_support_attention: scale must be a float; got {scale!r}")
    for name, x in (("a", a), ("b", b), ("u", u)):
        if not isinstance(x, torch.Tensor) or x.dim() < 2:
            raise ValueError(f"block_support_attention: {name} must be a tensor (…, n, width); "
                             f"got {shape_str(x.shape) if isinstance(x, torch.Tensor) else x!r}")
        if not x.is_floating_point():
            raise ValueError(f"block_support_attention: {name} must be floating point; got "
                             f"{x.dtype}")
    if not a.dtype == b.dtype == u.dtype:
        raise ValueError(f"block_support_attention: a, b and u must share one dtype; got "
                         f"{a.dtype}, {b.dtype} and {u.dtype}")
    C, P = blocks.num_children, blocks.num_parents
    for name, x, n, what in (("a", a, C, "children"), ("b", b, P, "parents"),
                             ("u", u, P, "parents")):
        if x.shape[-2] != n:
            raise ValueError(f"block_support_attention: {name} must have the structure's {n} "
                             f"{what} in dim −2; got {shape_str(x.shape)}")
    if a.shape[-1] != b.shape[-1]:
        raise ValueError(f"block_support_attention: a and b must share their last dim; got "
                         f"{shape_str(a.shape)} and {shape_str(b.shape)}")
    try:
        torch.broadcast_shapes(a.shape[:-2], b.shape[:-2], u.shape[:-2])
    except RuntimeError:
        raise ValueError(f"block_support_attention: the leading dims of a, b and u must "
                         f"broadcast; got {shape_str(a.shape)}, {shape_str(b.shape)} and "
                         f"{shape_str(u.shape)}") from None


def block_support_attention(a: torch.Tensor, b: torch.Tensor, u: torch.Tensor,
                            blocks: SupportBlocks, scale: float) -> torch.Tensor:
    """``Σ_{j ∈ Φ_i} softmax_j(scale·⟨a_i, b_j⟩) u_j`` over the support's listed tiles; 0 for a
    child with no parent.

    Args:
        a (torch.Tensor): ``(*lead, C, d)`` the children's factors.
        b (torch.Tensor): ``(*lead, P, d)`` the parents' factors.
        u (torch.Tensor): ``(*lead, P, d_v)`` the values (the leading dims broadcast; a, b
            and u share one floating dtype).
        blocks (SupportBlocks): the support's tiles for C children and P parents
            (``structattn.kinds.blocks.classify``).
        scale (float): the scores' factor.

    Returns:
        torch.Tensor: ``(*lead, C, d_v)``, differentiable in a, b and u (by the kernel's
        backward where ``uses_kernel``, else by autograd through the Python loop).

    Raises:
        ValueError: a wrong type, dtype or shape, naming the argument.

    Example:
        >>> from structattn.kinds import Causal
        >>> from structattn.kinds.blocks import classify
        >>> a = torch.randn(2, 5, 3, dtype=torch.float64)
        >>> out = block_support_attention(a, a, a, classify(Causal(), 5, 5, 2, 2), 0.5)
        >>> dense = torch.nn.functional.scaled_dot_product_attention(a, a, a, is_causal=True,
        ...                                                          scale=0.5)
        >>> torch.allclose(out, dense)
        True
    """
    _check(a, b, u, blocks, scale)
    if not uses_kernel(a, b, u):
        return by_child_blocks(a, b, u, blocks, float(scale))
    lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2], u.shape[:-2])
    batch, heads = math.prod(lead[:-1]), (lead[-1] if lead else 1)
    C, d_v = a.shape[-2], u.shape[-1]
    q, k, v = (x.expand(*lead, *x.shape[-2:]).reshape(batch, heads, *x.shape[-2:])
               for x in (a, b, u))  # (B, H, n, width), views where the dims allow
    s = blocks.to("cpu")
    out = _ops().forward(q, k, v, s.offsets, s.blocks, s.mask_index, s.masks, s.block_q,
                         s.block_k, float(scale))[0]
    return out.reshape(*lead, C, d_v)


def by_child_blocks(a: torch.Tensor, b: torch.Tensor, u: torch.Tensor, blocks: SupportBlocks,
                    scale: float) -> torch.Tensor:
    """The Python reading of ``block_support_attention`` (same arguments, no checks): per block
    of children, its listed key blocks' parents gathered, their scores masked by the tiles
    and a softmax over them; any device and dtype, differentiable through autograd."""
    s = blocks.to(a.device)
    C, P, BQ, BK = s.num_children, s.num_parents, s.block_q, s.block_k
    lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2], u.shape[:-2])
    # a full tile's mask at index −1: the partial tiles' masks, then every pair
    bank = torch.cat([s.masks, s.masks.new_ones(1, BQ, BK)])  # (n_partial + 1, BQ, BK)
    cols = torch.arange(BK, device=a.device)
    offsets = s.offsets.tolist()
    out = []
    for r in range(s.num_child_blocks):
        i0 = r * BQ
        n, (e0, e1) = min(BQ, C - i0), offsets[r:r + 2]
        if e0 == e1:  # no child of the block has a parent: an empty sum, in the graph
            out.append(a[..., i0:i0 + n, :] @ b[..., :0, :].transpose(-1, -2) @ u[..., :0, :])
            continue
        parents = (s.blocks[e0:e1, None] * BK + cols).reshape(-1)  # (L·BK,) the tiles' parents
        inside = bank[s.mask_index[e0:e1], :n].transpose(0, 1).reshape(n, -1)  # (n, L·BK)
        inside = inside & (parents < P)
        parents = parents.clamp(max=P - 1)
        scores = scale * a[..., i0:i0 + n, :] @ b.index_select(-2, parents).transpose(-1, -2)
        scores = scores.masked_fill(~inside, float("-inf"))  # (*lead, n, L·BK)
        top = scores.detach().amax(-1, keepdim=True)
        top = top.masked_fill(top == float("-inf"), 0.0)  # a child with no parent: w = 0
        w = (scores - top).exp()
        total = w.sum(-1, keepdim=True)
        out.append((w @ u.index_select(-2, parents)) / torch.where(total > 0, total, 1.0))
    if not out:
        return a.new_zeros(*lead, C, u.shape[-1])
    return torch.cat([o.expand(*lead, *o.shape[-2:]) for o in out], -2)
