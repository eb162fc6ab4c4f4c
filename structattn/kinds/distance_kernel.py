"""A log prior −|(i − j − μ)·e^s|^β (the generalised Gaussian) computed per block of scores.

``out_i = Σ_j softmax_j(scale·⟨a_i, b_j⟩ − |(i − j − μ_h)·e^{s_h}|^{β_h}) u_j`` over j ≤ i
(``causal``) or every j. The prior is neither a difference of per-token terms (the key-bias
kernels') nor cheap as a table: the dense reading adds it as a ``(heads, C, P)`` bias, 4 GiB
in float32 at C = P = 16,384 and four heads. The Triton kernel
(``structattn.triton_kernels.generalised_gaussian``) computes it inside each block of scores
from the pairs' distances and the head's (μ, s, β), in float32 (float64 for float64 inputs),
with the gradients of μ, s and β as well as of the factors: O((C + P)·d) memory. It serves on
CUDA, and on the CPU inside ``triton_kernels.on_cpu()`` under the interpreter (the tests);
elsewhere the prior's table does.
"""

from __future__ import annotations

import torch

from .. import kernels, triton_kernels
from ..checking._validation import is_exporting


def applies(a: torch.Tensor, b: torch.Tensor, u: torch.Tensor) -> bool:
    """Whether the kernel reads these factors (over j ≤ i or every parent, what it masks: the
    caller's to say): the Triton kernels serve them and the kernels are on (not in an
    exported program, which must run without structattn)."""
    return (b.shape[-2] > 0 and triton_kernels.serves(a, b, u) and kernels._enabled()
            and not (is_exporting() or torch.compiler.is_exporting()))


def distance_kernel_attention(a, b, u, shape, scale: float, is_causal: bool,
                              window: torch.Tensor | None = None) -> torch.Tensor:
    """``softmax_j(scale·⟨a_i, b_j⟩ − |(i − j − μ)·e^s|^β)`` over j ≤ i (``is_causal``) or
    every j, times u, child i at position i among the parents.

    Args:
        a: ``(*lead, C, d_k)`` children's factors; b: ``(*lead, P, d_k)`` parents' factors;
            u: ``(*lead, P, d_v)`` values (the leading dims broadcast, the last one the heads).
        shape: ``(μ, s, β)``, each a tensor ``()`` or ``(heads,)`` (``Prior.distance_shape``).
        scale: a float (``Operator.fused_factors`` folds a learned one into ``a``).
        window: ``(*lead)`` ints, with ``is_causal``: each leading index's children read
            i − window ≤ j ≤ i only (a band per head).

    Returns ``(*lead, C, d_v)`` in u's dtype; differentiable in a, b, u, μ, s and β."""
    from ..triton_kernels.generalised_gaussian import forward

    if window is not None and not is_causal:
        raise ValueError("distance_kernel_attention: a window per leading index needs "
                         "is_causal=True; got is_causal=False")
    lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2], u.shape[:-2])
    C, d_v = a.shape[-2], u.shape[-1]
    dtype = torch.promote_types(torch.promote_types(a.dtype, b.dtype), u.dtype)
    flat = [x.expand(*lead, *x.shape[-2:]).reshape(-1, *x.shape[-2:]).to(dtype)
            for x in (a, b, u)]  # (G, n, width)
    stat = torch.float64 if dtype == torch.float64 else torch.float32
    prior = torch.stack([t.to(device=a.device, dtype=stat).expand(lead) for t in shape],
                        -1).reshape(-1, 3)  # (G, 3): each row's (μ, s, β)
    if window is not None:
        window = window.expand(lead).reshape(-1).to(torch.int32)
    out = forward(*flat, prior, float(scale), is_causal, window)[0]
    return out.reshape(*lead, C, d_v).to(u.dtype)
