"""Certified truncation: a window outside which the *posterior* mass left out is provably at
most ε — not only the prior's.

Child i reads the parents at distances d = first..i (first = 1: j < i, as the beta-geometric
prior; 0: j ≤ i, as ALiBi, a forget gate or a generalised Gaussian) with unnormalised prior
weights w_i(d) (the prior's ``log_weights_on_band``) and scores s_id = scale·⟨a_i, b_{i−d}⟩.
The posterior mass beyond a window W is

    M_i(W) = O / (I + O),   I = Σ_{d ≤ W} w_i(d) e^{s_id},   O = Σ_{W < d ≤ i} w_i(d) e^{s_id}.

With O ≤ T_i(W)·e^{S_i}, T_i(W) ≥ Σ_{W < d ≤ i} w_i(d) the prior's weight beyond the window
(``log_tail_mass``) and S_i ≥ max_{d > W} s_id — Cauchy–Schwarz gives
S_i(W) = |scale|·‖a_i‖·max_{j < i − W} ‖b_j‖, the longest key farther back than the window
(a running max), and where that cannot certify, the keys' per-block bounds give a tighter one
(``block_tail_ceilings``: each block's element-wise range, tight where keys cluster) — and
u ↦ u/(I + u) increasing,

    M_i(W) ≤ B_i(W) = σ(log T_i(W) + S_i − log I_i(W)),

a bound from the prior's tail, the largest possible score and the scores inside the
window, decreasing in W: a strong match far back is never hidden behind a light prior tail
(the prior-tail rule, ``BetaGeometric(prior_tol=…)``, bounds only P(φ > W) whatever the
scores say). Any prior works — the bound needs no monotonicity — but it only pays where the
prior's weight falls with the distance. ``certify`` chooses one window shared by every
child (the banded kernel's) from the doubling sequence start, 2·start, …: the shortest whose
B_i ≤ ε for every child, or the longest past. Since I_i grows with W, the evidence of a
narrower window bounds every wider one's certificate: it scores the band at the start
width, takes the first width that evidence certifies (the tails T_i are O(N) each), and
scores the width just below it, which its own evidence may certify — skipped where even
the best scores could not (I_i ≤ the prior's whole weight times e^{S_i}), or where the
choice is all of the past and that band is wider than an eighth of the sequence (scoring it
would cost about what it could save). Two band scorings at most, the larger half the chosen
width: O(N·W·k) time, O(N·W) memory, under half a banded forward. ``widest`` caps the
sequence (the window operator: a band wider than half the sequence reads more pairs than the
causal kernel). The scores are computed in the factors' dtype and the dot products' rounding is
charged to the bound (γ_k·S_i, the standard error bound of a k-term dot product), so the
certificate holds in float32 too; the prior's weights are read in float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import band
from ._validation import check_size

#: how many band entries ``certify`` scores at once (float64: 16 MiB)
RUN_ENTRIES = 2**21


@dataclass
class CertifiedWindow:
    """What certified truncation chose for one family: ``width``, the window every child
    reads (distances 1..width); per child ``(*batch, H, N)``: ``bound``, the certified upper
    bound on its posterior mass beyond ``width`` (0 where the width holds its whole past),
    and ``window``, the smallest width of the doubling sequence that certified it alone;
    ``eps`` the bound asked for; ``skipped``: the fraction of the N(N − 1)/2 (child, past
    parent) pairs outside ``width``; ``certified``: every bound ≤ eps (False only where a
    ``max_window`` cap stopped the doubling first). ``heads`` ``(*batch, H)``: where each
    head reads a width of its own (``certify(per_lead=True)``), that width — then ``bound``
    is each child's at its head's width and ``skipped`` the heads' mean; else None."""

    width: int
    bound: torch.Tensor
    window: torch.Tensor
    eps: float
    skipped: float
    certified: bool
    heads: torch.Tensor | None = None


