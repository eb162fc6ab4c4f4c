"""How each causal catalogue model reads a block of new tokens against its cache: the log
prior of the new rows over the cached and new parents, and the state it carries.

A new block of k tokens at positions t..t+k−1 of a sequence whose tokens 0..t−1 are cached
is rows t..t+k−1 of the square (causal) problem over all t + k tokens: every prior here
states log p(φ_i = j) from the positions (or, FoX, from a running sum the cache holds), so
the rows are read exactly, never more than (new tokens × cached tokens) per head.

- ``Positional``: the prior's own ``log_weight`` and ``support`` at (position i, j) — the
  uniform causal prior, ALiBi, relative positions, the generalised Gaussian, the
  beta-geometric (expanding attention read exactly);
- ``Gate``: FoX's c_i − c_j, c = Σ log f, with c of the cached tokens kept in the cache;
- ``Stick``: stick-breaking's p(φ_i = j) = σ(ψ_ij) Π_{j<l<i} σ(−ψ_il), read from the row's
  scores over the whole past (no normalisation: the leftover is "no parent").
"""

from __future__ import annotations

import torch

from ..kinds.stick_breaking import stick_breaking_table
from ..priors import ALiBi, RelativePosition, Uniform
from ..priors.generalised_gaussian import GeneralisedGaussian


class Rule:
    """A model's incremental reading: ``posterior(model, scores, pos, parents, valid,
    cache)`` → p(φ_i = j) ``(B, H, k, P)`` for the new rows; ``state`` whether the cache
    keeps a per-token state (``new_state``); ``tokens`` whether it keeps the tokens
    themselves and the model reads them again (``Reread``)."""

    state = False
    tokens = False

    def check(self, model) -> None:
        """Refuse a configuration the reading cannot continue exactly; default: a certified
        window (the model's or prior's ``tol``), since the cache reads the whole past."""
        tol = getattr(model, "tol", None)
        if tol is not None:
            raise NotImplementedError(
                f"{type(model).__name__}: cache= reads the whole past exactly; a certified "
                f"window (tol={tol!r}) is not read incrementally; build the model with tol=None")

    def new_state(self, model, x, counts, previous):
        """The state at the new tokens ``(B, H, k)`` from each row's last cached one
        ``previous (B, H)``; stated by a rule with ``state = True``."""
        raise NotImplementedError(f"{type(self).__name__} keeps no per-token state")


