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
from torch.utils import _pytree as pytree

from ..checking._validation import check_size
from ..operators import band
from .ceilings import RUN_ENTRIES, block_tail_ceilings, ceiling_from_norms, norm64, score_ceiling


@dataclass
class CertifiedWindow:
    """What certified truncation chose for one family: a width W with B_i(W) ≤ ε per child.

    Returned by ``certify``.

    Attributes:
        width (int): the window every child reads (distances 1..width).
        bound (torch.Tensor): each child's certified upper bound on its posterior mass
            beyond ``width``, ``(*batch, H, N)`` (0 where the width holds its whole past);
            with ``heads``, each child's at its head's width.
        window (torch.Tensor): each child's smallest width of the doubling sequence that
            certified it alone, ``(*batch, H, N)`` long.
        eps (float): the bound asked for.
        skipped (float): the fraction of the N(N − 1)/2 (child, past parent) pairs outside
            ``width`` (with ``heads``, the heads' mean).
        certified (bool): every bound ≤ eps (False only where a ``cap`` stopped the
            doubling first).
        heads (torch.Tensor | None): each head's own width, ``(*batch, H)``, where
            ``certify(per_lead=True)`` gave each head one; else None.
    """

    width: int
    bound: torch.Tensor
    window: torch.Tensor
    eps: float
    skipped: float
    certified: bool
    heads: torch.Tensor | None = None


# a reading returns it beside tensors: a pytree node, so that a plan's graph outputs its
# tensors (``structattn.compiling.replay``)
pytree.register_dataclass(CertifiedWindow)


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


def certify(a: torch.Tensor, b: torch.Tensor, scale: float, prior, eps: float, *,
            start: int = 16, cap: int | None = None, block: int = 32, first: int = 1,
            widest: int | None = None, per_lead: bool = False,
            narrower: bool = True) -> CertifiedWindow:
    """The shortest W in ``start``, 2·``start``, … with B_i(W) ≤ ``eps`` for every child i.

    B_i(W) bounds child i's posterior mass beyond W (module docstring); no gradient flows.

    Args:
        a (torch.Tensor): the children's factors, ``(*batch, H, N, k)``.
        b (torch.Tensor): the parents' factors of the same N tokens, ``(*batch, H, N, k)``
            (leading dimensions broadcast); child i reads parents i − d, ``first`` ≤ d ≤ i.
        scale (float): the scores' factor, s_id = scale·⟨a_i, b_{i−d}⟩.
        prior (DistancePrior): states ``log_weights_on_band`` and ``log_tail_mass`` (a
            ``structattn.priors.DistancePrior``).
        eps (float): the posterior mass a window may leave out, in (0, 1).
        start (int): the sequence's first width; default 16.
        cap (int | None): the widest window; None, the default: the longest past, N − 1.
        block (int): the band's block of children; default 32.
        first (int): the nearest distance read, 1 (j < i, the default) or 0 (j ≤ i).
        widest (int | None): the widest window worth a band: the sequence jumps from the
            last width within it to ``cap``; None, the default: no jump.
        per_lead (bool): give each head a width of its own (a head only all of the past
            certifies no longer holds the others wide); default False.
        narrower (bool): score the width below the one the start's evidence certifies, which
            its own evidence may certify (default True); False: take that width unscored —
            where scoring a band costs more than reading it (the CPU: float64 scores).

    Returns:
        CertifiedWindow: the choice, its bounds and the pairs it skips.

    Raises:
        ValueError: ``eps`` not a number in (0, 1), ``a`` and ``b`` not of the same (N, k),
            or ``first`` neither 0 nor 1.
    """
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
        raise ValueError(f"certify: eps (the posterior mass a window may leave out) must be in "
                         f"(0, 1); got {eps!r}")
    if a.shape[-2:] != b.shape[-2:]:
        raise ValueError(f"certify: a and b must be (…, N, k) factors of the same N tokens; got "
                         f"{tuple(a.shape)} and {tuple(b.shape)}")
    if first not in (0, 1):
        raise ValueError(f"certify: first (the nearest distance a child reads: 0 itself, 1 the "
                         f"token before) must be 0 or 1; got {first!r}")
    n = a.shape[-2]
    last = n - 1 if cap is None else max(1, min(cap, n - 1))
    widths = [max(1, min(start, last))]  # the doubling sequence
    while widths[-1] < last:
        widths.append(min(2 * widths[-1], last))
    if widest is not None:
        widths = [w for w in widths[:-1] if w <= widest] + [last]
    with torch.no_grad():
        if last == n - 1 and len(widths) > 1 and not _ball_possible(
                a.detach(), b.detach(), scale, prior, eps, widths[-2], first, per_lead):
            return all_of_the_past(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]), n, eps,
                                   a.device, per_lead)
        ev = _Evidence(a.detach(), b.detach(), scale, prior, eps, widths, block, first)
        # the longest key beyond the window bounds every score there (Cauchy–Schwarz); where
        # that cannot certify the narrowest width even at the best scores inside, the keys'
        # per-block bounds may (they are tight where keys cluster) — computed only where the
        # keys' range as one block already could (O(N·k)): their cost, about a forward at
        # N = 4,096, is not paid where they cannot help (spread keys, a slow prior)
        first_width = widths[0]
        if last > first_width and not ev.possible(first_width) and ev.possible(
                first_width, block_tail_ceilings(ev.a, ev.b, scale, [first_width], key_block=n)):
            ev.blocked.update(block_tail_ceilings(ev.a, ev.b, scale, widths))
        if per_lead and last == n - 1 and len(widths) > 1:  # the heads that any narrower
            can = torch.stack([(ev.bound(w, ev.best) <= eps).all(-1)  # width may certify
                               for w in widths[:-1]]).any(0)
            if bool(can.any()) and not bool(can.all()):
                ev.active = can
        widths, k, bounds = _choose(ev, widths, last, per_lead, narrower)
        return _chosen(ev, widths, k, bounds, last, per_lead)


