"""Certified eviction: a cache drops its oldest key blocks once their posterior mass is proved
≤ ε for the current and every later query, p(φ_i ∈ E) ≤ R_i / (1 + R_i) ≤ ε.

For query i and an evicted set E of earlier tokens, with log prior ℓ and scores s,

    p(φ_i ∈ E) = Σ_{j∈E} e^{s_ij + ℓ_ij} / Z_i,   Z_i ≥ Σ_{j∈E} e^{s_ij + ℓ_ij} + e^{s_ii + ℓ_ii},

so p(φ_i ∈ E) ≤ R_i / (1 + R_i) with R_i = Σ_{j∈E} e^{s_ij − s_ii + ℓ_ij − ℓ_ii}. Where every
query has ‖q_i‖ ≤ Q and every key ‖k_i‖ ≤ K (the ceilings, checked on each new token),
s_ij − s_ii ≤ |scale|·Q·(‖k_j‖ + K) (Cauchy–Schwarz, ‖k_j‖ read from the evicted key
itself). A prior whose r_i(j) = ℓ_ij − ℓ_ii falls by at least δ_{i+1} ≥ 0 from each query
to the next (ALiBi: δ = m; FoX: δ = −log f_{i+1}; the generalised Gaussian with μ ≤ 0:
δ = e^{sβ}((1 − μ)^β − (−μ)^β) for β ≥ 1, else 0) makes the bound computed now hold at
every later query, multiplied by e^{−δ} at each step: the cache keeps that running sum
(``spent``) per row and head, evicts a block when spent + its bound ≤ ε / (1 − ε), and
reports per step the bound of the step's queries (``Eviction.trace``). A new token whose
query or key is longer than its ceiling breaks the proof: eviction stops, with a warning,
and the trace says the bound no longer holds. The rounding of the scores and of the log
prior, as the layer computes them, is charged to the bound (DESIGN.md, "Certified
eviction").
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

#: the declarations whose prior falls for later queries, by class name → the prior's decay
SUPPORTED = ("ALiBiAttention", "ForgettingAttention", "GeneralisedGaussianAttention")


class EvictionWarning(UserWarning):
    """A new token's query or key exceeded its ceiling: certified eviction has stopped."""


@dataclass(frozen=True)
class EvictionStep:
    """One call of a cache with ``tol``: what it held and what the evicted tokens may weigh.

    Attributes:
        position (int): the first new token's position (the longest row's).
        held (int): the tokens the cache holds after the call (the longest row's).
        evicted (int): the tokens evicted from the front of every row, after the call.
        bound (float): an upper bound on the posterior mass of the tokens evicted before the
            call, at every query of the call (the largest over rows and heads), ≤ tol.
        certified (bool): the bound is proved: nothing was evicted yet, or every query and
            key read so far was within its ceiling.
        bounds (torch.Tensor | None): the bound per row and head, ``(B, H)`` float64 (rows
            flattened; 0 for a row without a new token); None while nothing is evicted.
    """

    position: int
    held: int
    evicted: int
    bound: float
    certified: bool
    bounds: torch.Tensor | None = None


def _positive(owner, name, value, heads, dtype, device):
    """A ceiling: a positive finite number or a tensor ``(heads,)`` of them → float64
    ``(heads,)``."""
    t = value if isinstance(value, torch.Tensor) else None
    if t is None and not isinstance(value, bool) and isinstance(value, (int, float)):
        t = torch.tensor(float(value))
    if t is None or t.dtype == torch.bool or t.shape not in ((), (1,), (heads,)) \
            or not bool(torch.isfinite(t).all()) or not bool((t > 0).all()):
        got = f"{tuple(t.shape)} {t.reshape(-1).tolist()[:4]}" if t is not None else repr(value)
        raise ValueError(f"{owner}: new_cache {name} must be a positive finite number or a "
                         f"tensor of {heads} (one per head); got {got}")
    return t.detach().to(dtype=torch.float64, device=device).expand(heads).clone()


