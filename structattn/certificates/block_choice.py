"""The key blocks a block of children reads (``structattn.block_sparse.certify_blocks``): score
ceilings rank the earlier blocks, those that may matter are scored exactly, and the fewest are
kept whose complement holds a posterior mass certified ≤ ε for every child of the block.

Child i's posterior is softmax_j(h_j + s_ij) over j ≤ i; a key block β holds the unnormalised
mass Z_iβ = Σ_{j∈β} e^{h_j + s_ij}. Two upper bounds on log Z_iβ:

- the ceiling T_iβ = log Σ_{j∈β} e^{h_j} + S_iβ, S_iβ ≥ every s_ij there (the keys' box, ball
  and centred ball, ``ceilings.key_block_ceilings``): the prior summed exactly, the scores
  bounded once per block;
- the block scored: its log mass computed, one (k + 1)-term product per pair in the
  products' precision, with the rounding of the products, exponentials and sums charged
  (``_score``): E⁺ ≥ log Z_iβ ≥ E⁻.

The own block's mass, computed less its slack, is a lower bound I⁰_i. Per child block, its
earlier blocks are ranked by max_i T_iβ − I⁰_i and scored in that order, in rounds (each at
most doubling those scored), until the unscored rest leaves a bound ≤ ``UNSCORED_SHARE``·ε
against the mass known: I⁰ plus E⁻ of the blocks scored. Then the blocks are ranked again by
w_β = max_i U_iβ − log Z⁻_i, U = min(T, E⁺) (T where unscored) and Z⁻_i that known mass, and
the longest prefix in increasing w is skipped for which every child's

    B_i = σ(log Σ_{β skipped} e^{U_iβ} − log(e^{I⁰_i} + Σ_{β read, scored} e^{E⁻_iβ})) ≤ ε,

the certificate of ``block_sparse``: M_i = O/(I + O) ≤ O⁺/(I⁻ + O⁺) as u ↦ u/(I + u) grows.
"""

from __future__ import annotations

import math

import torch

from .ceilings import RUN_ENTRIES, key_block_ceilings

__all__ = ["block_ceilings", "choose_blocks", "in_blocks", "scores_needed"]

#: the share of ε the unscored blocks' ceilings may take (the rest: scored blocks skipped)
UNSCORED_SHARE = 0.5
#: the least exponent a scored term is computed at (e^FLOOR ≈ 1.8e-35: above float32's
#: subnormals, whose exponentials are slow)
FLOOR = -80.0


def in_blocks(x: torch.Tensor, nb: int, L: int, fill: float = 0.0) -> torch.Tensor:
    """``(G, N, …)`` → ``(G, nb, L, …)``, padded at the end with ``fill``."""
    pad = nb * L - x.shape[1]
    if pad:
        x = torch.cat([x, x.new_full((x.shape[0], pad, *x.shape[2:]), fill)], 1)
    return x.unflatten(1, (nb, L))


