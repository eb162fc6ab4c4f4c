"""The cost model's cheapest evidence for a certified window (``certified_read``, the CPU's
rules in ``structattn.kinds.certificate_costs``): a sample of children scored against all of
their past, and the narrowest width at which their bound, with their exact evidence, holds —
a width no reading of the head narrower than it can certify."""

from __future__ import annotations

import math

import torch

from .ceilings import RUN_ENTRIES, norm64
from .certified import tail_bound


def sampled_widths(a, b, h, scale: float, lead, widths: torch.Tensor, eps: float, *,
                   first: int = 0, table: torch.Tensor | None = None,
                   per_row: int | None = None) -> torch.Tensor:
    """``(G,)``: for each row (head), the narrowest of ``widths`` at which a sample of its
    children would be certified ≤ ``eps`` by their exact evidence (the last width, all of
    the past, where none is): the bound B_i(W) = σ(log T_i(W) + S_i(W) − log I_i(W)) of the
    module docstring with I_i(W) the exact mass inside the window and T_i(W) the prior's
    beyond it. A reading's evidence is at most the exact one, so no reading narrower than
    this width certifies the row: the cost model's cheapest evidence, and a reading's first
    width. ``per_row`` children (default N/1,024, from 4 to 16 and at most ``RUN_ENTRIES``
    scores, spread over the second half of the sequence, the last one included) are scored
    against all of their past: O(G·per_row·N·k), no random draw.

    Args:
        a: ``(*lead, N, k)`` the children's factors (broadcasting).
        b: ``(*lead, N, k)`` the parents' factors (broadcasting).
        h: ``(*lead, N)`` the prior's per-parent term (broadcasting; the per-child term
            cancels), or None with ``table``.
        scale: the scores' factor.
        lead: the rows' leading shape (G rows: its product).
        widths: ``(W,)`` the increasing widths, the last one N − 1.
        eps: the posterior mass a window may leave out.
        first: the nearest distance read, 0 (default: j ≤ i) or 1.
        table: ``(H|1, N)`` the prior's log weight at each distance (a stationary prior's
            ``log_by_distance``), in place of ``h``.
        per_row: how many children to score per row; None (default): as above.
    """
    n = a.shape[-2]
    rows = math.prod(lead)
    count = min(n, per_row or max(4, min(16, n // 1024, RUN_ENTRIES // (rows * n))))
    with torch.no_grad():
        dev = a.device
        kids = torch.tensor(sorted({round(n // 2 + (n - 1 - n // 2) * t / max(1, count - 1))
                                    for t in range(count)}), device=dev)  # (S,)
        count = kids.numel()
        work = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
        a, b = a.detach().to(work), b.detach().to(work)
        s = (a[..., kids, :] @ b.transpose(-1, -2)) * scale  # (*lead, S, N)
        j = torch.arange(n, device=dev)
        far = kids[:, None] - widths - 1  # (S, W): the nearest parent beyond each width
        at = far.clamp(min=0)
        if table is None:  # log Σ_{j ≤ far} e^{h_j}, the prior's weight beyond each width
            prior = h.detach().to(work)[..., None, :]  # (*lead, 1, N)
            weight = _log_cumsum(h).expand(*lead, n)
            log_tail = weight[..., None, :].expand(*lead, count, n).gather(
                -1, at.expand(*lead, -1, -1))
        else:  # Σ over the distances from W + 1 to the child's: (H|1, S, W)
            prior = table.detach().to(work)[:, (kids[:, None] - j).clamp(0, n - 1)]  # (H|1, S, N)
            weight = _log_cumsum(table)  # (H|1, N)
            top = weight[:, kids, None]  # (H|1, S, 1): up to the child's own distance
            below = weight[:, widths.clamp(max=n - 1)][:, None]  # (H|1, 1, W): up to W
            log_tail = top + torch.log1p(-torch.exp(below - top).clamp(max=1.0))
        off = j > kids[:, None] - first  # (S, N): not a parent of the child
        x = (s + prior).masked_fill(off, float("-inf")).expand(*lead, count, n)
        top = x.amax(-1, keepdim=True)
        # Σ_{j' ≤ j} e^{x − top}, each term at least e^{−80} (below, float32's subnormals
        # cost ~10× a normal exp; N·e^{−80} is far below any eps)
        mass = torch.exp((x - top).clamp(min=-80.0)).cumsum(-1, dtype=torch.float64)
        total = mass.gather(-1, (kids[:, None] - first).expand(*lead, -1, -1))  # (…, S, 1)
        beyond = mass.gather(-1, at.expand(*lead, -1, -1)).masked_fill(far < 0, 0.0)
        log_in = torch.log(total - beyond) + top.to(torch.float64)  # (…, S, W)
        run = norm64(b).cummax(-1).values.expand(*lead, n)  # max_{j' ≤ j} ‖b_j'‖
        ceiling = abs(scale) * norm64(a[..., kids, :])[..., None] * run[..., None, :].expand(
            *lead, count, n).gather(-1, at.expand(*lead, -1, -1))  # (*lead, S, W)
        bound = tail_bound(log_in, log_tail, ceiling).masked_fill(far < 0, 0.0)
        ok = (bound <= eps).all(-2)  # (*lead, W)
        ok[..., -1] = True
        return widths[ok.int().argmax(-1)].expand(*lead).reshape(-1)


def last_child_widths(a, b, h, scale: float, lead, widths: torch.Tensor, eps: float, *,
                      first: int = 0, table: torch.Tensor | None = None) -> torch.Tensor:
    """``(G,)``: for each row (head), the narrowest of ``widths`` beyond which the last
    child's exact posterior mass — on its parents j ≤ N − 2 − w — is ≤ ``eps`` (the last
    width, all of the past, where none is). Every certified bound is at least the true mass
    it bounds, so no band of the row narrower than this is certified: the cheapest evidence
    there is, a dozen operations on O(G·N·k).

    Args:
        a: ``(*lead, N, k)`` the children's factors (broadcasting).
        b: ``(*lead, N, k)`` the parents' factors (broadcasting).
        h: ``(*lead, N)`` the prior's per-parent term (broadcasting), or None with ``table``.
        scale: the scores' factor.
        lead: the rows' leading shape (G rows: its product).
        widths: ``(W,)`` the increasing widths, the last one N − 1.
        eps: the posterior mass a band may leave out.
        first: the nearest distance read, 0 (default: j ≤ i) or 1.
        table: ``(H|1, N)`` the prior's log weight at each distance, in place of ``h``.
    """
    n = a.shape[-2]
    with torch.no_grad():
        work = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
        last = a.detach()[..., -1:, :].to(work)  # (*lead, 1, k)
        s = (last @ b.detach().to(work).transpose(-1, -2)).squeeze(-2)  # (*lead, N)
        prior = h.detach() if table is None else table.detach().flip(-1)  # parent j's term
        x = (s.double() * scale + prior.double()).expand(*lead, n).reshape(-1, n)
        if first:
            x[:, n - first:] = float("-inf")
        mass = torch.exp(x - x.amax(-1, keepdim=True)).cumsum(-1)  # (G, N)
        beyond = mass[:, (n - 2 - widths).clamp(min=0)].masked_fill(widths >= n - 1, 0.0)
        ok = beyond <= eps * mass[:, n - 1 - first:n - first]  # (G, W)
        return widths[ok.int().argmax(-1)]


def _log_cumsum(x: torch.Tensor) -> torch.Tensor:
    """log Σ_{j' ≤ j} e^{x_j'} along the last dimension, float64: through exp and cumsum
    below the maximum (``logcumsumexp`` costs ~20× as much), or ``logcumsumexp`` itself
    where a running sum of finite terms starts under e^{−708}."""
    x = x.detach().to(torch.float64)
    top = x.amax(-1, keepdim=True)
    out = torch.exp(x - top).cumsum(-1).log() + top
    underflow = bool((out.isinf() & x.isfinite()).any())  # (a finite term summed to 0)
    return torch.logcumsumexp(x, -1) if underflow else out
