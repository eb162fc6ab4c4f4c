"""Certified truncation (``structattn.certificates.certified``; ``BetaGeometric(tol=ε)``): the
posterior mass left outside the window never exceeds the reported bound.

The oracle is a dense float64 softmax written here: the beta-geometric log prior from
scipy's ``betaln`` (not structattn's ``log_beta``), the scores as a plain matmul, the mass
beyond the window summed over every past parent. Nothing of the band or of ``certify`` is
reused."""

import contextlib
import math

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from scipy import special

import structattn as sa
from structattn.certificates.ceilings import block_tail_ceilings
from structattn.certificates.certified import certify, skipped_pairs, window_bound

f64 = torch.float64


def log_prior(a, b, n):
    """``(H, N, N)``: log p(φ_i = i − j) = log B(a + d − 1, b + 1) − log B(a, b) for d ≥ 1,
    −∞ elsewhere (scipy)."""
    d = np.arange(n)[:, None] - np.arange(n)[None, :]
    out = []
    for ah, bh in zip(np.atleast_1d(a), np.atleast_1d(b), strict=True):
        lp = special.betaln(ah + np.maximum(d, 1) - 1, bh + 1) - special.betaln(ah, bh)
        out.append(np.where(d >= 1, lp, -np.inf))
    return torch.tensor(np.stack(out))


def dense_posterior(a, b, scale, ab):
    """p(φ_i = j) ``(*batch, H, N, N)`` over the whole past (row 0: zeros), float64."""
    n = a.shape[-2]
    logits = scale * a.to(f64) @ b.to(f64).transpose(-1, -2) + log_prior(*ab, n)
    return torch.softmax(logits, -1).nan_to_num(0.0)


def beyond(p, width):
    """The posterior mass farther back than ``width``, per child ``(*batch, H, N)``."""
    n = p.shape[-1]
    d = torch.arange(n)[:, None] - torch.arange(n)[None, :]
    return (p * (d > width)).sum(-1)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 120), heads=st.integers(1, 3), k=st.integers(1, 6),
       sharp=st.floats(0.1, 3.0), scale=st.floats(-2.0, 2.0).filter(lambda s: abs(s) > 1e-3),
       eps_exp=st.integers(1, 6), block=st.integers(1, 40), start=st.integers(1, 20),
       seed=st.integers(0, 2**31 - 1), planted=st.booleans())
def test_the_true_posterior_mass_beyond_the_window_never_exceeds_the_bound(
        n, heads, k, sharp, scale, eps_exp, block, start, seed, planted):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(2, heads, n, k, generator=g, dtype=f64) * sharp
    b = torch.randn(2, heads, n, k, generator=g, dtype=f64)
    if planted and n > 4:  # a strong match far back for the last token
        b[..., 1, :] = a[..., -1, :] * 3 * np.sign(scale)
    ab = (torch.rand(heads, generator=g, dtype=f64) * 6 + 0.2,
          torch.rand(heads, generator=g, dtype=f64) * 6 + 0.2)
    prior = sa.priors.BetaGeometric(*ab)
    eps = 10.0 ** -eps_exp
    c = certify(a, b, scale, prior, eps, start=start, block=block)
    assert c.certified and 1 <= c.width <= n - 1
    assert bool((c.bound <= eps).all())
    true = beyond(dense_posterior(a, b, scale, (ab[0].numpy(), ab[1].numpy())), c.width)
    assert bool((true <= c.bound * (1 + 1e-9) + 1e-300).all()), float((true - c.bound).max())
    # the per-child windows certify each child alone, and the width is the largest of them
    assert int(c.window.max()) == c.width and bool((c.window >= 1).all())
    assert c.skipped == pytest.approx(skipped_pairs(n, c.width))


def test_the_certificate_holds_for_float32_scores():
    """The dot products' rounding is charged to the bound: float32 factors, the truth from
    the same factors in float64."""
    g = torch.Generator().manual_seed(3)
    n, k = 600, 64
    a = (torch.randn(1, 2, n, k, generator=g) * 0.4).float()
    b = torch.randn(1, 2, n, k, generator=g).float()
    ab = (np.array([16.0, 2.0]), np.array([8.0, 8.0]))  # tails ~ W^-8: short windows
    prior = sa.priors.BetaGeometric(torch.tensor(ab[0]), torch.tensor(ab[1]))
    c = certify(a, b, 0.125, prior, 1e-4)
    assert c.bound.dtype == torch.float64 and c.width < n - 1  # something is skipped
    true = beyond(dense_posterior(a, b, 0.125, ab), c.width)
    assert bool((true <= c.bound).all())


