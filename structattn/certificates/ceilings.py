"""Upper bounds on attention scores, for the certificates (``structattn.certificates.certified``,
``structattn.block_sparse``, the mean-field rule in ``structattn.windows``): each bound holds
for the scores as computed — the dot products' rounding charged (γ_k·S, the standard error
bound of a k-term dot product) — so a certificate built on it holds in float32 too.

- ``score_ceiling(a, b, scale)``: per child, |scale|·‖a_i‖·max_j ‖b_j‖ (Cauchy–Schwarz) and
  the rounding slack;
- ``running_ceilings``: its parts for a window's tail — |scale|·‖a_i‖, the slack and the
  keys' running longest length (the mean-field rule's ceiling, in every reading);
- ``key_block_ceilings``: per child and key block, the smallest of three bounds — the
  block's element-wise box, its longest key (the ball), its centre's ball — tight where a
  block's keys cluster;
- ``block_tail_ceilings``: from those, per child and width W, a bound on every score beyond
  W. The proof is in DESIGN ("Certified truncation").
"""

from __future__ import annotations

import math

import torch

#: how many band or block entries a certificate scores at once (float64: 16 MiB)
RUN_ENTRIES = 2**21
#: the least block of keys ``block_tail_ceilings`` bounds at once (longer sequences take
#: longer blocks: at most ``MAX_KEY_BLOCKS`` blocks)
KEY_BLOCK = 32
MAX_KEY_BLOCKS = 64


def score_ceiling(a: torch.Tensor, b: torch.Tensor, scale: float, computed_in=None):
    """``(high, slack)``, each ``(*lead, N)`` float64: ``high`` ≥ every score child i can have,
    S_i = |scale|·‖a_i‖·max_j ‖b_j‖, plus ``slack``, the most a score computed in
    ``computed_in`` (default: the factors' dtype) can be off by (γ_k·S_i, γ_k = k·u/(1 − k·u),
    the error bound of a k-term dot product): a computed log-sum minus the child's slack is a
    lower bound of the true one."""
    with torch.no_grad():
        return ceiling_from_norms(norm64(a), norm64(b), scale, a.shape[-1],
                                  a.dtype if computed_in is None else computed_in)


def norm64(x: torch.Tensor) -> torch.Tensor:
    """An upper bound on ‖x‖ over the last dimension, float64. Float64 factors: computed in
    float64. Others: computed in their own precision and raised by its rounding — the k
    squares and their sum off by at most (k + 1)·u relatively, the square root by u, so
    (1 + 2(k + 2)·u) covers them — and by √k·2⁻⁶³ for the squares that underflow (a square
    under 2⁻¹²⁶ flushed to 0), with no float64 copy of ``x`` (which cost as much as the
    certificate's own checks at N = 2,048)."""
    x = x.detach()
    if x.dtype == torch.float64:
        return torch.linalg.vector_norm(x, dim=-1)
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return torch.linalg.vector_norm(x, dim=-1, dtype=torch.float64)
    k = x.shape[-1]
    u = torch.finfo(x.dtype).eps / 2
    low = torch.linalg.vector_norm(x.float() if x.dtype != torch.float32 else x, dim=-1)
    return low.to(torch.float64) * (1 + 2 * (k + 2) * max(u, 2.0 ** -24)) + math.sqrt(k) * 2.0 ** -63


def ceiling_from_norms(a_norm: torch.Tensor, b_norm: torch.Tensor, scale: float, k: int,
                       dtype: torch.dtype):
    """``score_ceiling`` from the factors' float64 norms ``(*lead, N)`` (``norm64``), ``k``
    their width, the scores computed in ``dtype``."""
    unit = torch.finfo(dtype).eps / 2
    gamma = k * unit / (1 - k * unit)
    ceiling = abs(scale) * a_norm * b_norm.amax(-1, keepdim=True)
    slack = gamma * ceiling + 4 * torch.finfo(dtype).tiny
    return ceiling + slack, slack


def running_ceilings(a: torch.Tensor, b: torch.Tensor, scale: float, computed_in=None):
    """``(reach, slack, run)`` float64, what a window's tail ceiling is made of: per child
    ``reach`` = |scale|·‖a_i‖ and ``score_ceiling``'s ``slack`` ``(*lead, N)``, and the keys'
    running maximum length ``run`` = max_{j' ≤ j} ‖b_j'‖ ``(*lead, P)``. Every parent
    farther back than child i's window W scores at most reach_i·run_{i−W−1} + slack_i (a
    running max: a long key nearby does not weigh on the tail)."""
    with torch.no_grad():
        reach = a.detach().to(torch.float64).norm(dim=-1) * abs(scale)
        run = b.detach().to(torch.float64).norm(dim=-1).cummax(-1).values
        _, slack = score_ceiling(a, b, scale, computed_in)
        return reach, slack, run


