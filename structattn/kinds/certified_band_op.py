"""The CPU's certified band per head as one operator, ``structattn::certified_band``, for
readings without a gradient: the certificate's choice depends on the values (a sample of
children, the band's own log-sums, ``structattn.certificates.certified_read``), so a reading
that makes it in Python cannot be recorded as a plan; inside one operator it can, and the
plan replays the operator, which chooses anew on each call's values — no second reading of
the declaration per call (~1–3 ms at 2,048 tokens: 5–10% of the exact forward)."""

from __future__ import annotations

import torch

from .. import triton_kernels
from ..certificates.certified import CertifiedWindow
from ..certificates.certified_read import certified_band_attention, per_head_choice
from . import certificate_costs
from .key_bias import asks_gradient, band_rows, key_bias_attention


def _whole_past(a, b, u, h, scale):
    return key_bias_attention(a, b, u, h, scale, True)


@torch.library.custom_op("structattn::certified_band", mutates_args=())
def certified_band(a: torch.Tensor, b: torch.Tensor, u: torch.Tensor, h: torch.Tensor,
                   scale: float, eps: float, block: int,
                   widest: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, heads, bound, window)``: ``certified_band_attention`` on the CPU's kernels
    (``key_bias.band_rows``, the whole past through the fused kernel, the CPU's cost rule),
    no gradient; ``heads`` ``(*lead)`` each head's width, ``bound`` and ``window``
    ``(*lead, N)`` each child's bound and smallest certified width (``CertifiedWindow``'s).

    Args:
        a (torch.Tensor): the children's factors (``certified_band_attention``'s).
        b (torch.Tensor): the parents' factors.
        u (torch.Tensor): the values.
        h (torch.Tensor): the prior's per-parent term.
        scale (float): the scores' factor.
        eps (float): the posterior mass each child may leave out.
        block (int): the band's block of children.
        widest (int): the widest band; beyond it, all of the past.
    """
    with torch.no_grad():
        out, choice = certified_band_attention(
            a, b, u, scale, h, eps, block=block, widest=widest, read=band_rows,
            whole_past=_whole_past, pays=certificate_costs.band_pays,
            reject=certificate_costs.band_rejected)
    return out, choice.heads, choice.bound, choice.window


@certified_band.register_fake
def _(a, b, u, h, scale, eps, block, widest):
    lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2], u.shape[:-2], h.shape[:-1])
    n = a.shape[-2]
    return (u.new_empty(*lead, n, u.shape[-1]), a.new_empty(lead, dtype=torch.long),
            a.new_empty(*lead, n, dtype=torch.float64), a.new_empty(*lead, n, dtype=torch.long))


def read_band(a, b, u, h, scale: float, eps: float, block: int):
    """``(out, outcome)``: each head's certified band read — on the CPU without a gradient
    through ``certified_band`` (``outcome`` its ``(heads, bound, window)``), else by
    ``certified_band_attention`` (``outcome`` its ``CertifiedWindow``); ``settle`` makes
    either a ``CertifiedWindow``. The widest band: on the CPU the band kernel's pair costs
    ~1.4× the fused kernel's, so a band of w = x·N (N·w − w²/2 pairs) costs 1.4·(2x − x²)
    of the whole past, ≤ 0.9 up to x = 0.4; the Triton kernel's bands cost what its causal
    reading does per pair, up to half the sequence.

    Args:
        a (torch.Tensor): the children's factors (``certified_band_attention``'s).
        b (torch.Tensor): the parents' factors.
        u (torch.Tensor): the values.
        h (torch.Tensor): the prior's per-parent term.
        scale (float): the scores' factor.
        eps (float): the posterior mass each child may leave out.
        block (int): the band's block of children.
    """
    n = a.shape[-2]
    on_triton = triton_kernels.serves(a, b)
    if not on_triton and not asks_gradient(a, b, u, h):  # one operator: recordable
        out, *outcome = certified_band(a, b, u, h, scale, eps, block, 2 * n // 5)
        return out, tuple(outcome)
    return certified_band_attention(
        a, b, u, scale, h, eps, block=block, widest=n // 2 if on_triton else 2 * n // 5,
        read=None if on_triton else band_rows, whole_past=_whole_past,
        pays=None if on_triton else certificate_costs.band_pays,
        reject=None if on_triton else certificate_costs.band_rejected)


def settle(outcome, eps: float) -> CertifiedWindow:
    """``read_band``'s outcome as a ``CertifiedWindow``."""
    return outcome if isinstance(outcome, CertifiedWindow) else per_head_choice(*outcome, eps)
