"""Stick-breaking over the past (Tan et al., ICLR 2025): each child scans back from i − 1 and
takes the first parent it breaks at, p(φ_i = j) = σ(ψ_ij) Π_{j<l<i} σ(−ψ_il)."""

from __future__ import annotations

import torch

from ..kinds.base import grid
from ..kinds.dense import Before
from ._registry import PriorEntry
from .base import Prior


class StickBreaking(Prior):
    r"""An edge-choice process, not a softmax: child $i$ scans its parents back from $i − 1$ and
    at each parent $l$ breaks with probability $β_{il} = σ(ψ_{il})$ — $ψ$ being the family's one
    potential, read as a break logit — unless it broke nearer. So

    $$
    p(φ_i = j) = β_{ij} \prod_{j<l<i} (1 − β_{il}) \quad (j < i), \qquad
    p(\text{no parent}) = \prod_{l<i} (1 − β_{il}),
    $$

    and "no parent" (value zero) keeps the leftover mass: outputs are $\sum_j p_{ij} v_j$, rows
    summing to one minus it (``trace.leftover[family]``). A constant β is the geometric
    prior over distance with $q = 1 − β$, truncated at the sequence's start.

    Pyro's reading (the oracle) states the scan as written: φ_i is one of its i + 1 outcomes
    (parents j < i, or none) a priori alike, and the factor is the log-probability of the
    scan's Bernoulli break decisions that choosing φ_i means — passed every parent between,
    broke at φ_i (none: passed them all). Those probabilities sum to one over the outcomes,
    so the posterior is the scan's distribution. The compiled reading
    (``structattn.kinds.stick_breaking``) is the CPU kernel, forward and backward, or the
    dense reverse cumulative sum of softplus.

    Children are the first C tokens of the parents (self-attention over a sequence).

    Args:
        tol (float | None): the kernel stops a child's scan once the stick it has left is
            ≤ tol, a number in [0, 1): a certified bound on the posterior mass it does not
            read, since everything further back weighs less than the stick together; 0 reads
            every pair (Pyro's reading and the dense reading scan the whole past). None
            (default): 2⁻¹⁰ of the dtype's epsilon, under rounding.

    Raises:
        ValueError: ``tol`` neither None nor a number in [0, 1).
    """

    empty = "zero"  # the first child has no parent before it: zero value
    leftover = True
    max_potentials = 1

    def __init__(self, *, tol: float | None = None):
        if tol is not None and (isinstance(tol, bool) or not isinstance(tol, (int, float))
                                or not 0 <= tol < 1):
            raise ValueError(f"StickBreaking prior: tol must be None (rounding level) or a "
                             f"number in [0, 1), the stick left at which a scan stops; got "
                             f"{tol!r}")
        self.tol = None if tol is None else float(tol)

    def support(self, num_children, num_parents):
        return Before()

    def check_nodes(self, family, children, parents) -> None:
        if children.size > parents.size:
            raise ValueError(f"edge family {family!r}: a StickBreaking prior scans each child's "
                             f"past, so the children must be the first tokens of the parents; "
                             f"got {children.size} children and {parents.size} parents")

    def reading(self, support):
        from ..kinds.stick_breaking import StickBreakingOperator

        return StickBreakingOperator

    def edge_factor(self, potential, children, parents, index, none):
        """log P(the scan chooses ``index``) = Σ_{φ_i ≤ l < i} log Bernoulli(break at l ⇔
        l = φ_i; logits ψ_il) — ψ at every parent from the potential's own definition."""
        P = parents.shape[-2]
        lead = index.dim()  # enumeration dims, then (*batch, H, C) (some of size 1)
        every = torch.arange(P, device=index.device).reshape(P, *([1] * lead))
        psi = potential.at(children, parents, every).movedim(0, -1)  # (…, C, P): ψ_il
        chosen = index.unsqueeze(-1)  # (…, C, 1); P (none) passes every parent
        i, l = grid(psi.shape[-2], P, index.device)
        scanned = (l < i) & ((l >= chosen) | (chosen == P))  # the parents the scan passed by
        broke = (l == chosen).to(psi.dtype)
        from pyro.distributions import Bernoulli

        log_p = Bernoulli(logits=psi).log_prob(broke)
        return torch.where(scanned, log_p, torch.zeros_like(log_p)).sum(-1)

    def describe(self) -> str:
        tol = "" if self.tol is None else f", tol={self.tol:g}"
        return f"StickBreaking(j < i, or no parent{tol})"


#: its log prior reads the potential (the breaking probabilities σ(ψ)), not a table of its own:
#: tests/models/test_stick_breaking_attention.py checks it against Pyro
ENTRY = PriorEntry(StickBreaking, lambda C, P, g: [], None,
                   bad={"tol must be None": lambda: StickBreaking(tol=2.0)})
