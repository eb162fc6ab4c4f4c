"""Closed-form marginalisation of one edge family: E_{p(φ_i|x)}[v_i(x, φ_i)].

A family's *attention operator* ``attend(u)_i = Σ_j p(φ_i = j | x) u_j`` is built by
the lowering rule of its prior's *support kind* — one ``SupportKind`` class per kind,
chosen once from the prior (``support_kind``):

- ``DenseSupport`` (all parents, j ≤ i, a dense mask, an additive log-prior bias):
  ``sdpa_attend``, ``scaled_dot_product_attention`` with the prior as a boolean mask /
  ``is_causal`` / additive bias, never forming the C×P matrix; or its twin
  ``dense_attend``, the dense posterior softmax(ψ + log prior) times ``u``, used when the
  posterior is asked for or a potential has no factorised form;
- ``EdgeListSupport`` (a graph given as ``edge_index``): ``segment_attend``, a
  softmax over each child's incoming edges, O(E) memory, never C×P.

A new kind is one ``SupportKind`` subclass passed to ``register_support_kind``.
The value function turns the operator into E[v] (one call for a linear value,
K calls for K hops).

Cost: SDPA O(C·P·(d_k + d_v)) time, O((C + P)·d) memory; the dense twin adds O(C·P)
memory; an edge list O(E·(d_k + d_v)) time, O(E + (C + P)·d) memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .family import EdgeFamily
from .operator import FamilyOperator
from .priors.base import Prior
from .priors.tables import PriorTables


def posterior(family: EdgeFamily) -> torch.Tensor:
    """p(φ_i = j | x): ``(*batch, H, C, P)``; rows sum to one over the support (all-zero
    rows for children without parents under ``empty="zero"``). The dense posterior of the
    family's support kind: the family operator's (``structattn.operator``, one definition for
    single-shot and iterative readings) unless the kind infers its own (mean-field windows)."""
    return support_kind(family.prior).posterior(family)


def dense_attend(post: torch.Tensor):
    """``u ↦ P u`` with the dense posterior P: ``(*batch, H, C, P) @ (*batch, H, P, d)``."""
    return lambda u: post @ u


def can_use_fast_path(family: EdgeFamily) -> bool:
    return len(family.potentials) == 1 and family.potentials[0].is_factorised


def score_factors(family: EdgeFamily):
    """``(a, b, scale)`` with ψ = scale·⟨a_i, b_j⟩ and ``scale`` a float: a tensor (learnable)
    temperature is folded into ``a``, since the fused kernels take a float scale."""
    a, b, scale = family.potentials[0].factors(family.children.states, family.parents.states)
    if isinstance(scale, torch.Tensor):
        a, scale = a * scale.to(a.dtype), 1.0
    return a, b, float(scale)


def family_tables(family: EdgeFamily) -> PriorTables:
    """The family's prior tables for this pass: the family's own when it holds them, else
    built here (once per call; a caller that needs several should keep the result)."""
    tables = getattr(family, "tables", None)
    if tables is None:
        tables = family.prior.tables(family.children.size, family.parents.size,
                                     family.children.states.device)
    return tables


def sdpa_attend(family: EdgeFamily, *, tables: PriorTables | None = None):
    """``u ↦ E_{p(φ_i|x)}[u_{φ_i}]`` through ``scaled_dot_product_attention``; the score
    factors and the mask are built once and reused for every call (multihop calls it K times)."""
    xc = family.children.states
    a, b, scale = score_factors(family)  # (*batch, H, C, k), (*batch, H, P, k)
    tables = family_tables(family) if tables is None else tables
    mask, is_causal = tables.sdpa_inputs(xc.dtype)

    def attend(u):
        return F.scaled_dot_product_attention(a, b, u, attn_mask=mask, is_causal=is_causal,
                                              scale=scale)
    return attend


def segment_attend(family: EdgeFamily, want_posterior: bool = False, *,
                   tables: PriorTables | None = None):
    """``u ↦ E[u_{φ_i}]`` over an edge-list support: O(E) memory, never C×P. The prior's
    log weights, if any, are gathered per edge and added to the scores. With
    ``want_posterior`` the first call also keeps the per-edge posterior, which
    ``posterior()`` then returns without another pass.

    The edge list was checked once (``PriorTables.validate``) when the family was
    declared, so the kernel does not check it again."""
    from .segment import segment_attention

    tables = family_tables(family) if tables is None else tables
    src, dst = tables.edges()
    a, b, scale = score_factors(family)
    bias = tables.edge_bias(a.dtype)  # (…, E) or None
    kwargs = {"empty": family.prior.empty, "bias": bias, "checked": True}
    kept = {}

    def attend(u):
        if want_posterior and "p" not in kept:
            out, kept["p"] = segment_attention(a, b, u, src, dst, family.children.size, scale,
                                               return_posterior=True, **kwargs)
            return out
        return segment_attention(a, b, u, src, dst, family.children.size, scale, **kwargs)

    def posterior():  # p(φ_i = src_e | x) per edge e: (*batch, H, E)
        if "p" not in kept:
            attend(b.new_zeros(*b.shape[:-1], 1))
        return kept["p"]
    return attend, posterior


def check_complete(family: EdgeFamily) -> None:
    """A family to marginalise needs a value and at least one potential."""
    if family.value is None:
        raise ValueError(f"edge family {family.name!r} has no value function")
    if not family.potentials:
        raise ValueError(
            f"edge family {family.name!r} has no potential: declare one with "
            f"structattn.potential(edge, …) before structattn.value(edge, …)"
        )


# -- support kinds: one lowering rule each ------------------------------------------------
class SupportKind:
    """A kind of support and its lowering rule.

    ``matches(prior)``: whether a prior's support is of this kind. ``lower(family,
    want_posterior)`` returns ``(attend, posterior)``: the family's attention operator
    ``u ↦ E_{p(φ_i|x)}[u_{φ_i}]`` (``u``: ``(*batch, H, P, d)``) and a thunk giving the
    edge posterior in this kind's layout (called only when ``want_posterior``).
    """

    name = "support"

    def matches(self, prior: Prior) -> bool:
        raise NotImplementedError

    def lower(self, family: EdgeFamily, want_posterior: bool):
        raise NotImplementedError

    def posterior(self, family: EdgeFamily) -> torch.Tensor:
        """The dense posterior ``(*batch, H, C, P)`` (drawings, oracles): the exact
        softmax(ψ + log prior) by default; a kind whose posterior is approximate says so."""
        return FamilyOperator(family).posterior()


class DenseSupport(SupportKind):
    """All parents, j ≤ i, a dense boolean mask and/or an additive log-prior bias: one
    SDPA call per ``attend`` (mask / ``is_causal`` / float mask), or the dense posterior
    ``(*batch, H, C, P)`` when it is asked for or a potential is not factorised."""

    name = "dense"

    def matches(self, prior):
        return prior.edge_index is None

    def lower(self, family, want_posterior):
        if want_posterior or not can_use_fast_path(family):
            post = posterior(family)  # parentless rows already zero
            return dense_attend(post), lambda: post
        attend, keep = sdpa_attend(family), family.keep()
        if keep is not None:  # children without parents: zero value
            inner = attend

            def attend(u):
                return inner(u) * keep
        return attend, None


class EdgeListSupport(SupportKind):
    """A graph given as an edge list ``(2, E)``: a segment softmax over each child's
    incoming edges (``structattn.segment``); posterior per edge ``(*batch, H, E)``."""

    name = "edge list"

    def matches(self, prior):
        return prior.edge_index is not None

    def lower(self, family, want_posterior):
        if not can_use_fast_path(family):
            raise NotImplementedError(
                f"edge family {family.name!r}: an edge-list support needs exactly one "
                f"factorised potential (ψ = ⟨a_i, b_j⟩·scale), e.g. Bilinear")
        return segment_attend(family, want_posterior)


SUPPORT_KINDS: list[SupportKind] = [EdgeListSupport(), DenseSupport()]
"""The kinds, most specific first: a prior's kind is the first that matches."""


def register_support_kind(kind: SupportKind) -> SupportKind:
    """Add a support kind, tried before those already known (so it may refine one)."""
    if not isinstance(kind, SupportKind):
        raise ValueError(f"a support kind must be a SupportKind instance; got {type(kind).__name__}")
    SUPPORT_KINDS.insert(0, kind)
    return kind


def support_kind(prior: Prior) -> SupportKind:
    """The support kind of ``prior`` (its lowering rule)."""
    for kind in SUPPORT_KINDS:
        if kind.matches(prior):
            return kind
    raise NotImplementedError(f"no lowering rule for the support of prior {prior.describe()}")


def expectation(family: EdgeFamily, *, want_posterior: bool = False):
    """``(E[v], posterior or None)`` by the lowering rule of the prior's support kind.

    The posterior is dense ``(*batch, H, C, P)``, or per edge ``(*batch, H, E)`` when the
    support is an edge list.
    """
    check_complete(family)
    attend, post = support_kind(family.prior).lower(family, want_posterior)
    out = family.value.expectation(attend, family.children.states, family.parents.states)
    return out, (post() if want_posterior else None)
