"""Closed-form marginalisation of one edge family: E_{p(φ_i|x)}[v_i(x, φ_i)].

Two paths that must agree whenever the fast one applies:

- ``fast_expectation``: ``scaled_dot_product_attention`` with the prior as a
  boolean mask / ``is_causal`` / additive bias; never forms the C×P matrix;
- ``naive_expectation``: the dense posterior softmax(ψ + log prior) and its
  product with the values — the twin used when the posterior is asked for or
  when a potential/value has no factorised form.

Cost: fast O(C·P·(d_k + d_v)) time, O((C + P)·d) memory; naive adds O(C·P) memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .family import EdgeFamily


def scores(family: EdgeFamily) -> torch.Tensor:
    """Dense unnormalised log posterior ψ + log prior: ``(*batch, H, C, P)``, −∞ off support."""
    xc, xp = family.children.states, family.parents.states
    total = family.prior.log_weights(family.children.size, family.parents.size, xc.device,
                                     xc.dtype)
    for psi in family.potentials:
        total = total + psi.pairwise(xc, xp)
    return total.expand(*family.batch_shape, family.heads, *total.shape[-2:])


def posterior(family: EdgeFamily) -> torch.Tensor:
    """p(φ_i = j | x): ``(*batch, H, C, P)``; rows sum to one over the support."""
    return torch.softmax(scores(family), dim=-1)


def naive_expectation(family: EdgeFamily):
    """``(E[v], posterior)`` through the dense posterior."""
    post = posterior(family)
    return post @ family.value.parent_values(family.parents.states), post


def can_use_fast_path(family: EdgeFamily) -> bool:
    return len(family.potentials) == 1 and family.potentials[0].is_factorised


def fast_expectation(family: EdgeFamily) -> torch.Tensor:
    xc, xp = family.children.states, family.parents.states
    a, b, scale = family.potentials[0].factors(xc, xp)  # (*batch,H,C,k), (*batch,H,P,k)
    v = family.value.parent_values(xp)  # (*batch, H, P, d_v)
    mask, is_causal = family.prior.sdpa_inputs(family.children.size, family.parents.size,
                                               xc.device, xc.dtype)
    if isinstance(scale, torch.Tensor):  # a learnable temperature: SDPA wants a float scale
        a, scale = a * scale.to(a.dtype), 1.0
    return F.scaled_dot_product_attention(a, b, v, attn_mask=mask, is_causal=is_causal,
                                          scale=float(scale))


def expectation(family: EdgeFamily, *, want_posterior: bool = False):
    """``(E[v], posterior or None)`` by the fastest exact path available."""
    if family.value is None:
        raise ValueError(f"edge family {family.name!r} has no value function")
    if not family.potentials:
        raise ValueError(
            f"edge family {family.name!r} has no potential: declare one with "
            f"structattn.potential(edge, …) before structattn.value(edge, …)"
        )
    if want_posterior or not can_use_fast_path(family):
        return naive_expectation(family)
    return fast_expectation(family), None
