"""A log prior that separates as g_i + h_j: on the CPU with h as a mask, on CUDA in Triton.

``out_i = Σ_j softmax_j(scale·⟨a_i, b_j⟩ + h_j) u_j`` over j ≤ i (or every j): g_i drops out
of the softmax. FoX's forget gate (h_j = −Σ_{l≤j} log f_l) and ALiBi (h_j = m·j) are such
priors. PyTorch's fused CPU flash kernel takes h as an additive mask broadcast over the
children — a ``(…, 1, P)`` view, O(P) memory, no C×P bias — together with ``is_causal``
(which the public ``scaled_dot_product_attention`` refuses), at about the cost of causal
attention without a prior.

Its backward does not return the mask's gradient Σ_i ∂L/∂s_ij. With gradients, the
compiled kernel ``csrc/key_bias.cpp`` does the backward instead, with h's gradient in the
same pass (``structattn.kernels.key_bias``): the forward is still PyTorch's fused kernel (a
custom op around it, so that a recorded plan, ``torch.compile`` and the autograd rule see one
operator). Without the kernel, the widened operator (``dense.with_parent_terms``: h riding in
one more key dimension, ~12% slower) serves in float32 and float64.

On CUDA the Triton kernel (``structattn.triton_kernels.key_bias``) reads the prior as an
additive term of each block's scores, forward and backward with h's gradient, in any float
dtype (float32 under autocast too), h in float32: no widened head; the widened operator
serves where Triton is not installed. Half precision without a kernel — half-precision
factors, or float32 ones that autocast sends to half precision (``folds_terms``) — reads the
prior's table instead: h, which grows along the sequence, would be rounded into the factors.

A band per leading index (``key_bias_attention``'s ``window``: a certified width per head)
is read by the Triton kernel on CUDA and by the compiled kernel's ``band_forward`` /
``band_backward`` on the CPU, the keys and values in place (``band_applies``).
"""

from __future__ import annotations

import torch

from .. import kernels, triton_kernels
from ..checking._validation import is_exporting

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _ops():
    """The kernel's ops, with their fake-tensor and autograd rules registered once; None
    where kernels are off or could not be built."""
    return kernels.with_rules("key_bias", _register)


def _register(ops) -> None:
    lib = "structattn_key_bias"

    @torch.library.register_fake(f"{lib}::forward")
    def _(q, k, v, h, scale, causal):  # as the fused kernel lays them out (q, v one width)
        B, H, C = q.shape[:-1]
        lse_dtype = torch.float32 if q.dtype != torch.float64 else q.dtype
        return torch.empty_like(q), q.new_empty(B, C, H, dtype=lse_dtype).transpose(1, 2)

    def grads_like(q, k, v, h):  # what either backward returns: dq, dk, dv, dh
        return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
                h.new_empty(h.shape, dtype=q.dtype))

    @torch.library.register_fake(f"{lib}::backward")
    def _(dout, q, k, v, h, out, lse, scale, causal):
        return grads_like(q, k, v, h)

    def setup(ctx, inputs, output):
        q, k, v, h, scale, causal = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, h, out, lse)
        ctx.scale, ctx.causal = scale, causal
        ctx.mark_non_differentiable(lse)

    def backward(ctx, dout, _):
        q, k, v, h, out, lse = ctx.saved_tensors
        dq, dk, dv, dh = torch.ops.structattn_key_bias.backward(
            dout, q, k, v, h, out, lse, ctx.scale, ctx.causal)
        return dq, dk, dv, dh.to(h.dtype), None, None

    torch.library.register_autograd(f"{lib}::forward", backward, setup_context=setup)

    @torch.library.register_fake(f"{lib}::band_forward")
    def _(q, k, v, h, window, scale):
        B, H, C = q.shape[:-1]
        return q.new_empty(B, H, C, v.shape[-1]), q.new_empty(B, H, C)

    @torch.library.register_fake(f"{lib}::band_backward")
    def _(dout, q, k, v, h, out, lse, window, scale):
        return grads_like(q, k, v, h)

    def band_setup(ctx, inputs, output):
        q, k, v, h, window, scale = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, h, out, lse, window)
        ctx.scale = scale
        ctx.mark_non_differentiable(lse)

    def band_backward(ctx, dout, _):
        q, k, v, h, out, lse, window = ctx.saved_tensors
        dq, dk, dv, dh = torch.ops.structattn_key_bias.band_backward(
            dout.contiguous(), q, k, v, h, out, lse, window, ctx.scale)
        return dq, dk, dv, dh.to(h.dtype), None, None

    torch.library.register_autograd(f"{lib}::band_forward", band_backward,
                                    setup_context=band_setup)


_HALF = (torch.float16, torch.bfloat16)