def _projection_ceiling(W, heads, x_norm):
    """max ‖W_h x‖ over ‖x‖ ≤ x_norm, per head ``(heads,)`` float64, the projection's rounding
    charged: (σ_max(W_h)(1 + 4u) + γ_d·‖W_h‖_F)·x_norm (γ_d the d-term dot product's bound;
    4u a rotation's rounding)."""
    Wh = W.detach().to(torch.float64).reshape(heads, -1, W.shape[-1])  # (H, d_k, d_model)
    unit = torch.finfo(W.dtype).eps / 2
    d = W.shape[-1]
    gamma = d * unit / (1 - d * unit) if d * unit < 1 else math.inf
    sigma = torch.linalg.matrix_norm(Wh, ord=2)
    frob = torch.linalg.matrix_norm(Wh)
    return (sigma * (1 + 4 * unit) + gamma * frob) * x_norm * (1 + 1e-12)


class _Distance:
    """A stationary prior ℓ_ij = w(i − j): r_t(j) = w(t − j) − w(0), falling by ≥ δ per
    step (``delta``); ``slack`` per head, the absolute rounding of w(0) as computed."""

    def __init__(self, prior, delta, slack):
        self.prior, self.delta, self.slack = prior, delta, slack  # delta, slack: (H|1,)

    def offsets(self, cache, block):
        """r at each row's latest token for the first ``block`` held slots ``(B, H|1, block)``
        (slots for positions: the prior depends on distances alone)."""
        t = cache._lengths - 1  # (B,) each row's latest slot
        d = (t[:, None] - torch.arange(block, device=t.device)).clamp(min=0)  # (B, block)
        w = self.prior.log_at_distance(d, torch.float64)  # (H|1, B, block)
        w0 = self.prior.log_at_distance(torch.zeros(1, dtype=torch.long, device=t.device),
                                        torch.float64)  # (H|1, 1)
        return (w - w0[:, :, None]).movedim(0, 1)

    def steps(self, cache, start, counts):
        """δ over each row's first new token and over all of them ``(B, H|1)``."""
        n = counts.to(torch.float64)[:, None]
        return self.delta * (n > 0), self.delta * n


class _Gate:
    """FoX: ℓ_ij = c_i − c_j, c the running sum of log forget gates the cache keeps."""

    slack = 0.0

    def offsets(self, cache, block):
        c = cache.state  # (B, H, L)
        t = (cache._lengths - 1).clamp(min=0)
        latest = c.gather(-1, t[:, None, None].expand(-1, c.shape[1], 1))  # (B, H, 1)
        return latest.to(torch.float64) - c[..., :block].to(torch.float64)

    def steps(self, cache, start, counts):
        c = cache.state
        H = c.shape[1]

        def at(slot):
            return c.gather(-1, slot.clamp(min=0)[:, None, None].expand(-1, H, 1))[..., 0] \
                .to(torch.float64)
        before, real = at(start - 1), ((start > 0) & (counts > 0))[:, None]  # (B, H), (B, 1)
        first, last = at(start), at(start + counts - 1)
        zero = torch.zeros_like(before)
        return (torch.where(real, before - first, zero).clamp(min=0),
                torch.where(real, before - last, zero).clamp(min=0))


def _decay(model, owner, dtype):
    """The prior's decay for ``model``; a ValueError naming ``tol`` where none is proved."""
    name = type(model).__name__
    if name not in SUPPORTED:
        raise ValueError(f"{owner}: new_cache(tol=…) evicts keys whose prior weight can only "
                         f"fall for later queries (ALiBi, FoX, the generalised Gaussian with "
                         f"loc ≤ 0); {name}'s prior gives no such proof")
    if name == "ForgettingAttention":
        return _Gate()
    unit = torch.finfo(dtype).eps / 2
    if name == "ALiBiAttention":
        from ..priors import ALiBi
        m = model.slopes.detach().to(torch.float64)
        if not bool((m >= 0).all()):
            raise ValueError(f"{owner}: new_cache(tol=…) needs ALiBi slopes ≥ 0 (a weight that "
                             f"falls with the distance); got {m.tolist()}")
        prior = ALiBi(model.heads, slopes=model.slopes, causal=True)
        return _Distance(prior, m, torch.zeros_like(m))
    from ..priors.generalised_gaussian import GeneralisedGaussian
    mu = model.loc.detach().to(torch.float64).reshape(-1)
    s = model.log_scale.detach().to(torch.float64).reshape(-1)
    beta = model.log_shape.detach().to(torch.float64).exp().reshape(-1)
    if not bool((mu <= 0).all()):
        raise ValueError(f"{owner}: new_cache(tol=…) needs the generalised Gaussian's loc ≤ 0 "
                         f"(a weight that falls with the distance); got loc {mu.tolist()}")
    prior = GeneralisedGaussian(model.loc, model.log_scale, model.log_shape.exp(), causal=True)
    # w(d) − w(d + 1) = e^{sβ}((d + 1 − μ)^β − (d − μ)^β) ≥ its value at d = 0 for β ≥ 1
    delta = torch.where(beta >= 1, (s * beta).exp() * ((1 - mu) ** beta - (-mu) ** beta),
                        torch.zeros_like(beta)).clamp(min=0) * (1 - 1e-12)
    w0 = ((-mu) * s.exp()) ** beta  # |w(0)|: its rounding, twice, as the layer computes it
    return _Distance(prior, delta, 64 * unit * w0)


