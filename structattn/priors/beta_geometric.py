"""The geometric–Beta prior of expanding attention (paper §5.2, appendix 7.3).

φ_i is a distance back from child i: parent j = i − φ_i, φ_i ≥ 1, and

    q_i ~ Beta(a, b),   p(φ_i = d | q_i) = (1 − q_i) q_i^{d−1}

(q: the probability of looking one step further; every child has its own q, so every
token infers its own context length). Integrating q out gives the beta-geometric pmf

    p(φ_i = d) = B(a + d − 1, b + 1) / B(a, b),   P(φ_i > W) = B(a + W, b) / B(a, b).

The first token has no past: its support is empty and it gets a zero output and an
all-zero posterior row in every reading (``empty="zero"``, fixed). The children may be the
last C of the P parent tokens (C < P: a decoding step, or a loss on the last tokens only):
child i sits at position P − C + i.

Read exactly, one softmax with the beta-geometric log prior over all of the past. With
``tol=ε`` the compiled reading reads a window outside which the *posterior* mass is
certified ≤ ε for every child (``structattn.certified``: the prior's tail, the
largest possible score and the scores inside), through a banded kernel
(``structattn.kinds.window``); the model stays the whole past, which Pyro reads. With
``prior_tol=ε`` (the rule before certification) the support itself is cut where the
*prior's* tail is below ε, whatever the scores say (``discarded_mass()``).
The paper's mean-field reading — a window per child that grows while the posterior needs
it — is an inference scheme declared on the family: ``structattn.edges(..., prior,
inference=structattn.windows.MeanFieldWindows(...))``.
"""

from __future__ import annotations

import torch

from .._validation import check_positive, checks_on, passes
from ..beta import beta_quantile, log_beta
from ..kinds.window import Window
from ._registry import PriorEntry
from .base import Prior
from .tables import PriorTables

#: the mean-field options that moved to ``structattn.windows.MeanFieldWindows``
_SCHEME_OPTIONS = ("inference", "expectation", "update", "max_iters", "converge_tol", "grad",
                   "window_rule", "initial_window")


def _positive(name, value):
    """A float or a tensor (scalar or ``(heads,)``) of Beta parameters, checked > 0."""
    return check_positive("BetaGeometric prior", name, value)


