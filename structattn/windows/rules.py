"""Window rules: how a child's window W_i grows between mean-field rounds (it never shrinks).

A rule is a small object: ``grow(round)`` gives the next windows of the children a round
updates (the Python loop), and ``code`` names the same rule in the compiled kernel
(``csrc/mean_field_windows.cpp``, ``enum Rule``). Built in:

- ``PredictiveRule()``: W_i ← the smallest W with the posterior predictive tail P(φ_i > W) < tol
  (never below W_i): a window grows only while the posterior predicts mass beyond it;
- ``EdgeRule()``: W_i ← 2 W_i while the evidence alone (softmax of ψ over the window, the prior
  left out) puts more than tol on the window's outer half d > W_i/2;
- ``EvidenceRule()``: W_i ← 2 W_i while the posterior, extended beyond the window with the
  unseen parents' likelihood set to the window's typical one, puts more than tol beyond
  it (``BandScores.beyond_mass``).
- ``CertifiedRule()`` (the default): W_i ← 2 W_i while a certified upper bound on the
  φ-update's mass beyond the window, over all of the child's past, exceeds tol — the
  unseen parents at the largest score they could have (``BandScores.certified_mass``), so
  a strong match far back is never left out because the prior's tail is light.

Every rule stops at the child's cap C_i (its past, or ``max_window``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..certificates.beta import beta_quantile, plug_in_quantile
from .scores import BandScores, tail


@dataclass
class Round:
    """What a rule sees of one mean-field round: the children of the blocks it updates.

    The loop builds one per round and hands it to ``WindowRule.grow``; the per-child tensors
    are ``(k, B)``, k blocks of B children each.

    Attributes:
        scores (BandScores): the band's scores ψ over the current windows.
        rows (torch.Tensor | None): the band blocks the round updates, long; None: all.
        window (torch.Tensor): each child's current window W_i, ``(k, B)`` long.
        e_ln_q (torch.Tensor): E[ln q_i] under the posterior just computed, ``(k, B)``.
        alpha (torch.Tensor): the Beta parameter α_i the update gives next, ``(k, B)``.
        beta (torch.Tensor): the Beta parameter β_i the update gives next, ``(k, B)``.
        caps (torch.Tensor): each child's cap C_i, ``(k, B)`` long.
        tol (float): the scheme's ``tol``, in (0, 1).
        expectation (str): the scheme's ``expectation``, "digamma" or "plug_in".
        cap (int): the largest window any child may reach.
        past (torch.Tensor | None): each child's number of parents, ``(k, B)`` long; None,
            the default: ``caps``.
    """

    scores: BandScores
    rows: torch.Tensor | None
    window: torch.Tensor
    e_ln_q: torch.Tensor
    alpha: torch.Tensor
    beta: torch.Tensor
    caps: torch.Tensor
    tol: float
    expectation: str
    cap: int
    past: torch.Tensor | None = None


class WindowRule:
    """A window-growth rule: W_i ← ``grow(round)``, never below W_i nor above C_i.

    A subclass states ``grow`` (the Python loop) and its ``code`` (the compiled kernel's
    ``enum Rule``); an instance is passed as ``MeanFieldWindows(window_rule=...)``. Rules
    take no constructor arguments and compare equal by type.

    Attributes:
        code (int | None): the rule's number in the compiled kernel; None: the kernel cannot
            run it (the Python loop does).
        start_tail (float | None): the prior tail quantile the first window sits at; None:
            the scheme's ``tol``.
        name (str): the rule's name, as ``window_rule`` accepts it for a built-in rule.
    """

    #: the rule's number in the compiled kernel (None: the kernel cannot run it)
    code: ClassVar[int | None] = None
    #: the prior tail quantile the first window sits at (None: the scheme's tol)
    start_tail: ClassVar[float | None] = None
    name: ClassVar[str] = "rule"

    def grow(self, r: Round) -> torch.Tensor:
        """The next windows ``(k, B)`` long, ≥ ``r.window`` and ≤ ``r.caps``."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def __eq__(self, other) -> bool:
        return type(self) is type(other)

    def __hash__(self) -> int:
        return hash(type(self))


