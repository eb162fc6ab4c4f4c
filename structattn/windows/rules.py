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

from ..beta import beta_quantile, plug_in_quantile
from .scores import BandScores, tail


@dataclass
class Round:
    """What a rule sees for the children of the blocks a round updates (``(k, B)`` each):
    their ``window``, E[ln q] (``e_ln_q``, of the posterior just computed), the Beta
    parameters ``alpha``, ``beta`` the update gives next, and ``caps``; ``scores``, ``rows``:
    the band and its blocks (None: all); ``tol``, ``expectation``, ``cap`` (the largest
    window any child may reach): the scheme's options."""

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
    past: torch.Tensor | None = None  # (k, B) long: each child's parents (None: ``caps``)


class WindowRule:
    """A window-growth rule; a subclass states ``grow`` and its kernel ``code``."""

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
    """Grow to the posterior predictive's tail quantile at tol while the tail beyond the
    window is ≥ tol."""

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
    """Double while the evidence puts more than tol on the window's outer half."""

    code, name = 1, "edge"

    def grow(self, r):
        return _doubled(r, r.scores.outer_evidence(r.rows, r.window))


class EvidenceRule(WindowRule):
    """Double while the posterior mass beyond the window (unseen parents at the window's
    typical likelihood) exceeds tol."""

    code, name = 2, "evidence"

    def grow(self, r):
        return _doubled(r, r.scores.beyond_mass(r.rows, r.window, r.e_ln_q, r.caps))


class CertifiedRule(WindowRule):
    """Double while the certified bound on the posterior mass beyond the window, over the
    child's whole past, exceeds tol (it stops at the cap, reporting the bound it reached)."""

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