def _identity_layer(**kwargs):
    m = sa.models.expanding_attention(2, heads=1, a=2.0, b=2.0, inference=None,
                                      temperature=1.0, dtype=f64, **kwargs)
    with torch.no_grad():
        for w in (m.W_q, m.W_k, m.W_v, m.W_o):
            w.copy_(torch.eye(2, dtype=f64))
    return m


@torch.no_grad()
def test_a_strong_match_behind_a_light_prior_tail_is_read():
    """The issue's counterexample: x = 0 but for tokens 5 and 39, equal and strong. The
    prior's tail is below 0.05 beyond distance 9, yet token 39's parent is 34 back."""
    x = torch.zeros(1, 40, 2, dtype=f64)
    x[0, 5] = x[0, 39] = torch.tensor([6.0, 0.0], dtype=f64)
    y_full, p_full = sa.compile(_identity_layer())(x, return_posterior=True)
    assert float(p_full[0, 0, 39, 5]) > 0.999
    y, p, trace = sa.compile(_identity_layer(tol=0.05))(x, return_posterior=True,
                                                        return_trace=True)
    cut = trace.truncation["attn"]
    assert int(cut.window[0, 0, 39]) >= 34 and cut.width >= 34
    torch.testing.assert_close(p[0, 0, 39], p_full[0, 0, 39], atol=0.05, rtol=0)
    assert float((y - y_full).abs().max()) <= 6 * 0.05
    # the old rule, kept by its own name, cuts the support where the prior's tail is light
    y_old, p_old = sa.compile(_identity_layer(prior_tol=0.05))(x, return_posterior=True)
    assert float(p_old[0, 0, 39, 5]) == 0.0 and float((y_old - y_full).abs().max()) > 5


@pytest.mark.parametrize("tol", [0.05, 1e-4])
@torch.no_grad()
def test_the_compiled_layer_stays_within_its_bound_of_the_whole_past(tol):
    """Through the model: each token's windowed posterior is within the reported bound of
    the whole-past one in total variation, and the output moves by at most bound·max‖v‖."""
    torch.manual_seed(5)
    n, d = 300, 16
    x = torch.randn(2, n, d, dtype=f64)
    x[:, 1:] = 0.7 * x[:, :-1] + 0.3 * x[:, 1:]  # nearby tokens alike: windows stay short
    full = sa.models.expanding_attention(d, heads=2, a=2.0, b=8.0, inference=None,
                                         dtype=f64)
    cut = sa.models.expanding_attention(d, heads=2, a=2.0, b=8.0, inference=None, tol=tol,
                                        dtype=f64)
    cut.load_state_dict(full.state_dict())
    _, p_full = sa.compile(full)(x, return_posterior=True)
    y, p, trace = sa.compile(cut)(x, return_posterior=True, return_trace=True)
    c = trace.truncation["attn"]
    assert c.certified and c.width < n - 1 and c.skipped > 0
    tv = (p - p_full).abs().sum(-1) / 2  # (2, H, N)
    assert bool((tv <= c.bound + 1e-12).all())
    assert bool((c.bound <= tol).all())
    # the output without the trace is the same computation
    torch.testing.assert_close(sa.compile(cut)(x), y, atol=1e-12, rtol=0)


@torch.no_grad()
def test_the_window_is_chosen_again_for_every_call():
    """The window depends on the data: a replayed call must not keep the first call's."""
    layer = sa.compile(_identity_layer(tol=0.05))
    quiet = torch.zeros(1, 40, 2, dtype=f64)
    quiet[0, 36] = quiet[0, 39] = torch.tensor([6.0, 0.0], dtype=f64)
    far = torch.zeros(1, 40, 2, dtype=f64)
    far[0, 5] = far[0, 39] = torch.tensor([6.0, 0.0], dtype=f64)
    for x in (quiet, quiet, quiet, far, far, quiet, far):
        want = layer.interpret(x)
        torch.testing.assert_close(layer(x), want, atol=0, rtol=0)


def test_gradients_through_a_certified_window():
    torch.manual_seed(2)
    m = sa.models.expanding_attention(4, heads=2, a=1.5, b=3.0, inference=None, tol=0.05,
                                      block_size=4, dtype=f64)
    # slow drift: short windows; 48 tokens, since a band wider than half the sequence (here
    # 16 + 4 of 30) is not read: it would cost more than the whole past
    x = torch.randn(1, 48, 4, dtype=f64).cumsum(-2) * 0.05
    layer = sa.compile(m)
    _, trace = layer(x, return_trace=True)
    assert trace.truncation["attn"].width < 47
    params = [m.W_q, m.W_k, m.raw_prior]

    def f(xx, *ps):
        return layer(xx)
    torch.autograd.gradcheck(f, (x.requires_grad_(), *params))


