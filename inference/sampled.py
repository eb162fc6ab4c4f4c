"""The sampled checks' statistics: S posterior draws against the compiled posterior q, each
entry as a |z| (a two-sided p-value π read as |z| = −Φ⁻¹(π/2)), so that one Bonferroni
threshold serves every entry.

- Edge frequencies: the count n_ij of draws with φ_i = j against Binomial(S, q_ij), an exact
  two-sided test (no normal approximation, which fails for rare edges).
- E[output]: the Monte-Carlo mean against the compiled output μ, in standard errors of the
  deviations d_s = o_s − μ (their second moment is Var[o] when μ = E[o]). Draws under-represent
  a posterior whose mass sits on a few parents: the variance is scaled by how much more spread
  q has than the draws' frequencies (Gini–Simpson 1 − Σ_j q_j² over 1 − Σ_j f_j²), and a row
  whose draws all chose one parent can reach at most |z| = √(S·U/(1 − U)), U the compiled mass
  of the parents no draw chose — the |z| of the least spread posterior that puts U on them and
  moves the mean by the observed difference.
"""

from __future__ import annotations

import torch


def z_threshold(m: int, alpha: float = 0.01) -> float:
    """Bonferroni: the |z| an entry may reach when m entries are tested at family-wise α."""
    return float(torch.special.ndtri(torch.tensor(1 - alpha / (2 * max(m, 1)),
                                                  dtype=torch.float64)))


def _as_z(pvalue: torch.Tensor) -> torch.Tensor:
    """A two-sided p-value as |z|: π = 1 → 0, π = 0 → inf."""
    return -torch.special.ndtri((pvalue / 2).clamp(0.0, 0.5))


def binomial_z(counts: torch.Tensor, q: torch.Tensor, S: int) -> torch.Tensor:
    """Exact two-sided binomial test per entry, as |z|: n ~ Binomial(S, q), the p-value the
    mass of every count no more likely than n.

    Args:
        counts (torch.Tensor): n, draws per entry (any shape).
        q (torch.Tensor): the compiled probability per entry (same shape).
        S (int): the number of draws.

    Returns:
        torch.Tensor: |z| per entry (float64, the shape of ``counts``).
    """
    q = q.detach().double().clamp(0.0, 1.0).unsqueeze(-1)
    k = torch.arange(S + 1, dtype=torch.float64, device=q.device)  # (S+1,)
    log_pmf = (torch.lgamma(torch.tensor(S + 1.0, dtype=torch.float64, device=q.device))
               - torch.lgamma(k + 1) - torch.lgamma(S - k + 1)
               + torch.xlogy(k, q) + torch.xlogy(S - k, 1 - q))  # (..., S+1)
    seen = log_pmf.gather(-1, counts.long().unsqueeze(-1))  # (..., 1)
    pvalue = torch.where(log_pmf <= seen + 1e-7, log_pmf.exp(), 0.0).sum(-1).clamp(max=1.0)
    return _as_z(pvalue)


def edge_z(q: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Edge frequencies against the compiled posterior, exact binomial |z| per edge.

    Args:
        q (torch.Tensor): compiled p(φ_i = j | x), ``(*batch, H, C, P)``.
        idx (torch.Tensor): drawn parents, ``(S, *batch, H, C)`` (P: no parent).

    Returns:
        torch.Tensor: |z| per edge, ``(*batch, H, C, P)``.
    """
    P = q.shape[-1]
    counts = torch.nn.functional.one_hot(idx, P + 1)[..., :P].sum(0)
    return binomial_z(counts, q, idx.shape[0])


def _rows(q: torch.Tensor, idx: torch.Tensor):
    """Per (*batch, H, C) row, the spread ratio (1 − Σq²)/(1 − Σf²) and the unseen mass U."""
    P = q.shape[-1]
    q = q.detach().double()
    q_full = torch.cat([q, (1 - q.sum(-1, keepdim=True)).clamp_min(0)], -1)  # P: no parent
    freq = torch.nn.functional.one_hot(idx, P + 1).double().mean(0)
    g_known = 1 - q_full.pow(2).sum(-1)
    g_drawn = 1 - freq.pow(2).sum(-1)
    ratio = torch.where(g_known <= 1e-12, torch.ones_like(g_known),
                        g_known / g_drawn.clamp_min(0))  # inf: one parent drawn
    unseen = (q_full * (freq == 0)).sum(-1)
    return ratio, unseen  # (*batch, H, C)


def output_z(outputs: torch.Tensor, compiled: torch.Tensor, posteriors: dict, edges: dict,
             atol: float = 0.0) -> torch.Tensor:
    """E[output] by samples against the compiled output, |z| per entry (see the module).

    Args:
        outputs (torch.Tensor): the program's output per draw, ``(S, *out)``.
        compiled (torch.Tensor): the compiled output μ, ``(*out)``.
        posteriors (dict): per family, compiled p(φ_i = j | x), ``(*batch, H, C, P)``.
        edges (dict): per family, drawn parents ``(S, *batch, H, C)``.
        atol (float): differences within it are rounding, not tested; default 0.

    Returns:
        torch.Tensor: |z| per output entry, ``(*out)``.
    """
    S = outputs.shape[0]
    d = outputs.detach().double() - compiled.detach().double()  # (S, *out)
    diff = (d.mean(0).abs() - atol).clamp_min(0)
    second = d.pow(2).mean(0)  # Var[o] under μ = E[o]
    rows = compiled.shape[:-1]
    ratio = torch.ones(rows, dtype=torch.float64, device=d.device)
    unseen = torch.zeros(rows, dtype=torch.float64, device=d.device)
    spread = []
    for k in posteriors:
        if k in edges:
            r, u = _rows(posteriors[k], edges[k])  # per head, or over heads the worst
            spread.append((r, u) if _broadcasts(r.shape, rows)
                          else (r.amax(-2), u.sum(-2).clamp(max=1.0)))
    aligned = [(r, u) for r, u in spread if compiled.dim() >= 1
               and _broadcasts(r.shape, rows)]
    if aligned:  # output rows are children: their own families' spread
        for r, u in aligned:
            ratio = torch.maximum(ratio, r.expand(rows))
            unseen = (unseen + u.expand(rows)).clamp(max=1.0)
    elif spread:  # otherwise the most under-represented row of any family
        ratio = ratio * max((float(r.amax()) for r, _ in spread), default=1.0)
        unseen = unseen + min(1.0, sum(float(u.amax()) for _, u in spread))
    ratio, unseen = ratio.unsqueeze(-1), unseen.unsqueeze(-1)
    z = diff / (second * torch.where(ratio.isinf(), 1.0, ratio.clamp_min(1.0)) / S).sqrt()
    z = torch.where(diff > 0, z, torch.zeros_like(z))
    bound = (S * unseen / (1 - unseen).clamp_min(1e-300)).sqrt()
    return torch.where(ratio.isinf(), torch.minimum(z, bound), z)


def _broadcasts(shape, target) -> bool:
    try:
        return torch.broadcast_shapes(shape, target) == torch.Size(target)
    except RuntimeError:
        return False
