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
certified ≤ ε for every child (``structattn.certificates.certified``: the prior's tail, the
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

from ..certificates.beta import beta_quantile, log_beta
from ..checking._validation import check_positive, checks_on, passes
from ..checking.renamed import refuses_renamed
from ._registry import PriorEntry
from .distance import DistancePrior


def _positive(name, value):
    """A float or a tensor (scalar or ``(heads,)``) of Beta parameters, checked > 0."""
    return check_positive("BetaGeometric prior", name, value)


def _check_options(tol, prior_tol, max_window, block_size) -> None:
    """The prior's options, each refused by name: ``tol`` and ``prior_tol`` in (0, 1), not
    both; ``max_window`` and ``block_size`` ints ≥ 1."""
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
        if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val < 1):
            raise ValueError(f"BetaGeometric prior: {name} must be an int ≥ 1; got {val!r}")


@refuses_renamed
class BetaGeometric(DistancePrior):
    r"""$p(φ_i = d) = B(a + d − 1, b + 1) / B(a, b)$ for the distance $d = i − j ≥ 1$ back from
    child $i$: the geometric–Beta prior of expanding attention (module docstring).

    Strictly the past: the child at position 0 has no parent and gets a zero output. The
    mean-field options (``grad``, ``window_rule``, ``max_iters``, …) are not the prior's (an
    unknown keyword is a ``TypeError``): they belong to
    ``structattn.windows.MeanFieldWindows``, declared on the family. Paper §5.2, SPEC.md
    "Geometric–Beta prior".

    Args:
        a (float | torch.Tensor): the Beta's first parameter, a float or a floating-point
            tensor ``()`` or ``(heads,)``, finite and > 0 (a tensor's values checked while
            validation is on); learnable: gradients flow through ``lgamma`` and ``digamma``.
            Default 1.
        b (float | torch.Tensor): the Beta's second parameter, as ``a``. Default 1.
        tol (float | None): the posterior mass the compiled reading may leave outside its
            window, in (0, 1), certified per child (the trace's ``truncation[family]``
            reports the bound per token); the model, and Pyro's reading, stay the whole past.
            None (default): read all of the past.
        prior_tol (float | None): instead of ``tol``, cut the support where the prior's tail
            P(φ > W) falls below it, in (0, 1) (``discarded_mass``): the model changes, and
            Pyro reads the cut support too. None (default): no cut.
        max_window (int | None): the longest distance on the support, an int ≥ 1. None
            (default): no cap.
        block_size (int): the banded kernel's block of children, an int ≥ 1. Default 32.

    Raises:
        ValueError: ``a`` or ``b`` not finite and > 0 (or a tensor not ``()`` or
            ``(heads,)``), ``tol`` or ``prior_tol`` outside (0, 1), both given, or
            ``max_window`` or ``block_size`` not an int ≥ 1.
    """

    first = 1  # strictly the past: the first token has none (``empty`` "zero")

    def __init__(self, a=1.0, b=1.0, *, tol: float | None = None,
                 prior_tol: float | None = None, max_window: int | None = None,
                 block_size: int = 32):
        self.a, self.b = _positive("a", a), _positive("b", b)
        _check_options(tol, prior_tol, max_window, block_size)
        super().__init__("BetaGeometric prior", causal=True, tol=tol, block_size=block_size)
        self.prior_tol, self.max_window = prior_tol, max_window

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
        return max(self.head_counts().values())

    def head_counts(self):
        """``a``'s and ``b``'s heads, each checked against the family's."""
        return {name: v.numel() if isinstance(v, torch.Tensor) else 1
                for name, v in (("a", self.a), ("b", self.b))}

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

    # -- the DistancePrior contract ---------------------------------------------------------
    def log_at_distance(self, d, dtype=None):
        """log p(φ = d) ``(heads or 1, *d.shape)``, −∞ at d < 1, computed in at least float32
        and returned in ``dtype`` (None: float64). The support's cuts (``window``: the
        ``prior_tol`` quantile, ``max_window``) stay the support's: on it this is the pmf."""
        dtype = torch.float64 if dtype is None else dtype
        pmf = self.log_pmf(d.clamp(min=1), d.device, dtype)
        return pmf.masked_fill(d < 1, float("-inf")).to(dtype)

    def child_offset(self, num_children, num_parents):
        """The children are the last C of the P tokens: child i sits at P − C + i."""
        return num_parents - num_children

    def log_tail_mass(self, width, num_tokens, device, dtype) -> torch.Tensor:
        """log P(φ > width) ``(heads or 1, 1)``: the closed form over every distance."""
        return self.log_tail(width, device, dtype).reshape(-1, 1)

    def check_nodes(self, family, children, parents) -> None:
        """The children are the parents' tokens: all of them, or (fewer children than
        parents) their last C — the distance is read from there; the latter a value check,
        on while validation is."""
        c, p = children.size, parents.size
        if c > p:
            raise ValueError(f"edge family {family!r}: a BetaGeometric prior is over distances "
                             f"back along one sequence, so the children are the parents' tokens "
                             f"(all, or the last C of them); got {c} children and {p} parents")
        if c == p or not checks_on():
            return
        xc, xp = children.states, parents.states
        if xc.shape[-1] != xp.shape[-1] or xc.shape[:-2] != torch.broadcast_shapes(
                xc.shape[:-2], xp.shape[:-2]) or not passes(
                (xc == xp.expand(*xc.shape[:-2], p, xp.shape[-1])[..., p - c:, :]).all()):
            raise ValueError(f"edge family {family!r}: with fewer children ({c}) than parents "
                             f"({p}), a BetaGeometric prior reads the children as the parents' "
                             f"last {c} tokens, but node set {children.name!r} is not "
                             f"{parents.name!r}[..., {p - c}:, :]")

    def hyper_prior(self) -> str:
        """The hyper-prior, as drawn in plate notation."""
        def show(v):
            return f"{v:g}" if isinstance(v, float) else "a" if v is self.a else "b"
        return f"q_i ~ Beta({show(self.a)}, {show(self.b)})\np(φ_i = d | q_i) = (1 − q_i) q_i^(d−1)"

    def short_support(self, num_children: int = 2, num_parents: int = 2) -> str:
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
                     BetaGeometric(max_window=2),
                     BetaGeometric(2.0, 3.0, tol=0.1, block_size=2)] if C <= P else [],
    _formula,
    bad={"a must be finite and > 0": lambda: BetaGeometric(-1.0, 1.0),
         r"tol \(the posterior mass left outside a window\) must be in \(0, 1\)":
         lambda: BetaGeometric(tol=1.5),
         "max_window must be an int ≥ 1": lambda: BetaGeometric(max_window=0)},
    parameters=lambda g: ((torch.rand(2, generator=g, dtype=torch.float64) + 0.5,
                           torch.rand(2, generator=g, dtype=torch.float64) + 0.5),
                          lambda a, b: BetaGeometric(a, b)),
    # a short look-back (E[q] ≈ 0.05): at N = 48 the certified window is 16, not the past
    certified=lambda g: BetaGeometric(torch.tensor([1.0, 2.0], dtype=torch.float64),
                                      torch.tensor([20.0, 30.0], dtype=torch.float64),
                                      tol=1e-2, block_size=8))