def _key_blocks(b: torch.Tensor, key_block: int, low: torch.dtype) -> dict:
    """The keys ``(*lead_b, N, k)`` summarised per block of ``key_block`` tokens, the last one
    possibly shorter: ``hi``/``lo`` ``(*lead_b, k, nb)`` the element-wise max and min in
    ``low`` (exact: a max of representable numbers), ``longest`` ``(*lead_b, nb)`` the longest
    key and ``reach`` the largest |entry|, both float64."""
    n = b.shape[-2]
    keys = b.detach()
    nb = -(-n // key_block)
    full = n // key_block  # the whole blocks; the last, shorter one (if any) on its own
    parts = [keys[..., :full * key_block, :].unflatten(-2, (full, key_block))] if full else []
    if full < nb:
        parts.append(keys[..., full * key_block:, :].unsqueeze(-3))
    hi = torch.cat([t.amax(-2) for t in parts], -2).to(low)  # (*lead_b, nb, k)
    lo = torch.cat([t.amin(-2) for t in parts], -2).to(low)
    wide = torch.float64
    # each block's centre (its keys' mean, rounded to ``low``: the product uses it exactly)
    # and radius, the longest key less the centre (float64, made an upper bound)
    centre = torch.cat([t.to(wide).mean(-2) for t in parts], -2).to(low)  # (*lead_b, nb, k)
    radius = torch.cat([(t.to(wide) - c.to(wide)[..., None, :]).norm(dim=-1).amax(-1)
                        for t, c in zip(parts, _split(centre, parts), strict=True)], -1)
    return {"hi": hi.transpose(-1, -2), "lo": lo.transpose(-1, -2),
            "centre": centre.transpose(-1, -2), "radius": radius * (1 + 1e-12),
            "longest": torch.cat([t.to(wide).norm(dim=-1).amax(-1) for t in parts], -1),
            "reach": torch.maximum(torch.maximum(hi.abs(), lo.abs()), centre.abs()).amax(-1)
            .to(wide)}


def _split(centre: torch.Tensor, parts: list) -> list:
    """``centre (…, nb, k)`` cut as ``parts`` cut the blocks (whole blocks, then the last)."""
    sizes = [t.shape[-3] for t in parts]
    return list(centre.split(sizes, dim=-2))


def _row_ceilings(q: torch.Tensor, blocks: dict) -> torch.Tensor:
    """``(…, rows, nb)`` float64: U_iβ ≥ max_{j∈β} ⟨q_i, b_j⟩ for rows q ``(…, rows, k)`` in
    the products' precision — the smaller of the box bound ⟨q⁺, hi_β⟩ − ⟨q⁻, lo_β⟩ (its
    rounding charged to it) and the ball bound ‖q_i‖·max_{j∈β} ‖b_j‖."""
    wide = torch.float64
    k = q.shape[-1]
    unit = torch.finfo(q.dtype).eps / 2
    gamma = 2 * k * unit / (1 - 2 * k * unit)
    up = 1 + 2 * gamma  # a norm or an absolute sum computed in q's dtype, made an upper bound
    box = (q.clamp(min=0) @ blocks["hi"] - (-q).clamp(min=0) @ blocks["lo"]).to(wide)
    # rounding: two k-term products and their difference, charged on Σ|q_d|·max|key|
    l1 = q.abs().sum(-1, keepdim=True).to(wide) * up
    box = box + (gamma + 4 * unit) * l1 * blocks["reach"][..., None, :]
    norm = q.norm(dim=-1, keepdim=True).to(wide) * up
    ball = norm * blocks["longest"][..., None, :]
    # the centre's ball: ⟨q, b_j⟩ = ⟨q, c_β⟩ + ⟨q, b_j − c_β⟩ ≤ ⟨q, c_β⟩ + ‖q‖·r_β, tight where
    # a block's keys cluster around a point away from the origin
    around = (q @ blocks["centre"]).to(wide) + gamma * l1 * blocks["reach"][..., None, :] \
        + norm * blocks["radius"][..., None, :]
    return torch.minimum(torch.minimum(box, ball), around)


def key_block_ceilings(a: torch.Tensor, b: torch.Tensor, scale: float,
                       key_block: int) -> torch.Tensor:
    """``(*lead, N, nb)`` float64: an upper bound on every score child i can have with a
    parent in key block β (tokens β·key_block …), |scale|·U_iβ (``block_tail_ceilings``
    states the bound and its proof), in runs of children (O(``RUN_ENTRIES``) at once)."""
    n = a.shape[-2]
    with torch.no_grad():
        low = torch.promote_types(a.dtype, torch.float32)  # the products' precision
        q = a.detach().to(low) * (1.0 if scale >= 0 else -1.0)  # exact
        blocks = _key_blocks(b, key_block, low)
        lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        nb = blocks["longest"].shape[-1]
        out = torch.empty(*lead, n, nb, dtype=torch.float64, device=a.device)
        rows = max(1, RUN_ENTRIES // max(1, lead.numel() * nb))
        for r0 in range(0, n, rows):
            r = slice(r0, min(n, r0 + rows))
            out[..., r, :] = _row_ceilings(q[..., r, :], blocks) * abs(scale)
        return out


def block_tail_ceilings(a: torch.Tensor, b: torch.Tensor, scale: float, widths,
                        key_block: int | None = None) -> dict:
    """``{W: S_i(W)}``, each ``(*lead, N)`` float64: an upper bound on every score child i can
    have with a parent farther back than W (j < i − W), from per-block bounds of the keys.

    The keys are cut into blocks β of ``key_block`` tokens, each summarised by the element-
    wise minimum lo_β and maximum hi_β of its keys and its longest key. For j ∈ β, with
    a = sign(scale)·a_i (the score is |scale|·⟨a, b_j⟩),

        ⟨a, b_j⟩ = Σ_d a_d b_jd ≤ Σ_d max(a_d lo_βd, a_d hi_βd) = ⟨a⁺, hi_β⟩ − ⟨a⁻, lo_β⟩,

    term by term (a_d b_jd is linear in b_jd ∈ [lo_βd, hi_βd], so at most its value at an
    end; a⁺ = max(a, 0), a⁻ = max(−a, 0)), and ⟨a, b_j⟩ ≤ ‖a_i‖·max_{j∈β} ‖b_j‖
    (Cauchy–Schwarz), and ⟨a, b_j⟩ = ⟨a, c_β⟩ + ⟨a, b_j − c_β⟩ ≤ ⟨a, c_β⟩ + ‖a_i‖·r_β with
    c_β the keys' mean and r_β the largest distance of a key from it. The smallest of the
    three, U_iβ, bounds the block (the box is tight where keys share a range per dimension,
    the centre's ball where they cluster around a point, the ball where they spread in many
    dimensions). The parents beyond W lie
    in the blocks that start at or before i − W − 1 — a prefix of the blocks — so
    S_i(W) = |scale|·max_{β ≤ ⌊(i−W−1)/key_block⌋} U_iβ: a running maximum over the blocks.
    The first bound is one matrix product in the factors' precision (float32 at least), its
    rounding charged to it: (γ_2k + 4u)·‖a_i‖₁·max_d max(|lo_βd|, |hi_βd|), γ_m = m·u/(1 − m·u)
    the error bound of an m-term dot product, 4u the casts to that precision. Children are
    taken in runs, so memory stays O(``RUN_ENTRIES``)."""
    n = a.shape[-2]
    if key_block is None:
        key_block = max(KEY_BLOCK, -(-n // MAX_KEY_BLOCKS))
    wide = torch.float64
    with torch.no_grad():
        low = torch.promote_types(a.dtype, torch.float32)  # the products' precision
        q = a.detach().to(low) * (1.0 if scale >= 0 else -1.0)  # (*lead_a, N, k), exact
        blocks = _key_blocks(b, key_block, low)
        nb = blocks["longest"].shape[-1]
        lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        pos = torch.arange(n, device=a.device)
        out = {w: torch.empty(*lead, n, dtype=wide, device=a.device) for w in widths}
        rows = max(1, RUN_ENTRIES // max(1, lead.numel() * nb))
        for r0 in range(0, n, rows):
            r = slice(r0, min(n, r0 + rows))
            prefix = _row_ceilings(q[..., r, :], blocks).cummax(-1).values * abs(scale)
            for w in widths:
                beyond = ((pos[r] - w - 1).clamp(min=0) // key_block)  # (rows,)
                idx = beyond.expand(*prefix.shape[:-1])[..., None]
                out[w][..., r] = prefix.expand(*lead, *prefix.shape[-2:]).gather(
                    -1, idx).squeeze(-1)
        return out