def test_prior_tail_mass_is_zero_where_nothing_is_cut():
    """``discarded_mass`` reported 0.595 for a window holding the whole past."""
    prior = sa.priors.BetaGeometric(20.0, 0.5, prior_tol=0.05)
    assert prior.window(37) == 36
    assert float(prior.discarded_mass(37)[0]) == 0.0
    assert float(prior.discarded_mass(400)[0]) < 0.05


def test_bad_certificate_arguments_are_refused():
    a = torch.randn(1, 1, 5, 2)
    with pytest.raises(ValueError, match=r"eps .* must be in \(0, 1\); got 0"):
        certify(a, a, 1.0, sa.priors.BetaGeometric(), 0)
    with pytest.raises(ValueError, match="factors of the same N tokens"):
        certify(a, a[..., :4, :], 1.0, sa.priors.BetaGeometric(), 0.1)
    with pytest.raises(ValueError, match=r"prior_tol \(an option of the exact reading's prior, "
                                         r"inference=None\) must be None with a mean-field"):
        sa.models.expanding_attention(4, prior_tol=0.1)


def _mean_field_layer(**options):
    m = sa.models.expanding_attention(2, heads=1, a=2.0, b=2.0, temperature=1.0, dtype=f64,
                                      inference=sa.MeanFieldWindows(**options))
    with torch.no_grad():
        for w in (m.W_q, m.W_k, m.W_v, m.W_o):
            w.copy_(torch.eye(2, dtype=f64))
    return m


@pytest.mark.parametrize("kernel", [True, False])
@torch.no_grad()
def test_mean_field_windows_find_a_strong_match_behind_a_light_prior_tail(kernel):
    """The counterexample under the default (mean-field, certified) reading: token 39's
    parent, 34 back, is found; the prior-predictive rule, kept by its name, stops at 9."""
    x = torch.zeros(1, 40, 2, dtype=f64)
    x[0, 5] = x[0, 39] = torch.tensor([6.0, 0.0], dtype=f64)
    with contextlib.nullcontext() if kernel else sa.kernels.disabled():
        _, p, trace = sa.compile(_mean_field_layer(tol=0.05))(x, return_posterior=True,
                                                             return_trace=True)
        h = trace.mean_field["attn"]
        assert int(h.windows[-1, 0, 0, 39]) >= 34 and float(p[0, 0, 39, 5]) > 0.99
        assert bool((h.bound <= 0.05).all())
        _, p_old, t_old = sa.compile(_mean_field_layer(tol=0.05, window_rule="predictive"))(
            x, return_posterior=True, return_trace=True)
        old = t_old.mean_field["attn"]
        assert int(old.windows[-1, 0, 0, 39]) < 34 and float(p_old[0, 0, 39, 5]) == 0.0
        assert float(old.bound[0, 0, 39]) > 0.5  # and its reported bound says so


@pytest.mark.parametrize("rule", ["certified", "predictive", "evidence"])
@torch.no_grad()
def test_the_mean_field_bound_holds_over_the_whole_past(rule):
    """At each token's final q, the φ-update over all of its past — p(φ_i = d) ∝
    exp(ψ_{i,i−d} + d·E[ln q_i]), dense, float64, written here — puts at most the reported
    bound beyond the window, whatever rule chose the window."""
    torch.manual_seed(11)
    n, d, heads = 200, 8, 2
    x = torch.randn(2, n, d, dtype=f64)
    x[:, 1:] = 0.6 * x[:, :-1] + 0.4 * x[:, 1:]
    x[:, -1] = x[:, 20] * 2  # a strong (or strongly negative) match far back
    m = sa.models.expanding_attention(d, heads=heads, a=2.0, b=2.0, dtype=f64,
                                      inference=sa.MeanFieldWindows(tol=1e-3, window_rule=rule))
    _, trace = sa.compile(m)(x, return_trace=True)
    h = trace.mean_field["attn"]
    q = (x @ m.W_q.T).unflatten(-1, (heads, -1)).transpose(-2, -3)
    k = (x @ m.W_k.T).unflatten(-1, (heads, -1)).transpose(-2, -3)
    psi = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # temperature 1
    alpha, beta = h.alpha[-1], h.beta[-1]
    e = torch.tensor(special.digamma(alpha.numpy()) - special.digamma((alpha + beta).numpy()))
    dist = (torch.arange(n)[:, None] - torch.arange(n)[None, :]).to(f64)
    logits = (psi + dist * e[..., None]).masked_fill(dist < 1, float("-inf"))
    p = torch.softmax(logits, -1).nan_to_num(0.0)
    outside = (p * (dist > h.windows[-1][..., None])).sum(-1)
    assert bool((outside <= h.bound * (1 + 1e-9) + 1e-300).all())
    if rule == "certified":
        assert bool((h.bound <= 1e-3).all())