def computes_in(x: torch.Tensor) -> torch.dtype:
    """The dtype a product of ``x`` (SDPA, a matmul) runs in: autocast's, where autocast is on
    for ``x``'s device and ``x`` is float32; else ``x``'s own."""
    device = x.device.type
    if x.dtype == torch.float32 and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


def folds_terms(*factors: torch.Tensor) -> bool:
    """Whether h may ride in one more key dimension of these factors
    (``dense.with_parent_terms``): their products run in float32 or float64 (``computes_in``).
    In half precision h_j's rounding, eps·|h_j| with h growing along the sequence, would
    enter every logit; the key-bias kernels, which keep h in float32, or the prior's table
    serve instead."""
    return all(computes_in(x) not in _HALF for x in factors)


def asks_gradient(*tensors: torch.Tensor) -> bool:
    """Whether a gradient is asked of any of ``tensors`` (grad mode on, one requiring it)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _triton(a, b, u, h) -> bool:
    """Whether the Triton kernel serves these factors (a CUDA device, Triton installed, the
    kernels on; not in an exported program, which must run without structattn)."""
    return (b.shape[-2] > 0 and triton_kernels.serves(a, b, u, h) and kernels._enabled()
            and not (is_exporting() or torch.compiler.is_exporting()))


def band_applies(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a band per leading index (``key_bias_attention``'s ``window``) can be read for
    these factors, never copying its keys and values: the Triton kernel serves them (a GPU),
    or the compiled CPU kernel does (float32 or float64; not in an exported program, which
    must run without structattn)."""
    if b.shape[-2] == 0 or not kernels._enabled() or is_exporting() \
            or torch.compiler.is_exporting():
        return False
    if triton_kernels.serves(a, b):
        return True
    return (a.device.type == "cpu" and b.device.type == "cpu"
            and a.dtype in (torch.float32, torch.float64) and _ops() is not None)


def applies(a: torch.Tensor, b: torch.Tensor, u: torch.Tensor, h: torch.Tensor) -> bool:
    """Whether this reading takes these factors: on CUDA, through the Triton kernel (any
    float dtype; half precision on the tensor cores, its scores and sums in float32); on the
    CPU, in single or double precision, with no gradient asked of any of them — or with one,
    where the kernel is built (not in an exported program, which must run without
    structattn)."""
    if _triton(a, b, u, h):
        return True
    if not (a.device.type == "cpu" and a.dtype in (torch.float32, torch.float64)
            and u.dtype == a.dtype):
        return False
    if not asks_gradient(a, b, u, h):
        return True
    # an exported program runs where structattn is not installed: no operator of ours in it
    exporting = is_exporting() or torch.compiler.is_exporting()
    return not exporting and _ops() is not None


def key_bias_attention(a, b, u, h, scale: float, is_causal: bool,
                       window: torch.Tensor | None = None) -> torch.Tensor:
    """``softmax_j(scale·⟨a_i, b_j⟩ + h_j)`` over j ≤ i (``is_causal``) or every j, times u.

    Args:
        a: ``(*lead, C, d_k)`` children's factors; b: ``(*lead, P, d_k)`` parents' factors;
            u: ``(*lead, P, d_v)`` values (the leading dims broadcast).
        h: ``(*lead, P)`` the prior's per-parent term (broadcasts against the leading dims).
        scale: a float (``Operator.fused_factors`` folds a learned one into ``a``).
        window: ``(*lead)`` ints, with ``is_causal`` and a band kernel (``band_applies``): each
            leading index's children read i − window ≤ j ≤ i (a certified band per head).

    Returns ``(*lead, C, d_v)``; differentiable in a, b, u and h where the kernel is built
    (``applies``)."""
    lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2], u.shape[:-2], h.shape[:-1])
    C, P, d_v = a.shape[-2], b.shape[-2], u.shape[-1]
    if window is not None and not (is_causal and band_applies(a, b)):
        raise ValueError("key_bias_attention: a window per leading index needs is_causal and "
                         "a kernel that reads a band (band_applies)")
    if _triton(a, b, u, h):  # (G, n, width) rows in their dtype; h in float32 at least
        from ..triton_kernels.key_bias import forward

        dtype = torch.promote_types(torch.promote_types(a.dtype, b.dtype), u.dtype)
        flat = [x.expand(*lead, *x.shape[-2:]).reshape(-1, *x.shape[-2:]).to(dtype)
                for x in (a, b, u)]
        bias = h.to(torch.promote_types(dtype, torch.float32)).expand(*lead, P).reshape(-1, P)
        if window is not None:
            window = window.expand(lead).reshape(-1).to(torch.int32)
        out = forward(*flat, bias, float(scale), is_causal, window)[0]
        return out.reshape(*lead, C, d_v).to(u.dtype)
    heads = lead[-1] if lead else 1
    if window is not None:  # the compiled CPU kernel's band
        return _cpu_band(a, b, u, h, float(scale), window.expand(lead), lead)
    a, b, u = (x.expand(*lead, *x.shape[-2:]).reshape(-1, heads, *x.shape[-2:])
               for x in (a, b, u))  # views where the batch dims merge
    h = h.to(a.dtype).expand(*lead, P).reshape(-1, heads, P)
    return _fused(a, b, u, h, float(scale), is_causal)[0].reshape(*lead, C, d_v)