def _ball_possible(a, b, scale: float, prior, eps: float, width: int, first: int,
                   per_lead: bool) -> bool:
    """The cheapest bound, O(N·k): whether the best scores inside (I_i ≤ the prior's whole
    weight·e^{S_i}) could certify ``width`` for every child (``per_lead``: for every child of
    some leading index) with the Cauchy–Schwarz ceiling alone. The bound falls with the
    width, so where the widest band below the whole past is not possible, no band is (the
    keys' per-block ceilings are not consulted: where they alone would make a band possible,
    the whole past is read — a valid choice, bound 0)."""
    n, dev, wide = a.shape[-2], a.device, torch.float64
    a_norm, b_norm = norm64(a), norm64(b)
    high, slack = ceiling_from_norms(a_norm, b_norm, scale, a.shape[-1], a.dtype)
    best = prior.log_tail_mass(first - 1, n, dev, wide) + high
    pos = torch.arange(n, device=dev)
    far = (pos - width - 1).clamp(min=0)
    ball = abs(scale) * a_norm * b_norm.cummax(-1).values[..., far] + slack
    ok = (tail_bound(best, prior.log_tail_mass(width, n, dev, wide), ball) <= eps) | (pos <= width)
    return bool(ok.all(-1).any()) if per_lead else bool(ok.all())


def all_of_the_past(lead, n: int, eps: float, device, per_lead: bool) -> CertifiedWindow:
    """The choice of all of the past for every child of ``lead`` (bound 0): where no band is
    possible, or none is worth reading (``certified_read``); ``per_lead``: with each head's
    width."""
    zeros = torch.zeros(*lead, n, dtype=torch.float64, device=device)
    window = torch.full((*lead, n), n - 1, dtype=torch.long, device=device)
    heads = window[..., 0].clone() if per_lead else None
    return CertifiedWindow(n - 1, zeros, window, float(eps), 0.0, True, heads)