# -- per-block score bounds (ceilings.block_tail_ceilings) --------------------------------------
@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 150), k=st.integers(1, 8), key_block=st.integers(1, 40),
       scale=st.floats(-2.0, 2.0).filter(lambda s: abs(s) > 1e-3),
       spread=st.floats(0.01, 2.0), seed=st.integers(0, 2**31 - 1))
def test_block_ceilings_bound_every_score_beyond_each_width(n, k, key_block, scale, spread, seed):
    """S_i(W) ≥ scale·⟨a_i, b_j⟩ for every j < i − W (brute force), keys clustered or spread;
    with blocks of one key the box bound is the score itself."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(2, n, k, generator=g, dtype=f64)
    b = torch.randn(k, generator=g, dtype=f64) + spread * torch.randn(2, n, k, generator=g,
                                                                       dtype=f64)
    widths = sorted({1, max(1, n // 3), max(1, n - 1)})
    got = block_tail_ceilings(a, b, scale, widths, key_block=key_block)
    scores = scale * a @ b.transpose(-1, -2)  # (2, n, n)
    for w in widths:
        i, j = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
        beyond = scores.masked_fill(~(j < i - w), -torch.inf).amax(-1)  # (2, n)
        has = (torch.arange(n) - w - 1) >= 0
        assert bool((got[w][..., has] >= beyond[..., has] - 1e-12).all())
    exact = block_tail_ceilings(a, b, scale, widths, key_block=1)
    for w in widths:
        i, j = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
        beyond = scores.masked_fill(~(j < i - w), -torch.inf).amax(-1)
        has = (torch.arange(n) - w - 1) >= 0
        torch.testing.assert_close(exact[w][..., has], beyond[..., has], rtol=0, atol=1e-12)


def test_clustered_keys_pointing_away_certify_a_narrow_window_where_the_longest_key_cannot(
        monkeypatch):
    """Keys clustered around a direction the queries point away from (a trained layer's
    keys often share a direction): every far score is negative, but the longest key's
    Cauchy–Schwarz ceiling ‖a_i‖·‖b‖ is large and positive. The per-block bound certifies a
    narrow window; the ceiling alone needs far more. Both sound."""
    import structattn.certificates.certified as certified

    g = torch.Generator().manual_seed(5)
    n, k = 512, 16
    u = torch.nn.functional.normalize(torch.randn(k, generator=g, dtype=f64), dim=0)
    a = -8.0 * u + 0.3 * torch.randn(1, 2, n, k, generator=g, dtype=f64)
    b = 6.0 * u + 0.1 * torch.randn(1, 2, n, k, generator=g, dtype=f64)
    ab = (np.array([16.0, 2.0]), np.array([8.0, 8.0]))  # tails ~ W^-8: the scores decide
    prior = sa.priors.BetaGeometric(torch.tensor(ab[0]), torch.tensor(ab[1]))
    c = certify(a, b, 0.25, prior, 1e-4)
    true = beyond(dense_posterior(a, b, 0.25, ab), c.width)
    assert bool((true <= c.bound * (1 + 1e-9)).all())
    monkeypatch.setattr(certified, "block_tail_ceilings",  # no per-block information
                        lambda a, b, scale, widths, **kw: {w: torch.tensor(math.inf) for w in widths})
    ball = certify(a, b, 0.25, prior, 1e-4)
    assert c.width * 4 <= ball.width, (c.width, ball.width)  # here 64 against 511
    assert c.skipped > 0.75 and ball.skipped == 0.0


@settings(max_examples=15, deadline=None)
@given(n=st.integers(2, 90), width=st.integers(1, 100), block=st.sampled_from([4, 16, 32]),
       seed=st.integers(0, 2**31 - 1))
def test_the_bound_at_one_given_width_holds_and_is_what_certify_reports(n, width, block, seed):
    """``window_bound`` — the certificate an exported program asserts at its runtime width —
    bounds the true mass beyond any width, and at the width ``certify`` chose it is the bound
    ``certify`` reports (the keys spread: no per-block ceiling is needed)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(2, 2, n, 4, generator=g, dtype=f64)
    b = torch.randn(2, 2, n, 4, generator=g, dtype=f64)
    ab = (np.array([3.0, 0.7]), np.array([6.0, 1.5]))
    prior = sa.priors.BetaGeometric(torch.tensor(ab[0]), torch.tensor(ab[1]))
    bound = window_bound(a, b, 0.5, prior, width, first=1, block=block)
    true = beyond(dense_posterior(a, b, 0.5, ab), min(width, n - 1))
    assert bound.shape == (2, 2, n) and bool((true <= bound * (1 + 1e-9) + 1e-300).all())
    c = certify(a, b, 0.5, prior, 1e-3, block=block)
    torch.testing.assert_close(window_bound(a, b, 0.5, prior, c.width, first=1, block=block),
                               c.bound, rtol=1e-9, atol=1e-300)