def tail_bound(log_inside: torch.Tensor, log_tail: torch.Tensor,
               max_score: torch.Tensor) -> torch.Tensor:
    """B = σ(log P(φ > W) + S − log I): the certified bound on the posterior mass beyond a
    window, from the log mass inside it (log I), the prior's log tail beyond it and an upper
    bound S on the scores beyond it (all broadcast)."""
    return torch.sigmoid(log_tail + max_score - log_inside)


def skipped_pairs(n: int, width: int) -> float:
    """The fraction of the N(N − 1)/2 (child, past parent) pairs farther back than ``width``."""
    total = n * (n - 1) / 2
    if total == 0:
        return 0.0
    w = min(width, n - 1)
    read = w * (w + 1) / 2 + (n - 1 - w) * w  # Σ_i min(i, w)
    return 1.0 - read / total


def score_ceiling(a: torch.Tensor, b: torch.Tensor, scale: float):
    """``(high, slack)``, each ``(*lead, N)`` float64: ``high`` ≥ every score child i can have,
    S_i = |scale|·‖a_i‖·max_j ‖b_j‖, plus ``slack``, the most a score computed in the factors'
    dtype can be off by (γ_k·S_i, γ_k = k·u/(1 − k·u), the error bound of a k-term dot
    product): a computed log-sum minus the child's slack is a lower bound of the true one."""
    with torch.no_grad():
        k = a.shape[-1]
        unit = torch.finfo(a.dtype).eps / 2
        gamma = k * unit / (1 - k * unit)
        ceiling = (abs(scale) * a.detach().to(torch.float64).norm(dim=-1)
                   * b.detach().to(torch.float64).norm(dim=-1).amax(-1, keepdim=True))
        slack = gamma * ceiling + 4 * torch.finfo(a.dtype).tiny
        return ceiling + slack, slack


#: the least block of keys ``block_tail_ceilings`` bounds at once (longer sequences take
#: longer blocks: at most ``MAX_KEY_BLOCKS`` blocks)
KEY_BLOCK = 32
MAX_KEY_BLOCKS = 64


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


