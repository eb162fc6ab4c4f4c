"""The attention operator of one edge family at the current node states.

For the posterior P (``(*batch, H, C, P)``, P_ij = p(φ_i = j | x)) it offers

- ``attend(u) = P u`` — SDPA (never forms C×P) unless the dense posterior already exists;
- ``adjoint(u) = Pᵀ u`` and ``mass() = Pᵀ 1`` — what a parent-side latent needs (slot
  attention's update is a posterior-weighted mean over inputs);
- ``log_partition()`` = log Σ_j exp(ψ_ij + log p(φ_i = j)) per child, ``(*batch, H, C)``:
  the family's contribution to the free energy, −F = log p(z) + Σ log_partition;
- ``posterior()``: the dense P, built once per step and shared by everything above.

An iterating reader builds one operator per family per step; ``cache`` (one dict per
family, kept across steps) holds what does not change while latents move: the prior's
tables and the factor of an observed side.

Cost per step: attend O(C·P·k) time, O((C + P)·k) memory; the dense readings O(C·P).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ._validation import is_validating
from .family import EdgeFamily


class FamilyOperator:
    def __init__(self, family: EdgeFamily, cache: dict | None = None):
        self.family = family
        self.cache = {} if cache is None else cache
        self._post = None
        self._scores = None

    # -- pieces that do not change while the latents move ------------------------------
    def _const(self, key, fn):
        if key not in self.cache:
            self.cache[key] = fn()
        return self.cache[key]

    def log_weights(self) -> torch.Tensor:
        """Unnormalised log prior ``(…, C, P)``, −∞ off the support."""
        f, xc = self.family, self.family.children.states
        return self._const("log_weights", lambda: f.tables.log_weights(xc.dtype))

    def flat_prior(self) -> bool:
        """True when the prior is uniform over all parents (no mask, no table): its log weights
        are zero and need not be added to the scores."""
        f, xc = self.family, self.family.children.states
        return self._const("flat", lambda: f.prior.edge_index is None
                           and f.tables.sdpa_inputs(xc.dtype) == (None, False))

    def log_normaliser(self) -> torch.Tensor:
        """log Σ_j exp(log weights) per child ``(…, C)``: log p(φ_i = j) = weights − this."""
        return self._const("log_normaliser", lambda: torch.logsumexp(self.log_weights(), -1))

    def factors(self, potential):
        """``(a, b, scale)`` of a factorised potential; an observed side's half is computed once
        per forward (when the potential states its halves separately)."""
        f = self.family
        if not potential.is_split:
            return potential.factors(f.children.states, f.parents.states)
        k = id(potential)
        a = (self._const(("a", k), lambda: potential.child_factor(f.children.states))
             if f.children.observed else potential.child_factor(f.children.states))
        b = (self._const(("b", k), lambda: potential.parent_factor(f.parents.states))
             if f.parents.observed else potential.parent_factor(f.parents.states))
        return a, b, potential.factor_scale()

    # -- the operator ------------------------------------------------------------------
    def _parents_major(self) -> bool:
        """Few parents per child (slots): keep scores as (…, P, C) so the softmax runs along
        a non-innermost dim, where the CPU kernel vectorises over children; a softmax along an
        innermost dim of a few entries is several times slower."""
        return self.family.parents.size <= 32 and self.family.children.size >= 4 * \
            self.family.parents.size

    def _table(self) -> tuple[torch.Tensor, int]:
        """ψ + log prior and the parents' dim: ``(*batch, H, C, P)`` (dim −1) or, when
        ``_parents_major``, ``(*batch, H, P, C)`` (dim −2)."""
        if self._scores is None:
            f = self.family
            t = self._parents_major()
            total = None if self.flat_prior() else (
                self.log_weights().transpose(-1, -2) if t else self.log_weights())
            for psi in f.potentials:
                if psi.is_factorised:
                    a, b, scale = self.factors(psi)
                    if a.dtype in (torch.float16, torch.bfloat16):  # accumulate in float32
                        a, b = a.float(), b.float()
                    if a.shape[-2] <= b.shape[-2]:  # scale the smaller factor, not C×P scores
                        a = a * scale
                    else:
                        b = b * scale
                    term = b @ a.transpose(-1, -2) if t else a @ b.transpose(-1, -2)
                else:
                    term = psi.pairwise(f.children.states, f.parents.states)
                    term = term.transpose(-1, -2) if t else term
                total = term if total is None else total + term
            self._scores = total.expand(*f.batch_shape, f.heads, *total.shape[-2:])
        return self._scores, (-2 if self._parents_major() else -1)

    def scores(self) -> torch.Tensor:
        """ψ + log prior (unnormalised), ``(*batch, H, C, P)``, −∞ off the support."""
        table, dim = self._table()
        return table if dim == -1 else table.transpose(-1, -2)

    def posterior(self) -> torch.Tensor:
        """p(φ_i = j | x) at the current states, ``(*batch, H, C, P)`` (zero rows for parentless
        children under ``empty="zero"``)."""
        if self._post is None:
            table, dim = self._table()
            post, keep = torch.softmax(table, dim), self.family.keep()
            if keep is None and self.family.prior.empty == "error" and not is_validating():
                # unchecked rows without support: zero, as the fused kernel gives, not NaN
                post = post.masked_fill(torch.isneginf(table).all(dim, keepdim=True), 0.0)
            post = post.to(self.family.children.states.dtype)
            post = post if dim == -1 else post.transpose(-1, -2)
            self._post = post if keep is None else post * keep
        return self._post

    def attend(self, u: torch.Tensor) -> torch.Tensor:
        """``P u``: u ``(*batch, H, P, d)`` → ``(*batch, H, C, d)``."""
        f = self.family
        fast = (self._post is None and len(f.potentials) == 1 and f.potentials[0].is_factorised
                and f.prior.edge_index is None)
        if not fast:
            return self.posterior() @ u
        a, b, scale = self.factors(f.potentials[0])
        if isinstance(scale, torch.Tensor):  # the fused kernels take a float scale
            a, scale = a * scale.to(a.dtype), 1.0
        xc = f.children.states
        mask, is_causal = self._const("sdpa", lambda: f.tables.sdpa_inputs(xc.dtype))
        out = F.scaled_dot_product_attention(a, b, u, attn_mask=mask, is_causal=is_causal,
                                             scale=float(scale))
        keep = f.keep()
        return out if keep is None else out * keep

    def adjoint(self, u: torch.Tensor) -> torch.Tensor:
        """``Pᵀ u``: u ``(*batch, H, C, d)`` → ``(*batch, H, P, d)``."""
        return self.posterior().transpose(-1, -2) @ u

    def mass(self) -> torch.Tensor:
        """``Pᵀ 1``: the expected number of children choosing each parent, ``(*batch, H, P, 1)``."""
        return self.posterior().sum(-2).unsqueeze(-1)

    def log_partition(self) -> torch.Tensor:
        """log Σ_j exp(ψ_ij) p(φ_i = j) per child and head, ``(*batch, H, C)``."""
        table, dim = self._table()
        lse = torch.logsumexp(table, dim)
        if self.flat_prior():
            return lse - math.log(self.family.parents.size)
        return lse - self.log_normaliser()
