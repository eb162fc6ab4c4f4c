"""A log prior that separates as g_i + h_j, read without gradients on the CPU: h as a mask.

``out_i = Σ_j softmax_j(scale·⟨a_i, b_j⟩ + h_j) u_j`` over j ≤ i (or every j): g_i drops out
of the softmax. FoX's forget gate (h_j = −Σ_{l≤j} log f_l) and ALiBi (h_j = m·j) are such
priors. PyTorch's fused CPU flash kernel takes h as an additive mask broadcast over the
children — a ``(…, 1, P)`` view, O(P) memory, no C×P bias — together with ``is_causal``
(which the public ``scaled_dot_product_attention`` refuses), at about the cost of causal
attention without a prior.

Only where no gradient is asked for (inference): the kernel's backward does not return the
mask's gradient Σ_i ∂L/∂s_ij, and the one way to get it from the fused backward — h riding in
one more key dimension — is what the widened operator (``dense.with_parent_terms``) does
forward and backward already; measured, a masked forward with a widened backward saved ~3%
of the time and cost one more activation's memory. The widened operator also serves every
other device and half precision.
"""

from __future__ import annotations

import torch

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def applies(a: torch.Tensor, b: torch.Tensor, u: torch.Tensor, h: torch.Tensor) -> bool:
    """Whether this reading takes these factors: on the CPU, in single or double precision,
    with no gradient asked of any of them."""
    return (a.device.type == "cpu" and a.dtype in (torch.float32, torch.float64)
            and u.dtype == a.dtype
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in (a, b, u, h))))


def key_bias_attention(a, b, u, h, scale: float, is_causal: bool) -> torch.Tensor:
    """``softmax_j(scale·⟨a_i, b_j⟩ + h_j)`` over j ≤ i (``is_causal``) or every j, times u.

    Args:
        a: ``(*lead, C, d_k)`` children's factors; b: ``(*lead, P, d_k)`` parents' factors;
            u: ``(*lead, P, d_v)`` values (the leading dims broadcast).
        h: ``(*lead, P)`` the prior's per-parent term (broadcasts against the leading dims).
        scale: a float (``Operator.fused_factors`` folds a learned one into ``a``).

    Returns ``(*lead, C, d_v)``. No gradient (``applies``)."""
    lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2], u.shape[:-2], h.shape[:-1])
    C, P, d_v = a.shape[-2], b.shape[-2], u.shape[-1]
    width = max(a.shape[-1], d_v)  # the fused kernel takes one width for a, b and u
    if a.shape[-1] < width:
        a, b = (torch.nn.functional.pad(x, (0, width - x.shape[-1])) for x in (a, b))
    if d_v < width:
        u = torch.nn.functional.pad(u, (0, width - d_v))
    heads = lead[-1] if lead else 1
    a, b, u = (x.expand(*lead, *x.shape[-2:]).reshape(-1, heads, *x.shape[-2:])
               for x in (a, b, u))
    mask = h.to(a.dtype).expand(*lead, P).reshape(-1, heads, 1, P)
    out = _flash(a, b, u, 0.0, is_causal, attn_mask=mask, scale=scale)[0]
    out = out if d_v == width else out[..., :d_v]
    return out.reshape(*lead, C, d_v)