def window_bound(a: torch.Tensor, b: torch.Tensor, scale: float, prior, width, *,
                 first: int = 1, block: int = 32) -> torch.Tensor:
    """B_i(``width``) for one given width, no search: each child's certified bound on its
    posterior mass beyond it, ``(*lead, N)`` float64, 0 where the width holds the child's
    whole past. The Cauchy–Schwarz ceiling of the module docstring (not the per-block one),
    the band scored at once. ``width`` may be symbolic — an exported program's runtime
    width (``structattn.export(..., window=W)``) — so nothing here branches on it or on N.

    Args:
        a, b (torch.Tensor): the children's and parents' factors, ``(*batch, H, N, k)``
            (``certify``'s).
        scale (float): the scores' factor.
        prior (DistancePrior): states ``log_weights_on_band`` and ``log_tail_mass``.
        width (int | torch.SymInt): the window, ≥ 1.
        first (int): the nearest distance read, 0 or 1; default 1.
        block (int): the band's block of children; default 32.

    Returns:
        torch.Tensor: the bounds, ``(*lead, N)`` float64 (no gradient).
    """
    with torch.no_grad():
        a, b, wide = a.detach(), b.detach(), torch.float64
        n, dev = a.shape[-2], a.device
        # (what ``running_ceilings`` returns, written out: its own no_grad nested in this one
        # left a set-grad node without metadata in the exported program, which then failed
        # to save)
        _, slack = score_ceiling(a, b, scale)  # (*lead, N)
        lay = band.BandLayout.for_window(n, width, block)
        s = (band.scores(a, b, scale, lay).to(wide)  # (*lead, nb, B, L), −∞ off the window
             + prior.log_weights_on_band(lay, width, first, dev, wide))
        log_in = lay.unblock(torch.logsumexp(s, -1)[..., None])[..., 0] - slack
        pos = torch.arange(n, device=dev)
        far = (pos - width - 1).clamp(min=0)  # the nearest parent beyond the window
        run = b.to(wide).norm(dim=-1).cummax(-1).values  # max_{j ≤ k} ‖b_j‖
        ceiling = abs(scale) * a.to(wide).norm(dim=-1) * run[..., far] + slack
        out = tail_bound(log_in, prior.log_tail_mass(width, n, dev, wide), ceiling)
        return torch.where(pos <= width, torch.zeros_like(out), out)