class BetaGeometric(Prior):
    """``p(φ_i = d) = B(a + d − 1, b + 1) / B(a, b)`` for the distance d = i − j ≥ 1 back from
    child i; ``a``, ``b``: floats or tensors ``()`` / ``(heads,)`` (learnable: gradients flow
    through ``lgamma`` / ``digamma``). The child at position 0 has no parent: zero output.

    ``tol`` ∈ (0, 1): the posterior mass the compiled reading may leave outside its window,
    certified per child (the trace's ``truncation[family]`` reports the bound per token);
    ``prior_tol`` ∈ (0, 1): instead cut the support where the prior's tail is below it (the
    model changes: Pyro reads the cut support too); ``max_window`` ≥ 1 caps the support;
    ``block_size``: the banded kernel's block of children. Paper §5.2, SPEC.md
    "Geometric–Beta prior".
    """

    empty = "zero"  # the first token has no past

    def __init__(self, a=1.0, b=1.0, *, tol: float | None = None,
                 prior_tol: float | None = None, max_window: int | None = None,
                 block_size: int = 32, **moved):
        if moved:
            known = sorted(set(moved) & set(_SCHEME_OPTIONS))
            unknown = sorted(set(moved) - set(_SCHEME_OPTIONS))
            if unknown:
                raise TypeError(f"BetaGeometric got unexpected keyword arguments {unknown}")
            raise ValueError(f"BetaGeometric prior: {known} are options of the mean-field "
                             f"inference scheme, not of the prior; declare it on the family: "
                             f"structattn.edges(..., prior, inference=structattn.windows."
                             f"MeanFieldWindows(...))")
        self.a, self.b = _positive("a", a), _positive("b", b)
        for name, val, what in (("tol", tol, "the posterior mass left outside a window"),
                                ("prior_tol", prior_tol, "the prior's tail mass cut off")):
            if val is not None and (isinstance(val, bool) or not isinstance(val, (int, float))
                                    or not 0 < val < 1):
                raise ValueError(f"BetaGeometric prior: {name} ({what}) must be in (0, 1); "
                                 f"got {val!r}")
        if tol is not None and prior_tol is not None:
            raise ValueError(f"BetaGeometric prior: give tol (a certified posterior bound) or "
                             f"prior_tol (a cut of the prior's tail), not both; got tol={tol!r}, "
                             f"prior_tol={prior_tol!r}")
        for name, val in (("max_window", max_window), ("block_size", block_size)):
            if val is not None and (isinstance(val, bool) or not isinstance(val, int)
                                    or val < 1):
                raise ValueError(f"BetaGeometric prior: {name} must be an int ≥ 1; "
                                 f"got {val!r}")
        self.tol, self.prior_tol = tol, prior_tol
        self.max_window, self.block_size = max_window, block_size

    # -- the prior's parameters, per head ---------------------------------------------------
    def params(self, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(a, b)`` as tensors ``(heads or 1,)`` in a dtype of at least float32 precision
        (lgamma in half precision is too coarse)."""
        work = torch.promote_types(dtype, torch.float32)
        a, b = (v.to(device=device, dtype=work).reshape(-1) if isinstance(v, torch.Tensor)
                else torch.full((1,), v, device=device, dtype=work) for v in (self.a, self.b))
        return a, b

    @property
    def heads(self) -> int:
        sizes = [self.a.numel() if isinstance(self.a, torch.Tensor) else 1,
                 self.b.numel() if isinstance(self.b, torch.Tensor) else 1]
        return max(sizes)

    def log_pmf(self, distance: torch.Tensor, device=None, dtype=torch.float64) -> torch.Tensor:
        """log p(φ = d) ``(heads or 1, *distance.shape)`` for integer distances d ≥ 1."""
        a, b = self.params(device or distance.device, dtype)
        d = distance.to(a.dtype)
        a, b = a.reshape(-1, *([1] * d.dim())), b.reshape(-1, *([1] * d.dim()))
        return log_beta(a + d - 1, b + 1) - log_beta(a, b)

    def log_tail(self, window, device=None, dtype=torch.float64) -> torch.Tensor:
        """log P(φ > W) = log B(a + W, b) − log B(a, b), ``(heads or 1,)``."""
        a, b = self.params(device, dtype)
        return log_beta(a + window, b) - log_beta(a, b)

    def log_tail_mass(self, width, num_tokens, device, dtype) -> torch.Tensor:
        """log P(φ > width) ``(heads or 1, 1)``: the closed form over every distance."""
        return self.log_tail(width, device, dtype).reshape(-1, 1)

    def window(self, num_parents: int) -> int | None:
        """The support's window: the smallest W with P(φ > W) < ``prior_tol`` (over heads),
        capped by ``max_window`` and the sequence, or None (all of the past). ``tol``'s
        certified window depends on the scores: the compiled reading chooses it per call."""
        if self.prior_tol is None and self.max_window is None:
            return None
        cap = max(1, num_parents - 1)
        if self.max_window is not None:
            cap = min(cap, self.max_window)
        if self.prior_tol is None:
            return cap
        with torch.no_grad():
            a, b = self.params("cpu", torch.float64)
            w = beta_quantile(a.detach().cpu(), b.detach().cpu(), self.prior_tol, cap)
        return int(w.max())

    def discarded_mass(self, num_parents: int) -> torch.Tensor:
        """The *prior* mass the support's window cuts off for the children farther along than
        it, ``(heads or 1,)``: 0 when the window holds the whole past (nothing is cut). Not a
        bound on the posterior mass left out (``tol``'s certificate is)."""
        w = self.window(num_parents)
        a, _ = self.params("cpu", torch.float64)
        if w is None or w >= num_parents - 1:
            return torch.zeros_like(a)
        return self.log_tail(w, "cpu", torch.float64).exp()

    # -- the Prior contract ----------------------------------------------------------------
    def check_nodes(self, family, children, parents) -> None:
        """Fewer children than parents: the children must be the parents' last C tokens (the
        distance is read from there); a value check, on while validation is."""
        c, p = children.size, parents.size
        if c >= p or not checks_on():
            return  # c > p: the tables' own check says so
        xc, xp = children.states, parents.states
        if xc.shape[-1] != xp.shape[-1] or xc.shape[:-2] != torch.broadcast_shapes(
                xc.shape[:-2], xp.shape[:-2]) or not passes(
                (xc == xp.expand(*xc.shape[:-2], p, xp.shape[-1])[..., p - c:, :]).all()):
            raise ValueError(f"edge family {family!r}: with fewer children ({c}) than parents "
                             f"({p}), a BetaGeometric prior reads the children as the parents' "
                             f"last {c} tokens, but node set {children.name!r} is not "
                             f"{parents.name!r}[..., {p - c}:, :]")

    def tables(self, num_children, num_parents, device) -> PriorTables:
        return BetaGeometricTables(self, num_children, num_parents, device)

    def support(self, num_children, num_parents):
        """1 ≤ d ≤ window for the distance d = (P − C + i) − j: with C < P the children are
        the last C of the P tokens (child i at P − C + i)."""
        return Window(self.window(num_parents), offset=num_parents - num_children)

    def log_weight(self, child, parent, sizes):
        """log p(φ_i = d) at the distance d (outside 1 ≤ d the support excludes the pair)."""
        C, P = sizes
        d = (child + (P - C) - parent).clamp(min=1)
        return self.log_pmf(d, child.device, torch.float64)  # (H|1, *index)

    def log_by_distance(self, window: int, device, dtype) -> torch.Tensor:
        """``(heads or 1, window + 1)``: log p(φ = d) for d = 0..window (−∞ at d = 0)."""
        d = torch.arange(window + 1, device=device)
        table = self.log_pmf(d.clamp(min=1), device, dtype)
        return table.masked_fill(d == 0, float("-inf")).to(dtype)

    def hyper_prior(self) -> str:
        """The hyper-prior, as drawn in plate notation."""
        def show(v):
            return f"{v:g}" if isinstance(v, float) else "a" if v is self.a else "b"
        return f"q_i ~ Beta({show(self.a)}, {show(self.b)})\np(φ_i = d | q_i) = (1 − q_i) q_i^(d−1)"

    def short_support(self) -> str:
        w = "" if self.prior_tol is None and self.max_window is None else ", windowed"
        return f"1 ≤ i − j{w}"

    def describe(self) -> str:
        def show(v):
            if isinstance(v, float):
                return f"{v:g}"
            vals = v.detach().reshape(-1).tolist()
            return ("(" + ", ".join(f"{x:.3g}" for x in vals) + ")" if len(vals) <= 4
                    else f"tensor{tuple(v.shape)}")
        return f"BetaGeometric(a={show(self.a)}, b={show(self.b)}, {self.short_support()})"


class BetaGeometricTables(PriorTables):
    """The generic tables, except that declaring a family checks the heads of ``a`` and ``b``
    instead of building the dense C×P table (the window lowerings never need it)."""

    def validate(self, family: str, *, batch_shape=(), heads: int = 1) -> None:
        for name, v in (("a", self.prior.a), ("b", self.prior.b)):
            h = v.numel() if isinstance(v, torch.Tensor) else 1
            if h not in (1, heads):
                raise ValueError(f"edge family {family!r}: BetaGeometric {name} has {h} entries "
                                 f"(one per head) but the family has heads={heads}; give a "
                                 f"scalar or a tensor of shape ({heads},)")
        if self.num_children > self.num_parents:
            raise ValueError(f"edge family {family!r}: a BetaGeometric prior is over distances "
                             f"back along one sequence, so the children are the parents' tokens "
                             f"(all, or the last C of them); got {self.num_children} children "
                             f"and {self.num_parents} parents")


def _formula(prior, C, P):
    import numpy as np
    from scipy.special import betaln

    a, b = (np.asarray(v.detach().numpy() if isinstance(v, torch.Tensor) else v,
                       dtype=np.float64).reshape(-1, 1, 1) for v in (prior.a, prior.b))
    d = (P - C + np.arange(C))[:, None] - np.arange(P)[None, :]  # children: the last C tokens
    w = betaln(a + d - 1, b + 1) - betaln(a, b)  # log B(a + d − 1, b + 1) / B(a, b)
    cap = P - 1 if prior.max_window is None else min(P - 1, prior.max_window)
    width = None if prior.prior_tol is None and prior.max_window is None else max(cap, 1)
    if prior.prior_tol is not None:  # the smallest W with P(φ > W) < prior_tol, over heads
        tails = [np.exp(betaln(a + W, b) - betaln(a, b)).max() for W in range(1, cap + 1)]
        width = next((W for W, t in enumerate(tails, 1) if t < prior.prior_tol), cap)
    on = (d >= 1) & ((d <= width) if width is not None else True)
    return np.where(on, np.where(d >= 1, w, 0.0), -np.inf)


ENTRY = PriorEntry(
    BetaGeometric,
    lambda C, P, g: [BetaGeometric(1.5, torch.tensor([1.0, 3.0], dtype=torch.float64)),
                     BetaGeometric(2.0, 2.0, prior_tol=0.3),
                     BetaGeometric(max_window=2)] if C <= P else [],
    _formula,
    bad={"a must be finite and > 0": lambda: BetaGeometric(-1.0, 1.0),
         r"tol \(the posterior mass left outside a window\) must be in \(0, 1\)":
         lambda: BetaGeometric(tol=1.5),
         "max_window must be an int ≥ 1": lambda: BetaGeometric(max_window=0)},
    parameters=lambda g: ((torch.rand(2, generator=g, dtype=torch.float64) + 0.5,
                           torch.rand(2, generator=g, dtype=torch.float64) + 0.5),
                          lambda a, b: BetaGeometric(a, b)))