class Eviction:
    """The eviction policy of one cache: blocks of ``block`` keys, oldest first, while their
    bound fits what is left of ε / (1 − ε) in every row and head; ``trace`` one
    ``EvictionStep`` per call. Made by ``layer.new_cache(tol=…)``."""

    def __init__(self, model, tol, query_norm, key_norm, block, decay, dtype):
        self.owner = type(model).__name__
        self.tol, self.block, self.decay = tol, block, decay
        self.query_norm, self.key_norm = query_norm, key_norm  # (H,) float64
        self.budget = tol / (1 - tol)  # R ≤ this ⇔ R / (1 + R) ≤ tol
        self.spent = None  # (B, H) float64: Σ over evicted keys of their bound now
        self.breached = False
        self.trace: list[EvictionStep] = []
        # a block is tried every ``every`` tokens (its bound falls as the spent one does, so
        # a failed try says little about the next token): the cost of a try, amortised
        self.every, self._since = max(1, block // 4), 0

    def _factors(self, dtype, d_k):
        """The rounding charged: scores' exponent ×(1 + γ_{d_k} + 6u + float64's norms), the
        log prior's offset ×(1 − 16u)."""
        unit = torch.finfo(dtype).eps / 2
        gamma = d_k * unit / (1 - d_k * unit) if d_k * unit < 1 else math.inf
        return 1 + gamma + 6 * unit + 4 * d_k * 2.0**-53, 1 - 16 * unit

    @torch.no_grad()
    def after_read(self, cache, q, key, start, counts, scale):
        """After a call read its new tokens (``q``, ``key`` ``(B, H, k, d_k)``, row b's first
        ``counts[b]`` real, appended after its ``start[b]`` held slots): check them against
        the ceilings, record the step's bound, decay it to the newest token and evict the
        oldest blocks that fit."""
        B, H, k, d_k = q.shape
        wide = torch.float64
        real = (torch.arange(k, device=q.device) < counts[:, None])[:, None, :]  # (B, 1, k)
        if self.spent is None:
            self.spent = torch.zeros(B, H, dtype=wide, device=q.device)
        if not self.breached:
            self._check(q, key, real, start, cache)
        up, down = self._factors(q.dtype, d_k)
        evicted = cache.offset
        bound, bounds = 0.0, None
        if evicted:  # the evicted tokens' bound, at the first new query and at the newest
            first, every = self.decay.steps(cache, start, counts)  # (B, H|1) each
            at_first = self.spent * torch.exp(-down * first)
            at_first = torch.where((counts > 0)[:, None], at_first, torch.zeros_like(at_first))
            bounds = at_first / (1 + at_first)  # (B, H)
            bound = float(bounds.max())
            self.spent = self.spent * torch.exp(-down * every)
        position = int((start + evicted).max()) if B else evicted
        self._since += k
        if not self.breached and self._since >= self.every:
            self._since = 0
            self._evict(cache, scale, up, down)
        self.trace.append(EvictionStep(position, len(cache), cache.offset, bound,
                                       not self.breached or evicted == 0, bounds))

    def _check(self, q, key, real, start, cache):
        """Stop evicting, with an ``EvictionWarning``, at a real new token whose query or key
        is longer than its head's ceiling."""
        Q, K = self.query_norm[:, None], self.key_norm[:, None]  # (H, 1)
        wide = torch.float64
        over = ((q.detach().to(wide).norm(dim=-1) > Q) | (key.detach().to(wide).norm(dim=-1) > K)) \
            & real  # (B, H, k)
        if not bool(over.any()):
            return
        for name, t, ceiling in (("query", q, Q), ("key", key, K)):
            over = (t.detach().to(wide).norm(dim=-1) > ceiling) & real
            if bool(over.any()):
                b, h, i = (int(v) for v in over.nonzero()[0])
                norm = float(t[b, h, i].detach().to(torch.float64).norm())
                self.breached = True
                warnings.warn(
                    f"{self.owner}: the {name} of the token at position "
                    f"{int(start[b]) + cache.offset + i} (row {b}, head {h}) has norm "
                    f"{norm:.6g} > its ceiling {float(ceiling[h]):.6g}; certified eviction "
                    f"stops: the {cache.offset} evicted tokens stay evicted and the bound no "
                    f"longer covers later steps", EvictionWarning, stacklevel=4)
                return

    def _evict(self, cache, scale, up, down):
        """Evict the oldest blocks, one at a time, while each row keeps a token after it and
        every (row, head)'s bound stays within the budget."""
        n = self.block
        if not isinstance(scale, torch.Tensor):
            scale = torch.tensor(float(scale))
        reach = scale.detach().to(torch.float64, copy=True).abs().reshape(-1).to(
            self.query_norm.device) * self.query_norm  # (H,): |scale|·Q
        while int(cache._lengths.min()) > n:
            keys = cache.keys[..., :n, :].detach().to(torch.float64)  # (B, H, n, d_k)
            score = up * reach[:, None] * (keys.norm(dim=-1) + self.key_norm[:, None])
            offsets = self.decay.offsets(cache, n)  # (B, H|1, n)
            slack = torch.as_tensor(self.decay.slack, dtype=torch.float64,
                                    device=keys.device).reshape(-1, 1)
            log_u = torch.logsumexp(score + down * offsets + slack, -1)  # (B, H)
            spent = self.spent + log_u.exp()
            if not bool((spent <= self.budget).all()):
                return
            self.spent = spent
            cache.drop_front(n)


def _tol(owner, tol):
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not 0 < tol < 1:
        raise ValueError(f"{owner}: new_cache tol (the posterior mass eviction may leave out) "
                         f"must be a number in (0, 1); got {tol!r}")
    return float(tol)


def eviction(model, tol, query_norm=None, key_norm=None, input_norm=None, block=64):
    """The ``Eviction`` of ``new_cache(tol=…)`` for ``model``: ceilings from ``query_norm``
    and ``key_norm``, or from ``input_norm`` through the projections' spectral norms."""
    owner = type(model).__name__
    tol = _tol(owner, tol)
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"{owner}: new_cache block (the keys evicted at once) must be a "
                         f"positive int; got {block!r}")
    decay = _decay(model, owner, model.W_q.dtype)
    H, kw = model.heads, {"dtype": torch.float64, "device": model.W_q.device}
    if input_norm is not None:
        if query_norm is not None or key_norm is not None:
            raise ValueError(f"{owner}: new_cache takes input_norm or query_norm and key_norm, "
                             f"not both")
        x = _positive(owner, "input_norm", input_norm, 1, **kw)[0]
        query_norm = _projection_ceiling(model.W_q, H, x)
        key_norm = _projection_ceiling(model.W_k, H, x)
    elif query_norm is None or key_norm is None:
        raise ValueError(f"{owner}: new_cache(tol=…) needs ceilings on the future queries and "
                         f"keys: query_norm= and key_norm=, or input_norm= (the longest x); got "
                         f"query_norm={query_norm!r}, key_norm={key_norm!r}")
    else:
        query_norm = _positive(owner, "query_norm", query_norm, H, **kw)
        key_norm = _positive(owner, "key_norm", key_norm, H, **kw)
    return Eviction(model, tol, query_norm, key_norm, block, decay, model.W_q.dtype)
