"""Expanding attention (paper §5.2, appendix 7.3): each token infers how far back to look."""

from __future__ import annotations

import functools
import math
import operator

import torch
import torch.nn.functional as F
from torch import nn

from structattn.checking.renamed import refuses_renamed
from structattn.checks import check_positive, check_size
from structattn.nodes import nodes
from structattn.priors import BetaGeometric
from structattn.windows import MeanFieldWindows

from ._catalogue import TOKEN_SIZES, Entry, randn64
from ._projections import TokenAttention


def _softplus_inverse(v: float) -> float:
    return v + math.log(-math.expm1(-v))


@refuses_renamed
class ExpandingAttention(TokenAttention):
    r"""$φ_i$ = distance back from token $i$ (parent $i − φ_i$),
    $p(φ_i = d \mid q_i) = (1 − q_i)\, q_i^{d−1}$, $q_i ∼ \mathrm{Beta}(a, b)$;
    $ψ(x_j, x_i) = x_iᵀW_QᵀW_K x_j / τ$; $v = W_V x_j$; $y_i = W_O [\mathbb{E}\, v_i]_\text{heads}$.

    ``inference=sa.MeanFieldWindows(...)`` (the default, ``MeanFieldWindows()``): the paper's
    scheme, declared on the family and taken whole — a window per token that grows while
    the posterior needs it; the cost follows the inferred context, not n. Its options
    (``tol``, ``max_window``, ``max_iters``, ``converge_tol``, ``expectation``, ``update``,
    ``window_rule``, ``initial_window``, ``grad``) live on the scheme.
    ``inference=None``: the exact reading, q integrated out,
    p(φ = d) = B(a + d − 1, b + 1)/B(a, b), one softmax over the past — all of it, or a
    window (the prior's ``tol``, ``prior_tol``, ``max_window``).
    Token 0 has no past: its attention output is zero.

    x: ``(*batch, n, d_model)`` → ``(*batch, n, d_model)``. ``return_trace=True`` (mean-field)
    gives the ``Trace``, whose ``mean_field["attn"]`` holds the windows, Beta parameters and
    iterations. ``layer(x, last=k)`` computes only the last k tokens' outputs
    ``(*batch, k, d_model)``, each still reading its own past among all n (equal to
    ``layer(x)[..., -k:, :]``; a decoding step, or a loss on the final tokens): on the CPU
    without a graph (the compiled kernel) the cost is that of those k windows, not n; the
    Python loop and ``grad="last"``'s differentiable step still build the band over all n
    (same result).

    ::

        … x_{i−3} ← x_{i−2} ← x_{i−1} ← x_i    (φ_i = d: x_i reads x_{i−d}, d ~ BetaGeom(a, b))

    Args:
        d_model (int): the tokens' feature size, a positive int.
        heads (int): the number of heads, a positive int. Default 1.
        a (float | torch.Tensor): the Beta prior's a, finite and > 0: a number (every head)
            or a floating-point tensor ``()`` or ``(heads,)`` (one per head). Default 1.0.
        b (float | torch.Tensor): the Beta prior's b, as ``a``. Default 1.0.
        learn_prior (bool): True (default) learns a and b per head (a = softplus(raw) > 0, a
            parameter ``raw_prior: (2, heads)``); False keeps them fixed (a buffer).
        inference (structattn.MeanFieldWindows | None): the mean-field scheme, whole (its
            ``tol``, ``max_window``, ``max_iters``, ``converge_tol``, ``expectation``,
            ``update``, ``window_rule``, ``initial_window`` and ``grad``; see
            ``structattn.MeanFieldWindows``), or None for the exact reading. Default
            ``MeanFieldWindows()``: tol 0.05, at most 50 rounds, converge_tol 1e-3, digamma
            expectation, conjugate update, certified windows from the prior's tail quantile,
            ``grad="unroll"`` (``structattn.iteration(grad=…)`` overrides it).
        tol (float | None): exact reading only (``inference=None``), in (0, 1): the softmax
            runs over the shortest window whose posterior mass beyond it is certified ≤ tol
            for every token (``return_trace=True``: the bound per token, in
            ``trace.truncation``); None, the default, reads the whole past. The mean-field
            windows take their own: ``MeanFieldWindows(tol=…)``.
        prior_tol (float | None): exact reading only, in (0, 1), not with ``tol``: the
            support is cut where the *prior's* tail is below it, whatever the scores; None,
            the default, cuts nothing.
        max_window (int | None): exact reading only, a positive int that caps the prior's
            window; None, the default, leaves it to each token's past. The mean-field
            windows take their own: ``MeanFieldWindows(max_window=…)``.
        block_size (int): the band's block of tokens (both readings), a positive int.
            Default 32.
        **kwargs (Any): passed to ``TokenAttention`` (d_k, d_v, out_proj, temperature,
            rope_base, rope_dims, device, dtype, name); ``causal`` is always True.

    Raises:
        ValueError: ``inference`` neither a ``MeanFieldWindows`` nor None; ``tol``,
            ``prior_tol`` or ``max_window`` (the exact reading's prior options) given with a
            mean-field scheme; or a size, a, b or prior option outside its range — each naming
            the argument and the value given.
        TypeError: a keyword neither this class nor ``TokenAttention`` takes, e.g. one of the
            scheme's options (``max_iters``, ``grad``, ``window_rule``, …), which live on
            ``MeanFieldWindows``.
    """

    def __init__(self, d_model, *, heads=1, a=1.0, b=1.0, learn_prior=True,
                 inference=MeanFieldWindows(), tol=None, prior_tol=None, max_window=None,
                 block_size=32, **kwargs):
        owner = type(self).__name__
        super().__init__(d_model, heads=heads, causal=True, **kwargs)
        for what, v in (("block_size", block_size), ("max_window", max_window)):
            if v is not None:
                check_size(owner, what, v)
        if inference is not None and not isinstance(inference, MeanFieldWindows):
            raise ValueError(f"{owner}: inference must be a structattn.MeanFieldWindows (the "
                             f"mean-field reading) or None (the exact reading); got "
                             f"{inference!r}")
        if inference is not None:  # the prior's own truncation is the exact reading's
            for what, v, scheme in (
                    ("tol", tol, "MeanFieldWindows(tol=…)"),
                    ("prior_tol", prior_tol, "MeanFieldWindows(tol=…, window_rule=…)"),
                    ("max_window", max_window, "MeanFieldWindows(max_window=…)")):
                if v is not None:
                    raise ValueError(f"{owner}: {what} (an option of the exact reading's "
                                     f"prior, inference=None) must be None with a mean-field "
                                     f"scheme, whose windows take {scheme}; got {what}={v!r}")
        kw = {"device": kwargs.get("device"), "dtype": kwargs.get("dtype")}
        rows = []
        for name, v in (("a", a), ("b", b)):  # a float, or one value per head
            v = check_positive("ExpandingAttention", name, v)
            vals = v.detach().reshape(-1).tolist() if isinstance(v, torch.Tensor) else [v]
            if len(vals) not in (1, heads):
                raise ValueError(f"ExpandingAttention: {name} must be a float or have one value "
                                 f"per head ({heads}); got {len(vals)} values")
            rows.append([_softplus_inverse(float(x)) for x in vals] * (heads // len(vals)))
        raw = torch.tensor(rows, **kw)
        if learn_prior:
            self.raw_prior = nn.Parameter(raw)  # (2, heads): softplus⁻¹ of (a, b)
        else:
            self.register_buffer("raw_prior", raw)
        #: the mean-field scheme, or None (the exact reading)
        self.inference = inference
        # the prior's truncation (exact reading; the scheme's windows otherwise), checked now
        # (the prior is rebuilt each forward from the current a, b)
        self._prior_options = (dict(block_size=block_size) if inference is not None else
                               dict(tol=tol, prior_tol=prior_tol, max_window=max_window,
                                    block_size=block_size))
        self.prior()

    @property
    def a(self) -> torch.Tensor:
        """Beta parameter a per head ``(heads,)``."""
        return F.softplus(self.raw_prior[0])

    @property
    def b(self) -> torch.Tensor:
        """Beta parameter b per head ``(heads,)``."""
        return F.softplus(self.raw_prior[1])

    def expected_distance(self, n: int) -> torch.Tensor:
        """The prior's mean look-back capped at n, E[min(φ, n)] = Σ_{d<n} P(φ > d), per head
        ``(heads,)``: differentiable in a and b — a cost a loss can penalise (as Adaptive
        Span penalises its span) so that the learned prior does not widen for free."""
        return self.prior().log_tail(torch.arange(n, device=self.raw_prior.device)[:, None],
                                     self.raw_prior.device,
                                     self.raw_prior.dtype).exp().sum(0)

    def prior(self) -> BetaGeometric:
        return BetaGeometric(self.a, self.b, **self._prior_options)

    def model(self, x, last=None):
        tokens = self.tokens(x)
        if last is None:
            return self.attend(self.family_name, tokens, tokens, self.prior(),
                               inference=self.inference)
        n = x.shape[-2]
        try:  # an int, numpy integer or 0-d integer tensor (not a bool or a float)
            k = None if isinstance(last, bool) or (
                isinstance(last, torch.Tensor) and last.dim()) else operator.index(last)
        except TypeError:
            k = None
        if k is None or not 1 <= k <= n:
            raise ValueError(f"ExpandingAttention: last (how many final tokens to compute) must "
                             f"be an int in [1, n = {n}]; got {last!r}")
        last = k
        # the children are the last tokens, the parents all of them: each reads its own past
        queries = nodes("x_last", x[..., n - last:, :], features=self.d_model)
        return self.attend(self.family_name, queries, tokens, self.prior(),
                           inference=self.inference)


def expanding_attention(d_model, **kwargs) -> ExpandingAttention:
    """The expanding-attention declaration; see ``ExpandingAttention``."""
    return ExpandingAttention(d_model, **kwargs)


def _case(**kwargs):
    """The default (mean-field) reading; ``inference=None`` for the exact one."""
    m = expanding_attention(6, heads=2, a=1.5, b=2.0, dtype=torch.float64, **kwargs)
    with torch.no_grad():
        m.raw_prior.add_(torch.randn_like(m.raw_prior) * 0.3)  # heads with their own a, b
    return m, (randn64(2, 6, 6),)


#: the catalogue's statement (structattn/models/_catalogue.py): the default reading is mean field, an
#: approximation of the exact posterior; the generic tests also run the exact variant
ENTRY = Entry(expanding_attention, ExpandingAttention, case=_case,
              example=dict(d_model=8, heads=2, a=2.0, b=2.0), exact=False,
              variants={"exact": functools.partial(_case, inference=None)},
              sizes={**TOKEN_SIZES, "max_window": 1, "block_size": 1})
