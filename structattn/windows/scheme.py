"""Mean-field windows: the geometric–Beta prior's inference scheme (expanding attention,
paper §5.2, appendix 7.3; SPEC.md "Geometric–Beta prior").

q(φ_i) q(q_i), each child with its own window W_i; iterate to a fixed point:

    1. E[ln q_i], E[ln(1 − q_i)] under Beta(α_i, β_i) (digamma; or ln E[q] plugged in);
    2. p_t(φ_i = d) ∝ exp(ψ_{i,i−d} + (d − 1) E[ln q_i] + E[ln(1 − q_i)]), 1 ≤ d ≤ W_i;
    3. α_i ← a + E_{p_t}[φ_i] − 1, β_i ← b + 1 (conjugate; or accumulate: α_i ← α_i +
       E[φ_i] − 1, β_i ← β_i + 1, the authors' code);
    4. W_i ← the window rule's next window (``structattn.windows.rules``), capped by the
       child's past, the prior's own window and ``max_window``.

Each round costs O(N·W) (no feature dimension), the value read O(N·W·d_v): the cost follows
the inferred context length, not N. (The exact beta-geometric posterior over a window is a
support kind, ``structattn.kinds.window``; this scheme is its approximation.)

Two implementations of the same equations: ``loop.mean_field``, tensor operations over the
band (any device; the graph for ``grad="unroll"``), and ``kernel.mean_field_compiled``,
which, wherever no graph through the iteration is needed, runs each child's whole iteration
in one call of the compiled kernel (the CPU) or of the Triton solve (CUDA), and reads the
output at the fixed point over each child's own window.

The children may be the last C of the P parent tokens (``layer(x, last=C)``): child i sits
at position P − C + i, and only those C windows are computed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..certificates.beta import log_beta, plug_in_quantile
from ..iterative.scheme import InferenceScheme
from ..kinds.base import Operator
from ..kinds.window import keep_from_position
from ..latent import iteration_overrides
from ..operators import band
from ..priors.beta_geometric import BetaGeometric
from . import kernel, loop
from .rules import WindowRule, as_rule

EXPECTATIONS = ("digamma", "plug_in")
UPDATES = ("conjugate", "accumulate")
GRADS = ("unroll", "last")


class ScoreFactors(NamedTuple):
    """The factorised scores ψ_ij = scale·⟨a_i, b_j⟩ the mean-field iteration reads.

    Attributes:
        a (torch.Tensor): the children's factors, ``(*batch, H, C, k)``.
        b (torch.Tensor): the parents' factors, ``(*batch, H, P, k)``.
        scale (float): the scores' scale (a learnable temperature is folded into ``a``).
    """

    a: torch.Tensor
    b: torch.Tensor
    scale: float


@dataclass(frozen=True)
class MeanFieldWindows(InferenceScheme):
    """The mean-field window scheme's options (module docstring).

    Declared on a family whose prior is ``structattn.priors.BetaGeometric`` with
    ``edges(..., inference=MeanFieldWindows(...))``; its history is reported as
    ``Trace.mean_field[family]`` (a ``MeanFieldHistory``). The options below live here, not
    on the prior (``BetaGeometric(grad=...)`` is a ``TypeError``: the prior only states
    p(φ_i = d)).

    Args:
        tol: the posterior mass a window may leave out, in (0, 1) (the rules' threshold;
            under the default rule, "certified", a proven bound per child, reported in the
            history).
        max_window: an int ≥ 1 that caps every window; None, the default, leaves the cap to
            the child's past and the prior's own window.
        max_iters: the most rounds, an int ≥ 1.
        converge_tol: a finite number > 0: a child settles when
            |ΔE[φ_i]| ≤ converge_tol·max(1, E[φ_i]) and its window stops growing.
        expectation: "digamma" (E[ln q]) or "plug_in" (ln E[q]).
        update: "conjugate" (α_i ← a + E[φ_i] − 1, β_i ← b + 1) or "accumulate"
            (α_i ← α_i + E[φ_i] − 1, β_i ← β_i + 1, the authors' code).
        window_rule: a ``WindowRule`` or the name of a built-in one ("certified",
            "predictive", "edge", "evidence").
        initial_window: the first window, an int ≥ 1 (capped like every window); None,
            the default, takes the prior's tail quantile at tol — at 1/2, its median, under
            the certified rule, which then doubles.
        grad: "unroll" (back-propagate through every round) or "last" (one differentiable
            step from the detached fixed point); ``structattn.iteration(grad=…)`` overrides
            it, as it does every latent's.

    Raises:
        ValueError: when ``expectation``, ``update`` or ``grad`` is not one of its choices,
            ``window_rule`` is neither a ``WindowRule`` nor a built-in name, ``tol`` is not
            a number in (0, 1), ``max_window``, ``max_iters`` or ``initial_window`` is given
            but not an int ≥ 1, or ``converge_tol`` is not a finite number > 0 (bools are
            refused throughout).
    """

    tol: float = 0.05
    max_window: int | None = None
    max_iters: int = 50
    converge_tol: float = 1e-3
    expectation: str = "digamma"
    update: str = "conjugate"
    window_rule: WindowRule | str = "certified"
    initial_window: int | None = None
    grad: str = "unroll"

    trace_field = "mean_field"

    def __post_init__(self):
        object.__setattr__(self, "window_rule", as_rule(self.window_rule))
        for name, choices in (("expectation", EXPECTATIONS), ("update", UPDATES),
                              ("grad", GRADS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"MeanFieldWindows: {name} must be one of {choices}; "
                                 f"got {getattr(self, name)!r}")
        if isinstance(self.tol, bool) or not isinstance(self.tol, (int, float)) \
                or not 0 < self.tol < 1:
            raise ValueError(f"MeanFieldWindows: tol (the tail mass a window may leave out) "
                             f"must be in (0, 1); got {self.tol!r}")
        for name, low in (("max_window", 1), ("max_iters", 1), ("initial_window", 1)):
            val = getattr(self, name)
            if val is not None and (isinstance(val, bool) or not isinstance(val, int)
                                    or val < low):
                raise ValueError(f"MeanFieldWindows: {name} must be an int ≥ {low}; "
                                 f"got {val!r}")
        if isinstance(self.converge_tol, bool) or not isinstance(self.converge_tol, (int, float)) \
                or not (self.converge_tol > 0 and math.isfinite(self.converge_tol)):
            raise ValueError(f"MeanFieldWindows: converge_tol must be a finite number > 0; "
                             f"got {self.converge_tol!r}")

    # -- what the iteration reads ------------------------------------------------------------
    def effective_grad(self) -> str:
        """``grad``, or the one ``structattn.iteration(grad=…)`` sets in this thread."""
        return iteration_overrides().get("grad", self.grad)

    def cap(self, family) -> int:
        """The widest window any child may reach: its past, the prior's own window (a prior
        with ``tol``/``max_window`` truncates its support) and ``max_window``."""
        cap = family.parents.size - 1
        for w in (family.support.width, self.max_window):
            if w is not None:
                cap = min(cap, w)
        return max(1, cap)

    def first_windows(self, a0, b0, cap: int) -> torch.Tensor:
        """Each head's first window ``(H|1,)`` long, before any child's cap: ``initial_window``
        (at most ``cap``), or the prior's tail quantile at the rule's start — the smallest W
        in [1, cap] with P(φ > W) below it (``beta.beta_quantile``'s, read from every W at
        once: a dozen operations where the bisection takes ~180, on the same values of the
        same function), or the plug-in geometric's; no grad."""
        with torch.no_grad():
            if self.initial_window is not None:
                return torch.full(a0.shape, min(self.initial_window, cap), dtype=torch.long,
                                  device=a0.device)
            start = self.window_rule.start_tail or self.tol
            if self.expectation != "digamma":
                return plug_in_quantile(a0, b0, start, cap)
            a0, b0 = a0.detach(), b0.detach()
            w = torch.arange(1, cap + 1, device=a0.device).to(a0.dtype)  # (cap,)
            log_tol = torch.log(torch.tensor(start, dtype=a0.dtype, device=a0.device))
            below = (log_beta(a0[:, None] + w, b0[:, None]) - log_beta(a0, b0)[:, None]) \
                < log_tol
            return torch.where(below.any(-1), below.to(torch.uint8).argmax(-1) + 1, cap)

    def initial_windows(self, a0, b0, lead, n, cap, offset=0):
        """``caps`` ``(offset + N,)`` (the child at position i sees at most min(i, cap)
        parents) and the first windows of the N children at positions offset … offset + N − 1
        ``(*lead, N)``: each head's ``first_windows``, at most the child's cap; no grad."""
        with torch.no_grad():
            caps = torch.arange(offset + n, device=a0.device).clamp(max=cap)
            win0 = torch.minimum(self.first_windows(a0, b0, cap)[:, None].expand(*lead, n),
                                 caps[offset:])
        return caps, win0

    # -- the InferenceScheme contract --------------------------------------------------------
    def check(self, family) -> None:
        if not isinstance(family.prior, BetaGeometric):
            raise ValueError(f"edge family {family.name!r}: MeanFieldWindows infers the "
                             f"geometric–Beta prior's per-child windows; the family's prior is "
                             f"{family.prior.describe()} (use structattn.priors.BetaGeometric, "
                             f"or no inference scheme)")

    def operator(self, family, *, record: bool = False) -> MeanFieldOperator:
        return MeanFieldOperator(family, self, record=record)

    def describe(self) -> str:
        return (f"mean-field windows ({self.expectation}/{self.update}, "
                f"rule {self.window_rule.name}, tol {self.tol:g})")