def certify(a: torch.Tensor, b: torch.Tensor, scale: float, prior, eps: float, *,
            start: int = 16, cap: int | None = None, block: int = 32, first: int = 1,
            widest: int | None = None, per_lead: bool = False) -> CertifiedWindow:
    """The shortest window of the sequence ``start``, 2·``start``, … (at most ``cap``, the
    longest past by default) whose certified posterior tail is ≤ ``eps`` for every child.

    ``a``: child factors ``(*batch, H, N, k)``, ``b``: parent factors of the same N tokens
    (child i reads parents i − d, ``first`` ≤ d ≤ i); ``scale``: the scores' factor;
    ``prior``: states ``log_weights_on_band`` and ``log_tail_mass`` (``structattn.priors.
    Prior``; a stationary prior by its ``log_by_distance`` alone); ``block``: the band's
    block of children; ``widest``: the widest window worth a band — the sequence jumps from
    the last width within it to the longest past, which needs no scoring when it is the
    whole past (no ``cap``): every bound is 0 there. ``per_lead``: for a reading that gives
    each leading index (head) a window of its own (``window.amax(-1)``, a band per head on
    the GPU): a head that only all of the past certifies (ALiBi's slow head) reads all of it
    and the others are still certified narrow, where otherwise it would hold them all; the
    shared ``width`` is then the longest past, ``bound`` each child's at its head's width and
    ``skipped`` the heads' mean."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
        raise ValueError(f"certify: eps (the posterior mass a window may leave out) must be in "
                         f"(0, 1); got {eps!r}")
    if a.shape[-2:] != b.shape[-2:]:
        raise ValueError(f"certify: a and b must be (…, N, k) factors of the same N tokens; got "
                         f"{tuple(a.shape)} and {tuple(b.shape)}")
    if first not in (0, 1):
        raise ValueError(f"certify: first (the nearest distance a child reads: 0 itself, 1 the "
                         f"token before) must be 0 or 1; got {first!r}")
    n, dev = a.shape[-2], a.device
    last = n - 1 if cap is None else max(1, min(cap, n - 1))
    widths = [max(1, min(start, last))]  # the doubling sequence
    while widths[-1] < last:
        widths.append(min(2 * widths[-1], last))
    if widest is not None:
        widths = [w for w in widths[:-1] if w <= widest] + [last]
    wide = torch.float64
    pos = torch.arange(n, device=dev)
    with torch.no_grad():
        a, b = a.detach(), b.detach()
        high, slack = score_ceiling(a, b, scale)  # (*batch, H, N)
        # beyond a window W, child i's parents are j < i − W: its ceiling there takes the
        # longest of *those* keys (a running max), not of every key — a long key nearby does
        # not weigh on the tail
        a_norm = a.to(wide).norm(dim=-1)  # (*lead_a, N)
        b_run = b.to(wide).norm(dim=-1).cummax(-1).values  # (*lead_b, N): max_{j ≤ k} ‖b_j‖
        lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        tails = {w: prior.log_tail_mass(w, n, dev, wide) for w in widths}  # broadcast (…, N)
        # the prior's whole weight over each child's past (an upper bound): I_i(W) ≤ it·e^{S_i}
        log_total = prior.log_tail_mass(first - 1, n, dev, wide)

        def log_inside(width):
            """log I_i(width), exact but for the rounding slack (a lower bound), ``(*lead, N)``:
            the band's scores at this width, in runs of blocks of ``RUN_ENTRIES`` (the whole
            band at once took 4× causal SDPA's peak memory at N = 16,384)."""
            lay = band.BandLayout.for_window(n, width, block)
            qa, kb = lay.children(a), lay.parents(b)  # (*lead, nb, B, k), (*lead, nb, L, k)
            nb = lay.num_blocks
            step = max(1, RUN_ENTRIES // (lead.numel() * lay.block * lay.width))
            runs = []
            for lo in range(0, nb, step):
                run = slice(lo, min(nb, lo + step))
                s = qa[..., run, :, :] @ kb[..., run, :, :].transpose(-1, -2) * scale
                s = s.to(wide) + prior.log_weights_on_band(lay, width, first, dev, wide,
                                                           blocks=run)  # −∞ outside
                runs.append(torch.logsumexp(s, -1))  # (*lead, run, B)
            return lay.unblock(torch.cat(runs, -2)[..., None])[..., 0] - slack

        blocked: dict = {}  # the per-block ceilings (``block_tail_ceilings``), once needed

        def tail_ceiling(width, ceilings):  # S_i(W) ≥ every score beyond W, plus the slack
            far = (pos - width - 1).clamp(min=0)
            ball = abs(scale) * a_norm * b_run[..., far]  # ‖a_i‖·max_{j < i − W} ‖b_j‖
            if width in ceilings:
                ball = torch.minimum(ball, ceilings[width])
            return ball + slack

        def bound(width, log_in, ceilings=blocked):
            out = tail_bound(log_in, tails[width], tail_ceiling(width, ceilings))
            return torch.where(pos <= width, torch.zeros_like(out), out)  # all of it read

        active = None  # the leading indices that must certify below all of the past (None: all)

        def among(ok):  # ``ok`` (*lead, N) for the active leading indices only
            return ok if active is None else ok[active]

        def possible(width, ceilings=blocked):  # whether the best scores inside could certify
            return bool(among(bound(width, log_total + high, ceilings) <= eps).all())

        # the longest key beyond the window bounds every score there (Cauchy–Schwarz); where
        # that cannot certify the narrowest width even at the best scores inside, the keys'
        # per-block bounds may (they are tight where keys cluster) — computed only where the
        # keys' range as one block already could (O(N·k)): their cost, about a forward at
        # N = 4,096, is not paid where they cannot help (spread keys, a slow prior)
        first_width = widths[0]
        if last > first_width and not possible(first_width) and possible(
                first_width, block_tail_ceilings(a, b, scale, [first_width], key_block=n)):
            blocked.update(block_tail_ceilings(a, b, scale, widths))

        # I_i(W) grows with W, so the evidence of any narrower window scored bounds every wider
        # one: score the first width, take the first width its evidence certifies, and score
        # only the width below that one — unless even the best scores could not certify it
        if per_lead and last == n - 1 and len(widths) > 1:  # the heads that any narrower
            can = torch.stack([(bound(w, log_total + high) <= eps).all(-1)  # width may certify
                               for w in widths[:-1]]).any(0)
            if bool(can.any()) and not bool(can.all()):
                active = can
        hopeless = last == n - 1 and not any(possible(w) for w in widths[:-1])
        if hopeless:  # only all of the past certifies (bound 0): nothing to score
            widths = [last]
        scored = {last: log_total + high} if hopeless else {widths[0]: log_inside(widths[0])}
        while True:
            bounds = [bound(w, scored[max(v for v in scored if v <= w)]) for w in widths]
            k = next((k for k, bd in enumerate(bounds) if bool(among(bd <= eps).all())),
                     len(widths) - 1)
            below = widths[k - 1] if k else None
            if below is None or below in scored or not possible(below):
                break
            if last == n - 1 and (k == len(widths) - 1 or per_lead) and \
                    8 * band.BandLayout.for_window(n, below, block).width > n:
                break  # against all of the past, scoring so wide a band costs what it saves
                # (with a width per head, against the heads' bands read in one kernel call)
            scored[below] = log_inside(below)
        width, bd = widths[k], bounds[k]
        window = torch.full(bd.shape, -1, dtype=torch.long, device=dev)
        for w, bw in zip(widths[:k + 1], bounds[:k + 1], strict=True):
            window = torch.where((window < 0) & (bw <= eps), w, window)
        window = torch.where(window < 0, width, window)
        skipped = skipped_pairs(n, width)
        if active is not None:  # the other heads read all of the past (bound 0)
            window = torch.where(active[..., None], window, last)
            width, bd = last, bounds[-1]
        heads = None
        if per_lead:  # each head reads its own width: its children's bounds at it
            own = window.amax(-1, keepdim=True)
            for w, bw in zip(widths, bounds, strict=True):
                bd = torch.where(own == w, bw, bd)
            heads = own[..., 0]
            skipped = sum(skipped_pairs(n, w) for w in heads.flatten().tolist()) / heads.numel()
    ok = bool((bd <= eps).all())
    return CertifiedWindow(width, bd, window, float(eps), skipped, ok, heads)


def certificate_option(owner: str, certificate, tol) -> str:
    """``certificate`` checked: ``"window"`` (one band back from each child, ``certify``) or
    ``"blocks"`` (the key blocks each block of children needs, wherever they lie, per head:
    ``structattn.block_sparse``), the latter with a ``tol``; a ValueError names ``owner``."""
    if certificate not in ("window", "blocks"):
        raise ValueError(f"{owner}: certificate must be 'window' or 'blocks'; got "
                         f"{certificate!r}")
    if certificate == "blocks" and tol is None:
        raise ValueError(f"{owner}: certificate='blocks' reads the key blocks certified for a "
                         f"tol; give tol (e.g. 1e-4)")
    return certificate


def window_options(owner: str, tol, block_size, causal: bool) -> tuple[float | None, int]:
    """``(tol, block_size)`` of a distance prior over the past, checked: ``tol`` None (read
    the whole past) or in (0, 1), the posterior mass a certified window may leave out;
    ``block_size`` the band's block of children, an int ≥ 1; and, since a certified window
    reads back from each child, ``tol`` only with j ≤ i (``causal``). A ValueError names
    ``owner`` otherwise."""
    if tol is not None and (isinstance(tol, bool) or not isinstance(tol, (int, float))
                            or not 0 < tol < 1):
        raise ValueError(f"{owner}: tol (the posterior mass a certified window may leave out) "
                         f"must be None or in (0, 1); got {tol!r}")
    block_size = check_size(owner, "block_size", block_size)
    if tol is not None and not causal:
        raise ValueError(f"{owner}: tol (a certified window back from each child) needs the "
                         f"causal support j ≤ i; got causal=False with tol={tol!r}")
    return None if tol is None else float(tol), block_size