def _doubled(r: Round, outer: torch.Tensor) -> torch.Tensor:
    """W ← min(2W, C) where ``outer`` > tol and W < C."""
    return torch.where((outer > r.tol) & (r.window < r.caps),
                       torch.minimum(2 * r.window, r.caps), r.window)


class PredictiveRule(WindowRule):
    """W_i ← the smallest W ≥ W_i with P(φ_i > W) < tol under the posterior predictive.

    A window grows, straight to the predictive's tail quantile at tol (at most C_i), only
    while the predictive puts mass ≥ tol beyond it.

    Attributes:
        code (int): 0, its number in the compiled kernel.
        name (str): "predictive".
    """

    code, name = 0, "predictive"

    def grow(self, r):
        need = (tail(r.alpha, r.beta, r.window, r.expectation) >= r.tol) & (r.window < r.caps)
        if not bool(need.any()):
            return r.window
        quantile = beta_quantile if r.expectation == "digamma" else plug_in_quantile
        idx = need.nonzero(as_tuple=True)
        out = r.window.clone()
        out[idx] = torch.minimum(quantile(r.alpha[idx], r.beta[idx], r.tol, r.cap), r.caps[idx])
        return out


class EdgeRule(WindowRule):
    """W_i ← min(2 W_i, C_i) while softmax(ψ) over the window puts > tol on d > W_i/2.

    The evidence alone (the prior left out) decides: a window doubles while the scores put
    more than tol on its outer half.

    Attributes:
        code (int): 1, its number in the compiled kernel.
        name (str): "edge".
    """

    code, name = 1, "edge"

    def grow(self, r):
        return _doubled(r, r.scores.outer_evidence(r.rows, r.window))


class EvidenceRule(WindowRule):
    """W_i ← min(2 W_i, C_i) while the posterior mass beyond the window exceeds tol.

    The unseen parents beyond the window are given the window's typical likelihood
    (``BandScores.beyond_mass``).

    Attributes:
        code (int): 2, its number in the compiled kernel.
        name (str): "evidence".
    """

    code, name = 2, "evidence"

    def grow(self, r):
        return _doubled(r, r.scores.beyond_mass(r.rows, r.window, r.e_ln_q, r.caps))


class CertifiedRule(WindowRule):
    """W_i ← min(2 W_i, C_i) while a certified bound on the mass beyond W_i exceeds tol.

    The bound covers the child's whole past, the unseen parents at the largest score they
    could have (``BandScores.certified_mass``); the rule stops at the cap, reporting the
    bound it reached. The default rule of ``MeanFieldWindows``; its first window is the
    prior's median (``start_tail`` 1/2), which it then doubles.

    Attributes:
        code (int): 3, its number in the compiled kernel.
        name (str): "certified".
        start_tail (float): 0.5.
    """

    code, name = 3, "certified"
    # start at the prior's median and double: starting at its tail quantile at a small tol
    # would read far more than the certificate needs (on the long-sequence benchmark at
    # tol 1e-4, 1,308 tokens a window against 187)
    start_tail = 0.5

    def grow(self, r):
        past = r.caps if r.past is None else r.past
        return _doubled(r, r.scores.certified_mass(r.rows, r.window, r.e_ln_q, past))


#: the built-in rules by name (``MeanFieldWindows(window_rule="edge")`` reads this)
RULES = {rule.name: rule
         for rule in (CertifiedRule(), PredictiveRule(), EdgeRule(), EvidenceRule())}


def as_rule(rule) -> WindowRule:
    """A ``WindowRule``, or the name of a built-in one."""
    if isinstance(rule, WindowRule):
        return rule
    if isinstance(rule, str) and rule in RULES:
        return RULES[rule]
    raise ValueError(f"MeanFieldWindows: window_rule must be a structattn.windows.WindowRule or "
                     f"one of {tuple(RULES)}; got {rule!r}")
