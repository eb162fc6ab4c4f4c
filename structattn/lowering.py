"""Closed-form marginalisation of one edge family: E_{p(φ_i|x)}[v_i(x, φ_i)].

A family's *attention operator* ``attend(u)_i = Σ_j p(φ_i = j | x) u_j`` comes in
two forms that must agree whenever the fast one applies:

- ``sdpa_attend``: ``scaled_dot_product_attention`` with the prior as a boolean
  mask / ``is_causal`` / additive bias; never forms the C×P matrix;
- ``dense_attend``: the dense posterior softmax(ψ + log prior) times ``u`` — the
  twin used when the posterior is asked for or a potential has no factorised form.

The value function turns the operator into E[v] (one call for a linear value,
K calls for K hops).

Cost: fast O(C·P·(d_k + d_v)) time, O((C + P)·d) memory; naive adds O(C·P) memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .family import EdgeFamily


def posterior(family: EdgeFamily) -> torch.Tensor:
    """p(φ_i = j | x): ``(*batch, H, C, P)``; rows sum to one over the support (all-zero
    rows for children without parents under ``empty="zero"``)."""
    post, keep = torch.softmax(family.scores(), dim=-1), family.keep()
    return post if keep is None else post * keep


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


def sdpa_attend(family: EdgeFamily):
    """``u ↦ E_{p(φ_i|x)}[u_{φ_i}]`` through ``scaled_dot_product_attention``; the score
    factors and the mask are built once and reused for every call (multihop calls it K times)."""
    xc = family.children.states
    a, b, scale = score_factors(family)  # (*batch, H, C, k), (*batch, H, P, k)
    mask, is_causal = family.prior.sdpa_inputs(family.children.size, family.parents.size,
                                               xc.device, xc.dtype)

    def attend(u):
        return F.scaled_dot_product_attention(a, b, u, attn_mask=mask, is_causal=is_causal,
                                              scale=scale)
    return attend


def segment_attend(family: EdgeFamily, want_posterior: bool = False):
    """``u ↦ E[u_{φ_i}]`` over an edge-list support: O(E) memory, never C×P. With
    ``want_posterior`` the first call also keeps the per-edge posterior, which
    ``posterior()`` then returns without another pass."""
    from .segment import segment_attention

    src, dst = family.prior.edges(family.children.states.device)
    a, b, scale = score_factors(family)
    kwargs = {"empty": family.prior.empty}
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


def expectation(family: EdgeFamily, *, want_posterior: bool = False):
    """``(E[v], posterior or None)`` by the fastest exact path available.

    The posterior is dense ``(*batch, H, C, P)``, or per edge ``(*batch, H, E)`` when the
    support is an edge list.
    """
    check_complete(family)
    xc, xp = family.children.states, family.parents.states
    if family.prior.edge_index is not None:
        if not can_use_fast_path(family):
            raise NotImplementedError(
                f"edge family {family.name!r}: an edge-list support needs exactly one "
                f"factorised potential (ψ = ⟨a_i, b_j⟩·scale), e.g. Bilinear")
        attend, posterior_fn = segment_attend(family, want_posterior)
        out = family.value.expectation(attend, xc, xp)
        return out, (posterior_fn() if want_posterior else None)
    if want_posterior or not can_use_fast_path(family):
        post = posterior(family)  # parentless rows already zero
        return family.value.expectation(dense_attend(post), xc, xp), post
    attend, keep = sdpa_attend(family), family.keep()
    if keep is not None:  # children without parents: zero value
        inner = attend
        def attend(u):  # noqa: E306
            return inner(u) * keep
    return family.value.expectation(attend, xc, xp), None