def choose_blocks(A, B, hh, slack, scale, eps, L, nb, sel):
    """``(count (G, |sel|), order (G, |sel|, nb), bound (G, |sel|·L))`` for the child blocks
    ``sel``: each reads the first ``count`` of ``order`` (its earlier key blocks, most needed
    first) and its own; ``bound`` its children's B_i (module docstring). ``A``, ``B``
    ``(G, N, k)`` in the products' precision, ``hh`` ``(G, N)`` and ``slack`` ``(G, nb·L)``
    float64; in runs of child blocks, O(``RUN_ENTRIES``) entries at once."""
    G, n, _ = A.shape
    Ab, Bb, hb = in_blocks(A, nb, L), in_blocks(B, nb, L), in_blocks(hh, nb, L, float("-inf"))
    ops = {**_operands(Ab, Bb, hb, scale), "Ab": Ab, "Bb": Bb, "hb": hb, "B": B,
           "slack": slack, "n": n}
    step = max(1, RUN_ENTRIES // max(1, G * L * nb))
    out = [_choose(ops, scale, eps, L, nb, sel[i:i + step]) for i in range(0, sel.numel(), step)]
    return tuple(torch.cat(parts, 1) for parts in zip(*out, strict=True))


def block_ceilings(rows: torch.Tensor, B: torch.Tensor, hb: torch.Tensor, scale: float,
                   L: int) -> torch.Tensor:
    """``(G, R, nb)`` float64: the ceiling T of each child of ``rows`` ``(G, R, k)`` in each
    key block of ``B`` ``(G, N, k)``, ``hb`` ``(G, nb, L)`` the prior's terms in blocks: the
    scores' bound (``key_block_ceilings``) plus the prior summed exactly, log Σ_{j∈β} e^{h_j}
    — what ``choose_blocks`` ranks and scores by."""
    return key_block_ceilings(rows, B, scale, L) + hb.logsumexp(-1)[:, None, :]


def scores_needed(T: torch.Tensor, known: torch.Tensor, eps: float) -> torch.Tensor:
    """``(…,)`` long: the fewest key blocks, by decreasing ceiling ``T`` ``(…, nb)`` (log;
    −∞ where none), ``choose_blocks`` scores for a child whose known log mass is ``known``
    ``(…,)`` before the blocks left unscored hold at most UNSCORED_SHARE·ε of it: with
    ``known`` the child's exact log mass, the least its scoring can cost."""
    ranked = T.sort(-1, descending=True).values
    return (_tails(ranked) > (known + _logit(eps))[..., None]).sum(-1)


def _tails(ranked: torch.Tensor) -> torch.Tensor:
    """``(…, nb + 1)``: [m] the log of the ceilings' sum over ranks ≥ m (−∞ at m = nb)."""
    none = ranked.new_full((*ranked.shape[:-1], 1), float("-inf"))
    return torch.cat([ranked.flip(-1).logcumsumexp(-1).flip(-1), none], -1)


def _logit(eps: float) -> float:
    """log(s / (1 − s)), s = UNSCORED_SHARE·ε: a tail over it is σ(tail − known) > s."""
    return math.log(UNSCORED_SHARE * eps / (1 - UNSCORED_SHARE * eps))


def _choose(ops, scale, eps, L, nb, sel):
    """``choose_blocks`` for one run of child blocks ``sel`` (``ops``: the blocks, the
    scoring's operands)."""
    own, To, rank = _ceilings(ops, scale, L, nb, sel)
    hi, lo = _scored(ops, own, To, rank, eps, L, sel)
    return _keep(own, torch.minimum(To, hi), lo, rank, eps, L, sel, ops["n"])


def _ceilings(ops, scale, L, nb, sel):
    """``(own (G, R), To (G, R, nb), rank (G, S, nb))``: each child's own-block log mass less
    its slack (a lower bound), the ceilings T of its earlier key blocks (−∞ elsewhere) in the
    order ``rank`` of each child block: by decreasing max_i T_iβ − own_i."""
    inf = float("inf")
    Ab, Bb, hb, slack, n = ops["Ab"], ops["Bb"], ops["hb"], ops["slack"], ops["n"]
    dev = Ab.device
    S = sel.numel()
    rows = (sel[:, None] * L + torch.arange(L, device=dev)).flatten()  # (R,)
    own = _own_mass(Ab[:, sel], Bb[:, sel], hb[:, sel], scale).flatten(1) - slack[:, rows]
    earlier = ((torch.arange(nb, device=dev)[None, :] < sel.repeat_interleave(L)[:, None])
               & (rows < n)[:, None])  # (R, nb)
    T = block_ceilings(Ab[:, sel].flatten(1, 2), ops["B"], hb, scale, L)
    T = T.masked_fill(~earlier, -inf)  # (G, R, nb)
    rank = _by_rows(T - own[..., None], S, L).sort(dim=-1, descending=True, stable=True).indices
    return own, T.gather(-1, rank.repeat_interleave(L, 1)), rank


def _scored(ops, own, To, rank, eps, L, sel):
    """``(hi, lo)`` ``(G, R, nb)``, ranked: E⁺, E⁻ of the blocks scored (+∞, −∞ elsewhere).
    Rounds score, per child block, the next ranks by decreasing ceiling — at most as many as
    scored so far, plus one — until the unscored rest leaves a bound ≤ UNSCORED_SHARE·ε
    against the mass known (own block, E⁻ of the blocks scored)."""
    G, R, nb = To.shape
    S = sel.numel()
    tail = _tails(To)  # [m]: ranks ≥ m
    hi = torch.full((G, S, L, nb + 1), float("inf"), dtype=To.dtype, device=To.device)
    lo = torch.full((G, S, L, nb + 1), float("-inf"), dtype=To.dtype, device=To.device)
    m = torch.zeros(G, S, dtype=torch.long, device=To.device)  # ranks scored
    logit = _logit(eps)
    while True:
        known = torch.logaddexp(own, lo.flatten(1, 2).logsumexp(-1))  # (G, R)
        over = tail > (known + logit)[..., None]  # σ(tail − known) > UNSCORED_SHARE·ε
        need = over.view(G, S, L, nb + 1).any(2).sum(-1)  # (G, S): fits from there on
        if bool((need <= m).all()):
            return hi[..., :nb].flatten(1, 2), lo[..., :nb].flatten(1, 2)
        to = torch.where(need > m, torch.minimum(need, 2 * m + 1), m)
        _score(ops, rank, m, to, sel, L, hi, lo)
        m = to


def _keep(own, U, lo, rank, eps, L, sel, n):
    """``(count, order, bound)``: per child block, the fewest blocks kept, by decreasing
    w_β = max_i U_iβ − log Z⁻_i, whose complement certifies (module docstring)."""
    G, R, nb = U.shape
    S = sel.numel()
    none = U.new_full((G, R, 1), float("-inf"))
    known = torch.logaddexp(own, lo.logsumexp(-1))  # (G, R)
    up = _by_rows(U - known[..., None], S, L).sort(dim=-1, stable=True).indices  # increasing w
    at = up.repeat_interleave(L, 1)
    skipped = torch.cat([none, U.gather(-1, at).logcumsumexp(-1)], -1)  # [j]: ranks < j
    read = torch.cat([lo.gather(-1, at).flip(-1).logcumsumexp(-1).flip(-1), none], -1)
    bounds = torch.sigmoid(skipped - torch.logaddexp(own[..., None], read))  # (G, R, nb + 1)
    ok = (bounds <= eps).view(G, S, L, nb + 1).all(2)  # (G, S, nb + 1)
    j = ok.long().cumprod(-1).sum(-1) - 1  # the longest prefix skipped (j = 0: none)
    bound = bounds.gather(-1, j.repeat_interleave(L, 1)[..., None]).squeeze(-1)
    rows = (sel[:, None] * L + torch.arange(L, device=U.device)).flatten()
    order = rank.gather(-1, up.flip(-1))  # ranks → blocks, most needed first
    return nb - j, order, bound.masked_fill(~(rows < n), 0.0)


def _by_rows(x: torch.Tensor, S: int, L: int) -> torch.Tensor:
    """``(G, S·L, nb)`` → ``(G, S, nb)``: the largest over each child block's rows."""
    return x.unflatten(1, (S, L)).amax(2)


def _own_mass(Ac, Bc, hc, scale) -> torch.Tensor:
    """``(G, S, L)`` float64: each child's log mass in its own block (j ≤ i), as computed."""
    L = Ac.shape[-2]
    s = (Ac @ Bc.transpose(-1, -2)).to(torch.float64) * scale + hc[..., None, :]
    r = torch.arange(L, device=Ac.device)
    return s.masked_fill(r[None, :] > r[:, None], float("-inf")).logsumexp(-1)


def _operands(Ab, Bb, hb, scale) -> dict:
    """The scoring's operands: ``q`` ``(G, nb, L, k + 1)`` = [scale·a_i, 1] and ``kh`` =
    [b_j, h_j] in the products' precision (x̃_ij = ⟨q_i, kh_j⟩ one product per pair), and
    ``err`` ``(G, nb, L)`` float64, the most x̃_ij is off by (``_score``)."""
    wide = torch.float64
    low = Ab.dtype
    k = Ab.shape[-1]
    u = torch.finfo(low).eps / 2
    gamma = (k + 1) * u / (1 - (k + 1) * u)
    h = hb.masked_fill(hb == float("-inf"), 0.0)  # padding keys: never scored
    q = torch.cat([Ab * scale, torch.ones_like(Ab[..., :1])], -1)
    kh = torch.cat([Bb, h.to(low)[..., None]], -1)
    M = (abs(scale) * Ab.to(wide).norm(dim=-1) * Bb.to(wide).norm(dim=-1).amax((1, 2))[
        :, None, None] + h.abs().amax((1, 2))[:, None, None]) * (1 + 8 * u)
    return {"q": q, "kh": kh, "err": (gamma + 5 * u) * 1.01 * M}


def _score(ops, rank, m0, m1, sel, L, hi, lo) -> None:
    """Writes E⁺ and E⁻ of the ranks m0 … m1 − 1 of each child block (``(G, S)`` each) into
    ``hi`` and ``lo`` ``(G, S, L, nb + 1)`` (the last column: a sink), in runs of
    ``RUN_ENTRIES`` scores.

    Each term's exponent is one (k + 1)-term product x̃ = ⟨[fl(scale·a_i), 1], [b_j, fl(h_j)]⟩
    in the products' precision (unit u), less r, the largest of its block's; with
    M_i ≥ |scale|·‖a_i‖·max‖b_j‖ + max|h_j|, x̃ is within (γ_{k+1} + 2u)·M_i of
    scale·⟨a_i, b_j⟩ + h_j (the casts charged), x̃ − r within 2.02·u·M_i more; e^x within 4u
    relatively and a sum of L of them within (L + 4)·u·1.01; an exponent below ``FLOOR`` is
    raised to it (its term off by at most 1.01·e^FLOOR, a normal number in float32), and the
    sum is ≥ 1 (its largest term is e⁰)."""
    wide = torch.float64
    q, kh, err = ops["q"], ops["kh"], ops["err"]
    nb = rank.shape[-1]
    dev = q.device
    u = torch.finfo(q.dtype).eps / 2
    # a block's sum of e^x within (L + 4)·u·1.01 relatively and 1.01·L·e^FLOOR absolutely,
    # ≥ 1: its log within these (1e-12: the float64 log's own rounding)
    rel = (L + 4) * u * 1.01 + 1.01 * L * math.exp(FLOOR)
    up, down = math.log1p(rel) + 1e-12, -math.log1p(-rel) + 1e-12
    g_idx, s_idx = (m1 > m0).nonzero(as_tuple=True)
    width = (m1 - m0)[g_idx, s_idx]
    by = width.argsort(descending=True)  # runs of similar widths
    g_idx, s_idx, width = g_idx[by], s_idx[by], width[by]
    at = 0
    while at < g_idx.numel():
        w = int(width[at])
        p = max(1, RUN_ENTRIES // (L * L * w))
        g, s, mw = (t[at:at + p] for t in (g_idx, s_idx, width))
        step = torch.arange(w, device=dev)
        live = step[None, :] < mw[:, None]  # (p, w)
        ranks = (m0[g, s][:, None] + step).clamp(max=nb - 1)
        blocks = rank[g[:, None], s[:, None], ranks]  # (p, w)
        keys = kh[g[:, None], blocks].flatten(1, 2)  # (p, w·L, k + 1)
        x = (q[g, sel[s]] @ keys.transpose(-1, -2)).unflatten(-1, (w, L))  # (p, L, w, L)
        r = x.amax(-1, keepdim=True)  # (p, L, w, 1): each block's largest
        # (p, L, w): log Σ e^{x − r} (the sum ≥ 1: its largest term is e⁰), plus r
        # (exponents below FLOOR raised to it: no subnormal exponentials, slow on CPUs)
        mid = x.sub_(r).clamp_(min=FLOOR).exp_().sum(-1).to(wide).log_() \
            .add_(r.squeeze(-1).to(wide))
        e = err[g, sel[s]][..., None]  # (p, L, 1)
        where = torch.where(live, ranks, nb)[:, None, :].expand(-1, mid.shape[1], -1)
        hi[g, s] = hi[g, s].scatter(-1, where, mid + (e + up))
        lo[g, s] = lo[g, s].scatter(-1, where, mid - (e + down))
        at += p


def skipped_pairs(count: torch.Tensor, nb: int) -> float:
    """The fraction of (child block, earlier key block) pairs not read, given ``count``
    ``(G, nb)`` the earlier blocks each child block reads."""
    earlier = nb * (nb - 1) / 2
    return 0.0 if earlier == 0 else 1 - float(count.sum()) / (count.shape[0] * earlier)