def _softmax_rows(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """softmax over the allowed parents of each row; a row with none is all zero."""
    logits = logits.masked_fill(~allowed, float("-inf"))
    top = logits.amax(-1, keepdim=True)
    top = torch.where(top.isfinite(), top, torch.zeros_like(top))
    w = (logits - top).exp()
    z = w.sum(-1, keepdim=True)
    return w / torch.where(z > 0, z, torch.ones_like(z))


class Normalised(Rule):
    """A prior whose rows are normalised over the allowed parents: p(φ_i = j) ∝
    exp(ψ_ij + b_ij) over the allowed j, from ``bias(model, pos, parents, valid, cache,
    dtype)`` → ``(b (B, H|1, k, P) | None, allowed (B, 1, k, P))`` — what an attention
    kernel's additive mask states. ``valid`` None: every parent the prior's causal support
    allows is a token of the row (a step without padding)."""

    def posterior(self, model, scores, pos, parents, valid, cache):
        b, allowed = self.bias(model, pos, parents, valid, cache, scores.dtype)
        return _softmax_rows(scores if b is None else scores + b, allowed)


class Positional(Normalised):
    """A prior stating log p(φ_i = j) from the positions: ``prior(model)`` builds it as the
    model's own ``model`` does."""

    def __init__(self, prior):
        self.prior = prior

    def bias(self, model, pos, parents, valid, cache, dtype):
        prior = self.prior(model)
        S = parents.shape[-1]  # the square problem over every token read so far
        child, parent = pos[:, :, None], parents[None, None, :]  # (B, k, 1), (1, 1, P)
        allowed = prior.support(S, S).contains(child, parent)  # (B, k, P)
        if valid is not None:
            allowed = allowed & valid
        lw = prior.log_weight(child, parent, (S, S))
        if lw is not None:  # (H|1, B, k, P), or (B, k, P) for weights shared by every head
            lw = (lw.unsqueeze(1) if lw.dim() == 3 else lw.movedim(0, 1)).to(dtype)
        return lw, allowed.unsqueeze(1)


class Gate(Normalised):
    """FoX: log p(φ_i = j) = c_i − c_j + const over j ≤ i, c_i = Σ_{l ≤ i} log f_l; the
    cache keeps c of every token read."""

    state = True

    def new_state(self, model, x, counts, previous):
        """c of the new tokens ``(B, H, k)``: the row's last cached c plus the running sum of
        the new log gates (padding adds nothing; ``counts`` None: no padding)."""
        log_f = model.log_gates(x)  # (B, H, k)
        if counts is not None:
            slot = torch.arange(x.shape[-2], device=x.device)
            log_f = log_f.masked_fill(~(slot < counts[:, None])[:, None, :], 0.0)
        wide = torch.promote_types(log_f.dtype, torch.float32)
        c = _as(log_f, wide) if x.shape[-2] == 1 else torch.cumsum(log_f, -1, dtype=wide)
        return _as(previous[:, :, None] + c, x.dtype)

    def bias(self, model, pos, parents, valid, cache, dtype):
        c = cache.state[..., : parents.shape[-1]]  # (B, H, P): now holds the new tokens too
        c_child = getattr(cache, "new_state", None)  # (B, H, k), where the reading has it
        if c_child is None:
            at = pos.clamp(max=c.shape[-1] - 1)  # padding's positions may lie beyond its row
            c_child = c.gather(-1, at[:, None, :].expand(-1, c.shape[1], -1))
        allowed = parents[None, None, :] <= pos[:, :, None]
        if valid is not None:
            allowed = allowed & valid
        return _as(c_child[..., None] - c[:, :, None, :], dtype), allowed.unsqueeze(1)


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)`` without the call where t has it (in a recorded step, one op less)."""
    return t if t.dtype == dtype else t.to(dtype)


class Stick(Rule):
    """Stick-breaking: p(φ_i = j) = σ(ψ_ij) Π_{j<l<i} σ(−ψ_il) over j < i."""

    def check(self, model) -> None:
        if model.tol not in (None, 0, 0.0):
            raise NotImplementedError(
                f"{type(model).__name__}: cache= reads every pair of the past; a scan that "
                f"stops at a stick of tol={model.tol!r} is not read incrementally; build the "
                f"model with tol=None")

    def posterior(self, model, scores, pos, parents, valid, cache):
        before = parents[None, None, :] < pos[:, :, None]  # (B, k, P)
        if valid is not None:
            before = before & valid
        before = before.unsqueeze(1)  # (B, 1, k, P)
        return stick_breaking_table(scores, before)[0]  # the full reading's scan, on the rows


class Reread(Rule):
    """Expanding attention's mean-field windows: each token's window and Beta posterior are
    inferred from its own past alone, so a new token is read by the model itself as the
    last of its row (``model(x, last=k)``); the cache keeps the tokens, not keys."""

    tokens = True

    def check(self, model) -> None:
        pass


def _uniform(model):
    return Uniform(causal=True)


#: the declaration class, by module and name (the catalogue is not imported here: it imports
#: the compiler, which imports this) → its ``Rule``: every causal catalogue model
RULES = {
    "self_attention.SelfAttention": Positional(_uniform),
    "rope_attention.RoPEAttention": Positional(_uniform),
    "absolute_position_attention.AbsolutePositionAttention": Positional(_uniform),
    "multihop_attention.MultihopAttention": Positional(_uniform),
    "alibi_attention.ALiBiAttention": Positional(
        lambda model: ALiBi(model.heads, slopes=model.slopes, causal=True)),
    "relative_position_attention.RelativePositionAttention": Positional(
        lambda model: RelativePosition(model.position_logits, causal=True)),
    "generalised_gaussian_attention.GeneralisedGaussianAttention": Positional(
        lambda model: GeneralisedGaussian(model.loc, model.log_scale, model.log_shape.exp(),
                                          causal=True)),
    "expanding_attention.ExpandingAttention": Positional(lambda model: model.prior()),
    "forgetting_attention.ForgettingAttention": Gate(),
    "stick_breaking_attention.StickBreakingAttention": Stick(),
}


def rule_for(model) -> Rule:
    """The model's ``Rule``; a ValueError naming ``cache=`` for a model that is not causal,
    a NotImplementedError for a causal one without an incremental reading."""
    owner = type(model).__name__
    if not getattr(model, "causal", False):
        raise ValueError(f"{owner}: cache= (incremental decoding) needs a causal model, where "
                         f"each token reads only itself and its past; {owner} is not causal")
    cls = type(model)  # the class itself: a subclass may declare another prior
    rule = RULES.get(f"{cls.__module__.removeprefix('structattn.models.')}.{cls.__qualname__}")
    if rule is None:
        raise NotImplementedError(f"{owner}: cache= has no incremental reading for this model "
                                  f"(structattn/decoding/rules.py names those that have one)")
    if owner == "ExpandingAttention":
        if model.inference is not None:
            return Reread()
        rule.check(model.prior())  # the exact reading's prior holds its tol
    else:
        rule.check(model)
    return rule