class _Evidence:
    """What ``certify`` knows of one family's posterior tails: the band's scores at the widths
    scored (``log_inside``), the prior's tails, the score ceilings beyond each width, and the
    bound B_i(W) they give (``bound``); ``active``: the leading indices that must certify
    below all of the past (None: all of them)."""

    def __init__(self, a, b, scale, prior, eps, widths, block, first):
        n, dev, wide = a.shape[-2], a.device, torch.float64
        self.a, self.b, self.scale, self.prior, self.eps = a, b, scale, prior, eps
        self.n, self.block, self.first, self.wide = n, block, first, wide
        self.pos = torch.arange(n, device=dev)
        a_norm, b_norm = norm64(a), norm64(b)
        self.high, self.slack = ceiling_from_norms(a_norm, b_norm, scale, a.shape[-1],
                                                   a.dtype)  # (*batch, H, N)
        # beyond a window W, child i's parents are j < i − W: its ceiling there takes the
        # longest of *those* keys (a running max), not of every key — a long key nearby does
        # not weigh on the tail
        self.a_norm = a_norm  # (*lead_a, N)
        self.b_run = b_norm.cummax(-1).values  # (*lead_b, N): max_{j ≤ k} ‖b_j‖
        self.lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        self.tails = {w: prior.log_tail_mass(w, n, dev, wide) for w in widths}  # (…, N)
        # the prior's whole weight over each child's past (an upper bound): I_i(W) ≤ it·e^{S_i},
        # so ``best`` is the evidence of the best scores inside any window
        self.best = prior.log_tail_mass(first - 1, n, dev, wide) + self.high
        self.blocked: dict = {}  # the per-block ceilings (``block_tail_ceilings``), once needed
        self.active = None

    def log_inside(self, width):
        """log I_i(width), exact but for the rounding slack (a lower bound), ``(*lead, N)``:
        the band's scores at this width, in runs of blocks of ``RUN_ENTRIES`` (the whole
        band at once took 4× causal SDPA's peak memory at N = 16,384)."""
        lay = band.BandLayout.for_window(self.n, width, self.block)
        qa, kb = lay.children(self.a), lay.parents(self.b)  # (*lead, nb, B, k), (…, nb, L, k)
        nb = lay.num_blocks
        step = max(1, RUN_ENTRIES // (self.lead.numel() * lay.block * lay.width))
        runs = []
        for lo in range(0, nb, step):
            run = slice(lo, min(nb, lo + step))
            s = qa[..., run, :, :] @ kb[..., run, :, :].transpose(-1, -2) * self.scale
            s = s.to(self.wide) + self.prior.log_weights_on_band(
                lay, width, self.first, self.a.device, self.wide, blocks=run)  # −∞ outside
            runs.append(torch.logsumexp(s, -1))  # (*lead, run, B)
        return lay.unblock(torch.cat(runs, -2)[..., None])[..., 0] - self.slack

    def tail_ceiling(self, width, ceilings):
        """S_i(W) ≥ every score beyond W, plus the slack."""
        far = (self.pos - width - 1).clamp(min=0)
        ball = abs(self.scale) * self.a_norm * self.b_run[..., far]  # ‖a_i‖·max_{j<i−W} ‖b_j‖
        if width in ceilings:
            ball = torch.minimum(ball, ceilings[width])
        return ball + self.slack

    def bound(self, width, log_in, ceilings=None):
        """B_i(width) from the evidence ``log_in`` (0 where the width holds all the past)."""
        ceilings = self.blocked if ceilings is None else ceilings
        out = tail_bound(log_in, self.tails[width], self.tail_ceiling(width, ceilings))
        return torch.where(self.pos <= width, torch.zeros_like(out), out)  # all of it read

    def among(self, ok):
        """``ok`` ``(*lead, N)`` for the active leading indices only."""
        return ok if self.active is None else ok[self.active]

    def possible(self, width, ceilings=None):
        """Whether the best scores inside could certify ``width``."""
        return bool(self.among(self.bound(width, self.best, ceilings) <= self.eps).all())


def _choose(ev: _Evidence, widths: list, last: int, per_lead: bool, narrower: bool = True):
    """``(widths, k, bounds)``: I_i(W) grows with W, so the evidence of any narrower window
    scored bounds every wider one: score the first width, take the first width its evidence
    certifies (``widths[k]``), and score only the width below that one — unless even the best
    scores could not certify it; ``bounds``: each width's at the end."""
    n = ev.n
    # the bound at the best scores falls with the width: where the widest band below all of
    # the past is not possible, none is (one O(N) check; reading all of the past is always
    # a valid choice, so the rule costs nothing in soundness)
    hopeless = last == n - 1 and (len(widths) == 1 or not ev.possible(widths[-2]))
    if hopeless:  # only all of the past certifies (bound 0): nothing to score
        widths = [last]
    scored = {last: ev.best} if hopeless else {widths[0]: ev.log_inside(widths[0])}
    while True:
        bounds = [ev.bound(w, scored[max(v for v in scored if v <= w)]) for w in widths]
        k = next((k for k, bd in enumerate(bounds) if bool(ev.among(bd <= ev.eps).all())),
                 len(widths) - 1)
        below = widths[k - 1] if k else None
        if below is None or below in scored or not narrower or not ev.possible(below):
            return widths, k, bounds
        if last == n - 1 and (k == len(widths) - 1 or per_lead) and \
                8 * band.BandLayout.for_window(n, below, ev.block).width > n:
            return widths, k, bounds  # against all of the past, scoring so wide a band costs
            # what it saves (with a width per head, against the heads' bands in one call)
        scored[below] = ev.log_inside(below)


def _chosen(ev: _Evidence, widths: list, k: int, bounds: list, last: int,
            per_lead: bool) -> CertifiedWindow:
    """The ``CertifiedWindow`` of the choice: each child's own smallest certified width, and,
    with a width per head, each head's and its children's bounds at it."""
    n, eps = ev.n, ev.eps
    width, bd = widths[k], bounds[k]
    window = torch.full(bd.shape, -1, dtype=torch.long, device=bd.device)
    for w, bw in zip(widths[:k + 1], bounds[:k + 1], strict=True):
        window = torch.where((window < 0) & (bw <= eps), w, window)
    window = torch.where(window < 0, width, window)
    skipped = skipped_pairs(n, width)
    if ev.active is not None:  # the other heads read all of the past (bound 0)
        window = torch.where(ev.active[..., None], window, last)
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