def _fused(a, b, u, h, scale: float, is_causal: bool):
    """``(out (B, H, C, d_v), lse (B, H, C))`` of the fused CPU reading of ``(B, H, ·, ·)``
    factors under h ``(B, H, P)`` in their dtype: PyTorch's flash kernel, or with a gradient
    the compiled kernel (h's gradient too). The kernel takes one width for a, b and u (the
    narrower padded), and the scale's sign is folded into a: PyTorch's fused CPU kernel
    returns NaN for the first child of a causal reading under a negative scale (torch 2.13),
    the same scores either way."""
    d_v = u.shape[-1]
    width = max(a.shape[-1], d_v)
    if a.shape[-1] < width:
        a, b = (torch.nn.functional.pad(x, (0, width - x.shape[-1])) for x in (a, b))
    if d_v < width:
        u = torch.nn.functional.pad(u, (0, width - d_v))
    if scale < 0:
        a, scale = -a, -scale
    if asks_gradient(a, b, u, h):
        out, lse = _ops().forward(a, b, u, h, scale, is_causal)
    else:
        out, lse = _flash(a, b, u, 0.0, is_causal, attn_mask=h.unsqueeze(-2), scale=scale)[:2]
    return (out if d_v == width else out[..., :d_v]), lse


def band_rows(a, b, u, h, scale: float, width: torch.Tensor):
    """``(out (G, n, d_v), lse (G, n))``: rows ``(G, n, ·)`` of children each reading the
    parents ``width`` ``(G,)`` back (i − width ≤ j ≤ i) under h ``(G, n)`` (float32 at least),
    with each child's log-sum of its band (the certificate's evidence,
    ``structattn.certificates.certified_read``). The Triton kernel on CUDA; on the CPU the
    compiled band kernel for the rows with a band and the fused kernel for those whose width
    holds all of their past (``_cpu_band``'s split), ``lse`` in the factors' dtype (float32
    for float32). Differentiable in a, b, u and h (``lse`` is not)."""
    if _triton(a, b, u, h):
        from ..triton_kernels.key_bias import forward

        return forward(a, b, u, h, scale, True, width.to(torch.int32))
    n = a.shape[1]
    hh = h.to(a.dtype)
    wide = width >= n - 1

    def band(sel):  # the rows ``sel`` through the band kernel
        q, k, v = (x[sel][None] for x in (a, b, u))  # (1, G', n, ·)
        out, lse = _ops().band_forward(q, k, v, hh[sel][None], width[sel][None], scale)
        return out[0], lse[0]

    def whole(sel):  # the rows ``sel`` through the fused kernel
        out, lse = _fused(*(x[sel][None] for x in (a, b, u, hh)), scale, True)
        return out[0], lse[0]

    if bool(wide.all()):
        return whole(slice(None))
    if not bool(wide.any()):
        return band(slice(None))
    narrow, far = (~wide).nonzero()[:, 0], wide.nonzero()[:, 0]
    (o1, l1), (o2, l2) = band(narrow), whole(far)
    back = torch.cat([narrow, far]).argsort()  # back to the rows' order
    return torch.cat([o1, o2])[back], torch.cat([l1, l2.to(l1.dtype)])[back]


def _cpu_band(a, b, u, h, scale: float, window: torch.Tensor, lead) -> torch.Tensor:
    """The CPU's band per leading index (``window`` ``lead``), through ``band_rows``: the
    compiled band kernel for the rows with a band, the fused kernel for those whose window
    holds all of their past (its pair costs ~0.7× the band kernel's: measured at N = 4,096,
    d = 64), put back in place."""
    C, P, d_v = a.shape[-2], b.shape[-2], u.shape[-1]
    dtype = torch.promote_types(torch.promote_types(a.dtype, b.dtype), u.dtype)
    rows = [x.expand(*lead, *x.shape[-2:]).reshape(-1, *x.shape[-2:]).to(dtype)
            for x in (a, b, u)]  # (G, n, width)
    bias = h.to(dtype).expand(*lead, P).reshape(-1, P)
    out = band_rows(*rows, bias, scale, window.reshape(-1))[0]
    return out.reshape(*lead, C, d_v).to(u.dtype)
