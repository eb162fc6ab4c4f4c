"""Mean-field windows (structattn/windows/): the geometric–Beta prior's inference scheme.

Oracle: the mean-field fixed point against a float64 brute force of the same equations, child
by child with ``math.lgamma`` / ``scipy.special.digamma`` and a linear window search; planted
parents for the window rules."""

import contextlib
import math

import numpy as np
import pytest
import torch
from scipy import special

import structattn as sa

from ..programs import history, program, scores_of


def _lbeta(x, y):
    return math.lgamma(x) + math.lgamma(y) - math.lgamma(x + y)


def brute_mean_field(s, a, b, *, tol=0.05, max_window=None, max_iters=50, converge_tol=1e-3,
                     expectation="digamma", update="conjugate", window_rule="predictive",
                     initial_window=None, ceiling=None):
    """One head, one sequence, child by child (each has its own q_i, so each iterates alone
    until |ΔE[φ_i]| ≤ converge_tol·max(1, E[φ_i]) with its window no longer growing):
    scores ``s`` (N, N) → (posterior (N, N), final windows, iterations per child, and the
    certified bound per child at its last step). ``ceiling``: per child (reach, runs, slack):
    |scale|·‖a_i‖, the running maximum max_{j ≤ l} ‖b_j‖ over l, and the window scores'
    rounding; a parent farther back than window W scores at most reach_i·runs[i − W − 1]
    (the certified rule's)."""
    N = s.shape[0]
    cap = max(1, N - 1 if max_window is None else min(N - 1, max_window))

    def quantile(al, be):
        for w in range(1, cap + 1):
            tail = (w * math.log(al / (al + be)) if expectation == "plug_in"
                    else _lbeta(al + w, be) - _lbeta(al, be))
            if tail < math.log(tol):
                return w
        return cap

    def log_q(al, be):
        if expectation == "digamma":
            return special.digamma(al) - special.digamma(al + be)
        return math.log(al / (al + be))

    P, windows, iterations = np.zeros((N, N)), [0] * N, [0] * N
    bounds = [0.0] * N

    def certified(i, win, e, lik, ds):
        """Every unseen parent of the whole past at the ceiling, against the window's mass
        less the rounding slack."""
        reach, runs, slack = ceiling[0][i], ceiling[1], ceiling[2][i]
        high = reach * runs[max(i - win - 1, 0)] + slack
        inside = sum(math.exp(lik[k] + (ds[k] - 1) * e - slack) for k in range(win))
        outside = math.exp(high) * sum(math.exp((d - 1) * e) for d in range(win + 1, i + 1))
        return outside / (outside + inside)
    for i in range(1, N):
        start = quantile(a, b) if initial_window is None else min(initial_window, cap)
        alpha, beta, win, m_prev = a, b, min(start, i), None
        for t in range(max_iters):
            ds = np.arange(1, win + 1)
            logits = np.array([float(s[i, i - d]) for d in ds]) + (ds - 1) * log_q(alpha, beta)
            p = np.exp(logits - logits.max())
            p /= p.sum()
            m = float((p * ds).sum())
            P[i] = 0.0
            P[i, i - ds] = p
            windows[i], iterations[i] = win, t + 1
            if ceiling is not None:
                bounds[i] = certified(i, win, log_q(alpha, beta),
                                      [float(s[i, i - d]) for d in ds], ds)
            if update == "conjugate":
                new_alpha, new_beta = a + m - 1, b + 1
            else:
                new_alpha, new_beta = alpha + m - 1, beta + 1
            if window_rule == "edge":  # double while the evidence's outer half holds > tol
                lik = np.array([float(s[i, i - d]) for d in ds])
                lik = np.exp(lik - lik.max())
                outer = float((lik / lik.sum())[ds > win // 2].sum())
                new_win = min(2 * win, i, cap) if outer > tol and win < min(i, cap) else win
            elif window_rule == "evidence":  # double while the extended posterior leaves > tol
                e = log_q(alpha, beta)  # the step's E[ln q]
                lik = np.array([float(s[i, i - d]) for d in ds])
                inside = sum(math.exp(lik[k] + (ds[k] - 1) * e) for k in range(win))
                others = sorted(lik)[:-1]  # the window without its best match
                if len(others) >= 2:  # E[e^ψ] of a Gaussian fit: exp(mean + variance/2)
                    typical = math.exp(np.mean(others) + np.var(others, ddof=1) / 2)
                elif others:
                    typical = math.exp(others[0])
                else:
                    typical = math.exp(lik[0])
                outside = typical * sum(math.exp((d - 1) * e)
                                        for d in range(win + 1, min(i, cap) + 1))
                beyond = outside / (outside + inside)  # 0 when the window holds the past
                new_win = min(2 * win, i, cap) if beyond > tol and win < min(i, cap) else win
            elif window_rule == "certified":  # double while the certified bound is > tol
                new_win = min(2 * win, i, cap) if bounds[i] > tol and win < min(i, cap) else win
            else:
                new_win = max(win, min(quantile(new_alpha, new_beta), i))
            if m_prev is not None and abs(m - m_prev) <= converge_tol * max(1.0, abs(m)) \
                    and new_win == win:
                break
            alpha, beta, win, m_prev = new_alpha, new_beta, new_win, m
    return torch.tensor(P), windows, iterations, bounds


f64 = torch.float64


def ceilings(x, W, heads):
    """Per head of the Bilinear potential's factors z = W x / √d_k: per child
    |scale|·‖z_i‖ (reach), the running maximum of the keys' lengths max_{j ≤ l} ‖z_j‖ over l
    (runs), and the float64 dot product's rounding γ_k·|scale|·‖z_i‖·max_j ‖z_j‖ (slack)."""
    z = (x @ W.T).unflatten(-1, (heads, -1)).transpose(-2, -3)  # (*batch, H, N, d_k)
    k = z.shape[-1]
    unit = torch.finfo(f64).eps / 2
    gamma = k * unit / (1 - k * unit)
    reach = z.norm(dim=-1) / math.sqrt(k)
    runs = z.norm(dim=-1).cummax(-1).values
    slack = gamma * reach * runs[..., -1:] + 4 * torch.finfo(f64).tiny
    return reach, runs, slack


@pytest.mark.parametrize("expectation,update,rule", [
    ("digamma", "conjugate", "predictive"), ("plug_in", "conjugate", "predictive"),
    ("digamma", "accumulate", "predictive"), ("digamma", "conjugate", "edge"),
    ("digamma", "conjugate", "evidence"), ("plug_in", "accumulate", "evidence"),
    ("digamma", "conjugate", "certified"), ("plug_in", "accumulate", "certified")])
@pytest.mark.parametrize("n,block", [(9, 4), (23, 64), (40, 8)])
@pytest.mark.parametrize("path", ["loop", "kernel"])
def test_mean_field_fixed_point_equals_the_brute_force(n, block, expectation, update, rule,
                                                       path):
    """Both implementations: the Python loop (with its graph, as in training) and the
    compiled CPU kernel (without one, as in inference)."""
    g = torch.Generator().manual_seed(n)
    heads, d = 2, 4
    x = torch.randn(2, n, d, generator=g, dtype=f64)
    W = torch.randn(d, d, generator=g, dtype=f64) * 1.5
    a, b = torch.tensor([0.7, 2.0], dtype=f64), torch.tensor([1.3, 0.9], dtype=f64)
    start = 2 if rule in ("edge", "evidence", "certified") else None
    prior = sa.priors.BetaGeometric(a, b, block_size=block)
    scheme = sa.MeanFieldWindows(tol=0.1, expectation=expectation, update=update,
                                 window_rule=rule, initial_window=start)
    if path == "kernel":
        assert sa.kernels.available(), sa.kernels.build_error()
    with torch.no_grad() if path == "kernel" else sa.kernels.disabled():
        y, post, trace = sa.compile(program)(x, W, prior, heads, scheme, return_posterior=True,
                                             return_trace=True)
    trace = history(trace)
    s = scores_of(x, W, heads)
    reach, runs, slack = ceilings(x, W, heads)
    for bi in range(2):
        for h in range(heads):
            want, win, its, bounds = brute_mean_field(
                s[bi, h], float(a[h]), float(b[h]), tol=0.1, expectation=expectation,
                update=update, window_rule=rule, initial_window=start,
                ceiling=(reach[bi, h].tolist(), runs[bi, h].tolist(), slack[bi, h].tolist()))
            torch.testing.assert_close(post[bi, h], want, atol=1e-10, rtol=0)
            assert trace.windows[-1][bi, h].tolist() == win
            assert trace.child_iterations[bi, h].tolist() == its
            torch.testing.assert_close(trace.bound[bi, h], torch.tensor(bounds, dtype=f64),
                                       atol=1e-10, rtol=1e-8)
    assert trace.iterations == int(trace.child_iterations.max())
    v = x.unflatten(-1, (heads, -1)).transpose(-2, -3)
    torch.testing.assert_close(y, post @ v, atol=1e-10, rtol=0)


def test_windows_grow_only_and_cover_the_dependencies():
    """A chain whose true parents sit 5–12 steps back: every window ends up covering its
    parent, windows never shrink, and the band scored stays far below N."""
    torch.manual_seed(2)
    n, d = 400, 32
    keys = torch.nn.functional.normalize(torch.randn(n, d, dtype=f64), dim=-1)
    back = torch.randint(5, 13, (n,))
    target = (torch.arange(n) - back).clamp(min=0)
    x = torch.cat([keys, keys[target]], -1)[None]  # (1, n, 2d): [own key, parent's key]
    Wq = torch.cat([torch.zeros(d, d), torch.eye(d)], 1).double() * 12.0
    Wk = torch.cat([torch.eye(d), torch.zeros(d, d)], 1).double()

    def prog(x):
        t = sa.nodes("x", x)
        phi = sa.edges("attn", t, t, sa.priors.BetaGeometric(3.0, 1.0, block_size=32),
                       inference=sa.MeanFieldWindows())
        sa.potential(phi, sa.potentials.Bilinear(Wq, Wk, temperature=1.0))
        return sa.value(phi, sa.values.Identity())

    _, post, trace = sa.compile(prog)(x, return_posterior=True, return_trace=True)
    trace = history(trace)
    w = trace.windows[:, 0, 0]  # (T, n)
    assert bool((w[1:] >= w[:-1]).all())
    i = torch.arange(20, n)
    assert bool((w[-1, i] >= back[i]).all())
    assert float(post[0, 0, i, target[i]].min()) > 0.9
    assert trace.converged and max(trace.band) < n // 4
    assert 0 < trace.relative_operations(2 * d) < 0.5


def test_mean_field_approaches_exact_as_evidence_grows():
    """The mean-field posterior's total-variation gap to the exact one shrinks as the scores
    sharpen (more evidence about each φ_i)."""
    g = torch.Generator().manual_seed(3)
    x, W = torch.randn(3, 30, 4, generator=g, dtype=f64), torch.randn(4, 4, generator=g,
                                                                     dtype=f64)
    gaps = []
    for strength in (0.3, 1.0, 3.0, 10.0):
        prior = sa.priors.BetaGeometric(1.0, 2.0)
        mf = sa.MeanFieldWindows(tol=1e-3)
        _, pe = sa.compile(program)(x, W * strength ** 0.5, prior, return_posterior=True)
        _, pm = sa.compile(program)(x, W * strength ** 0.5, prior, inference=mf,
                                    return_posterior=True)
        gaps.append(float(0.5 * (pe - pm).abs().sum(-1).mean()))
    assert all(g1 > g2 for g1, g2 in zip(gaps, gaps[1:], strict=False)), gaps
    assert gaps[-1] < 0.05 < gaps[0], gaps


def test_mean_field_needs_a_factorised_potential():
    class Table(sa.potentials.base.Potential):
        def pairwise(self, children, parents):
            return children.sum(-1)[..., None, :, None] * parents.sum(-1)[..., None, None, :]

    def prog(x):
        n = sa.nodes("x", x)
        phi = sa.edges("attn", n, n, sa.priors.BetaGeometric(),
                       inference=sa.MeanFieldWindows())
        sa.potential(phi, Table())
        return sa.value(phi, sa.values.Identity())

    for kernel in (True, False):
        with contextlib.nullcontext() if kernel else sa.kernels.disabled():
            with pytest.raises(ValueError, match=r"edge family 'attn': mean-field windows need "
                                                 r"exactly one factorised potential"):
                sa.compile(prog)(torch.randn(1, 6, 4))


def test_mean_field_cannot_join_a_latent_iteration():
    def prog(x):
        z = sa.latent("z", x.clone(), scale=1.0, steps=2)
        phi = sa.edges("attn", z, z, sa.priors.BetaGeometric(), inference=sa.MeanFieldWindows())
        sa.potential(phi, sa.potentials.DotProduct())
        return sa.value(phi, sa.values.Identity())

    with pytest.raises(ValueError, match="cannot join the iteration of latent node sets"):
        sa.compile(prog)(torch.randn(1, 5, 3))


def planted_parents(*, seed, n, d, distances, gain):
    """Token i = [k_i ; k_{i − back_i}] with unit random keys k and back_i uniform on
    ``distances`` (inclusive); W_q, W_k score the planted parent ``gain``, the others
    ≈ gain·N(0, 1/d). Returns x ``(1, n, 2d)``, back, target = i − back, W_q, W_k."""
    torch.manual_seed(seed)
    keys = torch.nn.functional.normalize(torch.randn(n, d, dtype=f64), dim=-1)
    back = torch.randint(distances[0], distances[1] + 1, (n,))
    target = (torch.arange(n) - back).clamp(min=0)
    x = torch.cat([keys, keys[target]], -1)[None]
    Wq = torch.cat([torch.zeros(d, d), torch.eye(d)], 1).double() * gain
    Wk = torch.cat([torch.eye(d), torch.zeros(d, d)], 1).double()
    return x, back, target, Wq, Wk


def test_edge_rule_looks_further_back_until_it_finds_the_parent():
    """From a window of 2, the edge rule doubles each token's window while the evidence leans
    on its outer half: tokens whose parent sits 5–40 steps back find it."""
    n = 300
    x, back, target, Wq, Wk = planted_parents(seed=8, n=n, d=128, distances=(5, 40), gain=12.0)

    def prog(x):
        t = sa.nodes("x", x)
        scheme = sa.MeanFieldWindows(window_rule=sa.windows.EdgeRule(), initial_window=2,
                                     tol=0.05)
        phi = sa.edges("attn", t, t, sa.priors.BetaGeometric(8.0, 1.0), inference=scheme)
        sa.potential(phi, sa.potentials.Bilinear(Wq, Wk, temperature=1.0))
        return sa.value(phi, sa.values.Identity())

    _, post, trace = sa.compile(prog)(x, return_posterior=True, return_trace=True)
    trace = history(trace)
    i = torch.arange(41, n)
    w = trace.windows[-1, 0, 0]
    found = w[i] >= back[i]
    # a small window can look decisive by chance (two distractors far apart in score): those
    # tokens stop early; the rest find their parent with a window under four times its distance
    assert float(found.double().mean()) > 0.8, float(found.double().mean())
    assert bool((w[i][found] <= 4 * back[i][found]).all())
    assert float(post[0, 0, i[found], target[i[found]]].min()) > 0.9
    assert trace.converged


def test_evidence_rule_stops_where_the_parent_stands_out():
    """Parents 2–60 steps back, a wide prior (a = 30, b = 2: mean distance ≈ 16): from a
    window of 4 the evidence rule doubles until a match stands out of the window's noise.
    Tokens find their parent with windows at most twice its distance (or 4); the predictive
    rule, which looks only at the prior's tail, reads far more of the past for the same
    parents."""
    n = 400
    x, back, target, Wq, Wk = planted_parents(seed=3, n=n, d=64, distances=(2, 60), gain=10.0)

    def prog(x, rule):
        t = sa.nodes("x", x)
        scheme = sa.MeanFieldWindows(window_rule=rule, initial_window=4, tol=0.05)
        phi = sa.edges("attn", t, t, sa.priors.BetaGeometric(30.0, 2.0), inference=scheme)
        sa.potential(phi, sa.potentials.Bilinear(Wq, Wk, temperature=1.0))
        return sa.value(phi, sa.values.Identity())

    i = torch.arange(61, n)
    _, post, trace = sa.compile(prog)(x, "evidence", return_posterior=True, return_trace=True)
    w = history(trace).windows[-1, 0, 0][i]
    found = w >= back[i]
    assert float(found.double().mean()) > 0.95, float(found.double().mean())
    assert bool((w[found] <= torch.maximum(2 * back[i][found], torch.tensor(4))).all())
    assert float(post[0, 0, i[found], target[i[found]]].min()) > 0.9
    _, wide = sa.compile(prog)(x, "predictive", return_trace=True)
    assert float(w.double().mean()) < 0.5 * float(history(wide).windows[-1, 0, 0][i].double()
                                                  .mean())


def test_grad_last_trains_a_and_b_and_agrees_with_the_forward():
    """grad="last": a and b get gradients; and a child stopped by max_iters keeps the Beta and
    window of its final posterior, so the differentiable step reproduces the forward (also
    when nothing converged)."""
    torch.manual_seed(9)
    x, W = torch.randn(2, 30, 4, dtype=f64), torch.randn(4, 4, dtype=f64) * 2
    for max_iters in (1, 2, 50):
        prior = sa.priors.BetaGeometric(2.0, 0.7)
        last = sa.MeanFieldWindows(max_iters=max_iters, initial_window=2, grad="last")
        unroll = sa.MeanFieldWindows(max_iters=max_iters, initial_window=2, grad="unroll")
        _, p_last = sa.compile(program)(x, W, prior, inference=last, return_posterior=True)
        _, p_unroll = sa.compile(program)(x, W, prior, inference=unroll, return_posterior=True)
        with torch.no_grad():
            _, p_free = sa.compile(program)(x, W, prior, inference=last, return_posterior=True)
        # structattn.iteration(grad=…) sets the same option, for latents and windows alike
        with sa.iteration(grad="last"):
            _, p_over = sa.compile(program)(x, W, prior, inference=unroll, return_posterior=True)
        torch.testing.assert_close(p_over, p_last, atol=0, rtol=0)
        torch.testing.assert_close(p_last, p_unroll, atol=1e-12, rtol=0)
        torch.testing.assert_close(p_free, p_unroll, atol=1e-12, rtol=0)
    m = sa.models.expanding_attention(4, heads=2, inference=sa.MeanFieldWindows(grad="last"),
                                      dtype=f64)
    sa.compile(m)(torch.randn(2, 12, 4, dtype=f64)).sum().backward()
    assert m.raw_prior.grad is not None and bool(torch.isfinite(m.raw_prior.grad).all())
    assert bool((m.raw_prior.grad != 0).all())


def test_a_window_rule_of_ones_own_runs_in_the_loop():
    """A user's rule (grow by one while the evidence's best match sits at the window's edge)
    is a small WindowRule subclass; with no kernel code it runs in the Python loop, also
    where the kernel would serve the built-in rules."""

    class OneMore(sa.windows.WindowRule):
        name = "one more"

        def grow(self, r):
            lik = r.scores.outer_evidence(r.rows, r.window)  # evidence on the outer half
            return torch.where((lik > r.tol) & (r.window < r.caps), r.window + 1, r.window)

    g = torch.Generator().manual_seed(4)
    x, W = torch.randn(1, 20, 4, generator=g, dtype=f64), torch.randn(4, 4, generator=g,
                                                                     dtype=f64)
    prior = sa.priors.BetaGeometric(1.0, 2.0, block_size=8)
    scheme = sa.MeanFieldWindows(window_rule=OneMore(), initial_window=1, max_iters=30)
    assert sa.kernels.available()
    with torch.no_grad():
        _, post, trace = sa.compile(program)(x, W, prior, inference=scheme,
                                             return_posterior=True, return_trace=True)
    w = history(trace).windows  # (T, 1, 1, n)
    assert bool((w[1:] - w[:-1]).max() <= 1) and bool((w[1:] >= w[:-1]).all())
    # each posterior row puts its mass on its final window exactly
    d = torch.arange(20)[:, None] - torch.arange(20)[None, :]
    inside = (d >= 1) & (d <= w[-1, 0, 0][:, None])
    assert float(post[0, 0][~inside].abs().max()) == 0.0
    torch.testing.assert_close(post[0, 0, 1:].sum(-1), torch.ones(19, dtype=f64), atol=1e-12,
                               rtol=0)
    assert int(w[-1].max()) > 1  # it grew somewhere


@pytest.mark.parametrize("expectation", ["digamma", "plug_in"])
@pytest.mark.parametrize("a0, b0, initial", [(1.0, 1.0, None), (16.0, 2.0, None),
                                             (0.7, 1.3, None), (2.0, 1.0, 5)])
@pytest.mark.parametrize("rule", ["certified", "edge"])
def test_first_windows_are_the_bisections(expectation, a0, b0, initial, rule):
    """One first window per head, read from every W at once (``first_windows``, what the
    Triton solve takes), then each child's taken at most its past (``initial_windows``):
    equal to ``beta_quantile``'s bisection (or the plug-in geometric's closed form) at the
    rule's start. Beta(1, 1) at the median puts P(φ > 1) = ½ exactly on the threshold, where
    the same function must give the same W."""
    from structattn.certificates.beta import beta_quantile, plug_in_quantile

    scheme = sa.MeanFieldWindows(tol=0.05, expectation=expectation, window_rule=rule,
                                 initial_window=initial)
    a0s, b0s = torch.tensor([a0, a0 * 2], dtype=f64), torch.tensor([b0, b0], dtype=f64)
    quantile = beta_quantile if expectation == "digamma" else plug_in_quantile
    for cap in (1, 7, 300):
        caps, got = scheme.initial_windows(a0s, b0s, (3, 2), 40, cap, offset=5)
        head = torch.full((2,), min(initial, cap)) if initial is not None else \
            quantile(a0s, b0s, scheme.window_rule.start_tail or scheme.tol, cap)
        assert torch.equal(scheme.first_windows(a0s, b0s, cap), head)
        assert torch.equal(got, torch.minimum(head[:, None].expand(3, 2, 40), caps[5:]))