class MeanFieldOperator(Operator):
    """The family's operator at the mean-field fixed point q(φ_i) q(q_i).

    Built by ``MeanFieldWindows.operator``: ``attend`` and ``dense_posterior`` read the
    mean-field posterior (not the exact softmax the dense twin would give), so ``adjoint``
    and ``mass`` read it too; it has no ``log_partition`` (it cannot join the iteration of
    latent node sets). The compiled kernel solves it where it can, the Python loop otherwise.

    Args:
        family (EdgeFamily): the edge family (its prior a ``BetaGeometric``), with exactly one
            factorised potential ψ = scale·⟨a_i, b_j⟩ (e.g. ``Bilinear``).
        scheme (MeanFieldWindows): the scheme's options.
        record (bool): whether to keep the iteration's ``MeanFieldHistory``; default False.

    Attributes:
        history (MeanFieldHistory | None): the iteration's history; None unless recorded.

    Raises:
        ValueError: when the family has not exactly one factorised potential.
    """

    reading_name = "mean-field windows"

    def __init__(self, family, scheme: MeanFieldWindows, *, record: bool = False):
        super().__init__(family)
        if not self.is_fused():
            raise ValueError(f"edge family {family.name!r}: mean-field windows need exactly one "
                             f"factorised potential (ψ = ⟨a_i, b_j⟩·scale, e.g. Bilinear); got "
                             f"{[type(p).__name__ for p in family.potentials]}")
        factors = ScoreFactors(*self.fused_factors())
        grad = scheme.effective_grad()
        solved = kernel.mean_field_compiled(family, factors, scheme, grad, record)
        if solved is None:
            p, layout, history = loop.mean_field(family, factors, scheme, grad, record)
            off = family.parents.size - family.children.size  # children: the last C tokens
            keep = keep_from_position(family.parents.size, p.device, p.dtype)[off:]

            def attend(u):
                return band.apply(p, u, layout)[..., off:, :] * keep
            solved = (attend, lambda: layout.to_dense(p)[..., off:, :], history)
        self._attend, self._dense_posterior, self.history = solved

    def attend(self, u):
        return self._attend(u)

    def dense_posterior(self):
        return self._dense_posterior()

    def adjoint(self, u):
        return self.dense_posterior().transpose(-1, -2) @ u

    def mass(self):
        return self.dense_posterior().sum(-2).unsqueeze(-1)

    def log_partition(self):
        raise ValueError(f"edge family {self.family.name!r}: mean-field windows have no "
                         f"log-partition to add to a free energy; read the family exactly "
                         f"(no inference scheme)")
