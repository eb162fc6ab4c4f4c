"""Expanding attention: the geometric–Beta prior, exact and mean-field (SPEC.md §5.2).

Oracles, none of which reads structattn's lowering:

- the beta-geometric pmf against Pyro's Beta and Geometric log-densities integrated
  numerically over q (scipy's adaptive quadrature);
- the exact posterior against a Pyro model written here, q_i enumerated over Gauss–Jacobi
  nodes (exact for the polynomial-in-q geometric likelihood) and the edges enumerated,
  marginals by ``TraceEnum_ELBO.compute_marginals``;
- the mean-field fixed point against a float64 brute force of the same equations, child by
  child with ``math.lgamma`` / ``scipy.special.digamma`` and a linear window search.
"""

import contextlib
import math
import warnings

import hypothesis.strategies as st
import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from hypothesis import given, settings
from pyro.infer import TraceEnum_ELBO
from pyro.ops.indexing import Vindex
from scipy import integrate, special

import structattn as sa

f64 = torch.float64


def program(x, W, prior, heads=1):
    n = sa.nodes("x", x)
    phi = sa.edges("attn", n, n, prior, heads=heads)
    sa.potential(phi, sa.potentials.Bilinear(W, W, heads=heads))
    return sa.value(phi, sa.values.Identity(heads=heads))


def scores_of(x, W, heads):
    """ψ_ij = ⟨W x_i, W x_j⟩_h / √d_k per head: ``(*batch, H, N, N)`` (the Bilinear potential)."""
    z = (x @ W.T).unflatten(-1, (heads, -1)).transpose(-2, -3)  # (*batch, H, N, d_k)
    return z @ z.transpose(-1, -2) / math.sqrt(z.shape[-1])


# -- the pmf ------------------------------------------------------------------------------
@pytest.mark.parametrize("a,b", [(1.0, 1.0), (0.4, 2.5), (3.0, 0.7)])
def test_pmf_is_the_beta_integral_of_the_geometric(a, b):
    prior = sa.priors.BetaGeometric(a, b)
    d = torch.arange(1, 13)
    got = prior.log_pmf(d)[0].exp()
    beta = dist.Beta(torch.tensor(a, dtype=f64), torch.tensor(b, dtype=f64))
    for k, dk in enumerate(d.tolist()):
        def integrand(q, dk=dk):
            q = torch.tensor(q, dtype=f64)
            geo = dist.Geometric(probs=1 - q).log_prob(torch.tensor(dk - 1.0, dtype=f64))
            return float((beta.log_prob(q) + geo).exp())
        want, _ = integrate.quad(integrand, 0, 1, epsabs=1e-13, epsrel=1e-11, limit=200)
        assert float(got[k]) == pytest.approx(want, rel=1e-7, abs=1e-12)
    # the tail: P(φ > W) = 1 − Σ_{d ≤ W} p(d)
    assert float(prior.log_tail(12).exp()[0]) == pytest.approx(1 - float(got.sum()), abs=1e-12)


# -- exact: against an independent Pyro model ------------------------------------------------
def pyro_oracle(s, a, b):
    """Edge marginals p(φ_i = j | x) ``(*batch, H, N, N)`` for scores ``s`` ``(*batch, H, N, N)``:
    q_i enumerated over Gauss–Jacobi nodes for the Beta(a, b) weight (exact: the likelihood of
    each φ_i is a polynomial of degree < N in q), φ_i over its past, enumerated."""
    *batch, H, N, _ = s.shape
    a, b = (torch.as_tensor(v, dtype=f64).reshape(-1) for v in (a, b))
    nodes, logw = [], []
    for h in range(H):  # per head: its own Beta weight
        ah, bh = float(a[h % len(a)]), float(b[h % len(b)])
        x, w = special.roots_jacobi(N + 1, bh - 1, ah - 1)  # weight (1 − x)^(b−1)(1 + x)^(a−1)
        nodes.append(torch.tensor((1 + x) / 2))
        logw.append(torch.log(torch.tensor(w / w.sum())))
    q_nodes, q_logw = torch.stack(nodes), torch.stack(logw)  # (H, K)
    dist_ij = torch.arange(N)[:, None] - torch.arange(N)[None, :]  # (N, N): i − j
    past = dist_ij >= 1

    def model():
        with contextlib.ExitStack() as plates:  # size-1 dims stay unplated (Pyro's rule)
            for name, size, dim in (("children", N - 1, -1), ("heads", H, -2),
                                    ("batch", int(np.prod(batch)) if batch else 1, -3)):
                if size > 1:
                    plates.enter_context(pyro.plate(name, size, dim=dim))
            k = pyro.sample("q", dist.Categorical(logits=q_logw[:, None, :].expand(
                H, N - 1, -1)), infer={"enumerate": "parallel"})  # (…, H, N−1)
            q = q_nodes[torch.arange(H)[:, None], k]  # (…, H, N−1)
            # φ_i | q: geometric over d = i − j ≥ 1, on the past (children 1..N−1)
            geo = dist.Geometric(probs=1 - q[..., None]).log_prob(
                (dist_ij[1:] - 1).clamp(min=0).to(f64))  # (…, H, N−1, N)
            logits = torch.where(past[1:], geo, torch.tensor(-math.inf, dtype=f64))
            # the mass the geometric puts beyond the start (φ_i > i) has no parent
            pyro.factor("past", torch.logsumexp(logits, -1))
            phi = pyro.sample("phi", dist.Categorical(logits=logits),
                              infer={"enumerate": "parallel"})
            flat = s.reshape(-1, H, N, N)[:, :, 1:, :]  # (B, H, N−1, N)
            pyro.factor("psi", Vindex(flat)[..., phi])

    marg = TraceEnum_ELBO(max_plate_nesting=3).compute_marginals(model, lambda: None)
    probs = marg["phi"].probs.detach() if hasattr(marg["phi"], "probs") else marg["phi"].logits.softmax(-1)
    probs = probs.expand(int(np.prod(batch)) if batch else 1, H, N - 1, N)
    out = torch.zeros(*batch, H, N, N, dtype=f64)
    out[..., 1:, :] = probs.reshape(*batch, H, N - 1, N)
    return out


@settings(max_examples=8, deadline=None, derandomize=True)
@given(n=st.integers(2, 7), heads=st.sampled_from([1, 2]), batch=st.integers(1, 2),
       a=st.floats(0.3, 4.0), b=st.floats(0.3, 4.0), scale=st.floats(0.2, 2.0))
def test_exact_posterior_equals_pyro_with_q_enumerated(n, heads, batch, a, b, scale):
    g = torch.Generator().manual_seed(n * 7 + heads)
    d = 2 * heads
    x = torch.randn(batch, n, d, generator=g, dtype=f64) * scale
    W = torch.randn(d, d, generator=g, dtype=f64)
    prior = sa.priors.BetaGeometric(torch.tensor([a, b][:heads], dtype=f64),
                                    torch.tensor([b, a][:heads], dtype=f64))
    y, post = sa.compile(program)(x, W, prior, heads, return_posterior=True)
    want = pyro_oracle(scores_of(x, W, heads), prior.a, prior.b)
    torch.testing.assert_close(post, want, atol=1e-6, rtol=0)
    v = x.unflatten(-1, (heads, -1)).transpose(-2, -3)
    torch.testing.assert_close(y, want @ v, atol=1e-6, rtol=0)
    assert float(y[..., 0, :].abs().max()) == 0.0  # token 0 has no past: zero output


def test_the_declarations_own_pyro_reading_agrees():
    torch.manual_seed(0)
    m = sa.models.expanding_attention(6, heads=2, a=0.8, b=1.7, variant="exact", dtype=f64)
    report = sa.inference.compare(m, torch.randn(2, 7, 6, dtype=f64))
    assert report.passed and report.max_abs_diff < 1e-10, str(report)


def test_last_tokens_against_pyro_and_the_full_forward():
    """``layer(x, last=k)``: children are the last k tokens, parents all n. Exact: Pyro's own
    reading of that declaration (children at positions n − k + i). Both variants, both
    mean-field paths, with and without a graph: the rows of the full forward, its posterior
    rows, its trace columns, and the same gradients."""
    torch.manual_seed(12)
    x = torch.randn(2, 30, 6, dtype=f64)
    m = sa.models.expanding_attention(6, heads=2, a=0.8, b=1.7, variant="exact", dtype=f64)
    report = sa.inference.compare(m, x[:, :7], last=3)
    assert report.passed and report.max_abs_diff < 1e-10, str(report)
    for variant, grad in (("exact", "unroll"), ("mean_field", "unroll"), ("mean_field", "last")):
        m = sa.models.expanding_attention(6, heads=2, a=1.5, b=1.0, variant=variant, grad=grad,
                                          window_rule="evidence", initial_window=2, dtype=f64)
        layer = sa.compile(m)
        for kernel in (True, False):
            with contextlib.nullcontext() if kernel else sa.kernels.disabled():
                with torch.no_grad():
                    y, post = layer(x, return_posterior=True)
                    y4, post4 = layer(x, last=4, return_posterior=True)
                torch.testing.assert_close(y4, y[:, -4:], atol=1e-12, rtol=0)
                torch.testing.assert_close(post4, post[..., -4:, :], atol=1e-12, rtol=0)
                if variant == "mean_field":
                    with torch.no_grad():
                        _, t = layer(x, return_trace=True)
                        _, t4 = layer(x, last=4, return_trace=True)
                        _, t1 = layer(x, last=1, return_trace=True)
                    assert torch.equal(t4.windows[-1], t.windows[-1][..., -4:])
                    assert torch.equal(t4.child_iterations, t.child_iterations[..., -4:])
                    # the metrics count the last tokens' windows against reading all 30
                    w4 = t4.windows[-1].double()
                    assert t4.offset == 26 and t4.mean_window == pytest.approx(float(w4.mean()))
                    assert t1.mean_window == pytest.approx(float(t1.windows[-1].double().mean()))
                    its = t4.child_iterations.double()
                    assert t4.relative_operations(6) == pytest.approx(
                        float((w4 * (6 + its + 1)).mean()) / (30 * 6))
                xg = x.clone().requires_grad_()
                grads = []
                for last in (None, 4):
                    m.zero_grad()
                    xg.grad = None
                    out = layer(xg)[:, -4:] if last is None else layer(xg, last=last)
                    (out ** 2).sum().backward()
                    grads.append([xg.grad.clone()] + [p.grad.clone() for p in m.parameters()])
                for got, want in zip(*grads, strict=True):
                    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


def test_truncated_exact_is_the_renormalised_window_and_reports_the_discarded_mass():
    torch.manual_seed(1)
    x, W = torch.randn(2, 40, 4, dtype=f64), torch.randn(4, 4, dtype=f64)
    full = sa.priors.BetaGeometric(2.0, 3.0)
    cut = sa.priors.BetaGeometric(2.0, 3.0, tol=0.02, block_size=8)
    w = cut.window(40)
    assert 1 <= w < 39
    tail = 1 - full.log_pmf(torch.arange(1, w + 1))[0].exp().sum()
    assert float(cut.discarded_mass(40)[0]) == pytest.approx(float(tail), rel=1e-9)
    assert float(tail) < 0.02 <= 1 - float(full.log_pmf(torch.arange(1, w))[0].exp().sum())
    _, p_full = sa.compile(program)(x, W, full, return_posterior=True)
    y_cut, p_cut = sa.compile(program)(x, W, cut, return_posterior=True)
    i, j = torch.arange(40)[:, None], torch.arange(40)[None, :]
    inside = (i - j >= 1) & (i - j <= w)
    want = torch.where(inside, p_full, 0.0)
    want = want / want.sum(-1, keepdim=True).clamp(min=1e-300)
    torch.testing.assert_close(p_cut, want, atol=1e-12, rtol=0)
    # the fused banded path equals the dense reading
    torch.testing.assert_close(sa.compile(program)(x, W, cut), y_cut, atol=1e-12, rtol=0)


# -- mean field: against a brute force of the same equations ---------------------------------
def _lbeta(x, y):
    return math.lgamma(x) + math.lgamma(y) - math.lgamma(x + y)


def brute_mean_field(s, a, b, *, tol=0.05, max_window=None, max_iters=50, converge_tol=1e-3,
                     expectation="digamma", update="conjugate", window_rule="predictive",
                     initial_window=None):
    """One head, one sequence, child by child (each has its own q_i, so each iterates alone
    until |ΔE[φ_i]| ≤ converge_tol·max(1, E[φ_i]) with its window no longer growing):
    scores ``s`` (N, N) → (posterior (N, N), final windows, iterations per child)."""
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
            else:
                new_win = max(win, min(quantile(new_alpha, new_beta), i))
            if m_prev is not None and abs(m - m_prev) <= converge_tol * max(1.0, abs(m)) \
                    and new_win == win:
                break
            alpha, beta, win, m_prev = new_alpha, new_beta, new_win, m
    return torch.tensor(P), windows, iterations


@pytest.mark.parametrize("expectation,update,rule", [
    ("digamma", "conjugate", "predictive"), ("plug_in", "conjugate", "predictive"),
    ("digamma", "accumulate", "predictive"), ("digamma", "conjugate", "edge"),
    ("digamma", "conjugate", "evidence"), ("plug_in", "accumulate", "evidence")])
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
    start = 2 if rule in ("edge", "evidence") else None
    prior = sa.priors.BetaGeometric(a, b, inference="mean_field", tol=0.1, block_size=block,
                                    expectation=expectation, update=update, window_rule=rule,
                                    initial_window=start)
    if path == "kernel":
        assert sa.kernels.available(), sa.kernels.build_error()
    with torch.no_grad() if path == "kernel" else sa.kernels.disabled():
        y, post, trace = sa.compile(program)(x, W, prior, heads, return_posterior=True,
                                             return_trace=True)
    s = scores_of(x, W, heads)
    for bi in range(2):
        for h in range(heads):
            want, win, its = brute_mean_field(s[bi, h], float(a[h]), float(b[h]), tol=0.1,
                                              expectation=expectation, update=update,
                                              window_rule=rule, initial_window=start)
            torch.testing.assert_close(post[bi, h], want, atol=1e-10, rtol=0)
            assert trace.windows[-1][bi, h].tolist() == win
            assert trace.child_iterations[bi, h].tolist() == its
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
        phi = sa.edges("attn", t, t, sa.priors.BetaGeometric(3.0, 1.0, inference="mean_field",
                                                              block_size=32))
        sa.potential(phi, sa.potentials.Bilinear(Wq, Wk, temperature=1.0))
        return sa.value(phi, sa.values.Identity())

    _, post, trace = sa.compile(prog)(x, return_posterior=True, return_trace=True)
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
        exact = sa.priors.BetaGeometric(1.0, 2.0)
        mf = sa.priors.BetaGeometric(1.0, 2.0, inference="mean_field", tol=1e-3)
        _, pe = sa.compile(program)(x, W * strength ** 0.5, exact, return_posterior=True)
        _, pm = sa.compile(program)(x, W * strength ** 0.5, mf, return_posterior=True)
        gaps.append(float(0.5 * (pe - pm).abs().sum(-1).mean()))
    assert all(g1 > g2 for g1, g2 in zip(gaps, gaps[1:], strict=False)), gaps
    assert gaps[-1] < 0.05 < gaps[0], gaps


@pytest.mark.parametrize("variant", ["exact", "mean_field"])
def test_gradcheck_including_a_and_b(variant):
    torch.manual_seed(4)
    m = sa.models.expanding_attention(4, heads=2, a=1.2, b=1.8, variant=variant,
                                      block_size=4, dtype=f64)
    layer = sa.compile(m)
    x = torch.randn(2, 9, 4, dtype=f64, requires_grad=True)
    names = [n for n, _ in layer.named_parameters()]
    assert "declaration.raw_prior" in names
    params = tuple(p.detach().clone().requires_grad_() for p in layer.parameters())

    def f(x, *ps):
        return torch.func.functional_call(layer, dict(zip(names, ps, strict=True)), (x,))

    assert torch.autograd.gradcheck(f, (x, *params))
    layer(x).sum().backward()
    assert m.raw_prior.grad is not None and bool((m.raw_prior.grad != 0).all())


def test_learned_prior_moves_towards_the_data():
    """Gradient descent on a and b: a sequence whose parent is always 1 step back makes the
    prior favour short distances (a/(a+b) = E[q] falls)."""
    torch.manual_seed(5)
    m = sa.models.expanding_attention(8, a=2.0, b=1.0, variant="mean_field", dtype=f64)
    layer = sa.compile(m)
    opt = torch.optim.Adam([m.raw_prior], lr=0.05)
    x = torch.randn(4, 30, 8, dtype=f64)
    target = torch.roll(x, 1, dims=1) @ m.W_v.T.detach() @ m.W_o.T.detach()
    def mean_q():
        with torch.no_grad():
            return float(m.a[0] / (m.a[0] + m.b[0]))

    q0 = mean_q()
    for _ in range(30):
        opt.zero_grad()
        ((layer(x) - target)[:, 1:] ** 2).mean().backward()
        opt.step()
    assert mean_q() < q0 - 0.1, (q0, mean_q())


# -- bad input ------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,match", [
    (dict(a=0.0), "a must be finite and > 0"), (dict(b=-1.0), "b must be finite and > 0"),
    (dict(a=torch.tensor([1.0, -0.5])), "a must be finite and > 0"),
    (dict(b=float("nan")), "b must be finite"),
    (dict(tol=0.0), r"tol .* must be in \(0, 1\)"), (dict(tol=1.0), r"must be in \(0, 1\)"),
    (dict(max_window=0), "max_window must be an int ≥ 1"),
    (dict(inference="variational"), "inference must be one of"),
    (dict(expectation="mode"), "expectation must be one of"),
    (dict(update="sum"), "update must be one of"),
    (dict(window_rule="tail"), "window_rule must be one of"),
    (dict(initial_window=0), "initial_window must be an int ≥ 1"),
    (dict(grad="implicit"), "grad must be one of"),
])
def test_bad_prior_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sa.priors.BetaGeometric(**kwargs)


def test_bad_model_arguments_and_mismatches():
    with pytest.raises(ValueError, match="a must be finite and > 0"):
        sa.models.expanding_attention(8, a=-1.0)
    with pytest.raises(ValueError, match=r"tol .* \(0, 1\)"):
        sa.models.expanding_attention(8, tol=2.0)
    with pytest.raises(ValueError, match="variant must be one of"):
        sa.models.expanding_attention(8, variant="approx")
    x, W = torch.randn(1, 5, 4), torch.randn(4, 4)
    with pytest.raises(ValueError, match=r"BetaGeometric a has 3 entries .* heads=2"):
        sa.compile(program)(x, W, sa.priors.BetaGeometric(torch.ones(3), 1.0), 2)
    with pytest.raises(ValueError, match=r"BetaGeometric b has 2 entries .* heads=3"):
        sa.compile(program)(torch.randn(1, 5, 6), torch.randn(6, 6),
                            sa.priors.BetaGeometric(torch.ones(3), torch.ones(2)), 3)
    with pytest.raises(ValueError, match=r"a must be a float or have one value per head \(2\)"):
        sa.models.expanding_attention(4, heads=2, a=torch.tensor([1.0, 2.0, 3.0]))
    m = sa.models.expanding_attention(4, heads=2, a=torch.tensor([1.0, 2.0]), b=3.0)
    torch.testing.assert_close(m.a.detach(), torch.tensor([1.0, 2.0]))

    def cross(x, y):
        phi = sa.edges("attn", sa.nodes("x", x), sa.nodes("y", y), sa.priors.BetaGeometric())
        sa.potential(phi, sa.potentials.DotProduct())
        return sa.value(phi, sa.values.Identity())

    with pytest.raises(ValueError, match=r"the last C of them\); got 5 children and 4"):
        sa.compile(cross)(x, torch.randn(1, 4, 4))
    # fewer children than parents: they must be the parents' last tokens
    with pytest.raises(ValueError, match=r"node set 'x' is not 'y'\[\.\.\., 1:, :\]"):
        sa.compile(cross)(x, torch.randn(1, 6, 4))
    sa.compile(cross)(x, torch.cat([torch.randn(1, 1, 4), x], 1))  # x is y's last 5: fine
    assert sa.compile(m)(x, last=torch.tensor(2)).shape == (1, 2, 4)
    for last in (0, 6, 2.0, True, torch.tensor([2])):
        with pytest.raises(ValueError, match=r"last \(how many final tokens.*\[1, n = 5\]"):
            sa.compile(m)(x, last=last)


def test_mean_field_needs_a_factorised_potential():
    class Table(sa.potentials.base.Potential):
        def pairwise(self, children, parents):
            return children.sum(-1)[..., None, :, None] * parents.sum(-1)[..., None, None, :]

    def prog(x):
        n = sa.nodes("x", x)
        phi = sa.edges("attn", n, n, sa.priors.BetaGeometric(inference="mean_field"))
        sa.potential(phi, Table())
        return sa.value(phi, sa.values.Identity())

    for kernel in (True, False):
        with contextlib.nullcontext() if kernel else sa.kernels.disabled():
            with pytest.raises(ValueError, match=r"edge family 'attn': a beta-geometric prior "
                                                 r"needs exactly one factorised potential"):
                sa.compile(prog)(torch.randn(1, 6, 4))


def test_mean_field_cannot_join_a_latent_iteration():
    def prog(x):
        z = sa.latent("z", x.clone(), scale=1.0, steps=2)
        phi = sa.edges("attn", z, z, sa.priors.BetaGeometric(inference="mean_field"))
        sa.potential(phi, sa.potentials.DotProduct())
        return sa.value(phi, sa.values.Identity())

    with pytest.raises(ValueError, match="cannot join the iteration of latent node sets"):
        sa.compile(prog)(torch.randn(1, 5, 3))


# -- an ordinary module ---------------------------------------------------------------------
def test_dtypes_state_dict_and_torch_compile(tmp_path):
    torch.manual_seed(6)
    m = sa.models.expanding_attention(8, heads=2, variant="mean_field")
    layer = sa.compile(m)
    x = torch.randn(2, 50, 8)
    y = layer(x)
    for dtype in (torch.float64, torch.bfloat16):
        m2 = sa.models.expanding_attention(8, heads=2, variant="mean_field").to(dtype)
        m2.load_state_dict({k: v.to(dtype) for k, v in m.state_dict().items()})
        y2 = sa.compile(m2)(x.to(dtype))
        assert y2.dtype == dtype and bool(torch.isfinite(y2).all())
        # a child settles when E[φ_i] moves by ≤ 1e-3 relative: float32 and float64 may settle
        # a step apart, so they agree to the iteration's tolerance, not to rounding
        torch.testing.assert_close(y2.float(), y, atol=0.1 if dtype == torch.bfloat16 else 2e-3,
                                   rtol=0.1 if dtype == torch.bfloat16 else 2e-3)
    torch.save(m.state_dict(), tmp_path / "m.pt")
    m3 = sa.models.expanding_attention(8, heads=2, variant="mean_field")
    m3.load_state_dict(torch.load(tmp_path / "m.pt", weights_only=True))
    torch.testing.assert_close(sa.compile(m3)(x), y)
    # the mean-field loop (data-dependent length and windows) runs eagerly inside the compiled
    # module; in float64 no window decision can flip between the two
    m64 = m.double()
    layer64, x64 = sa.compile(m64), x.double()
    with warnings.catch_warnings():  # dynamo, wrapping the prior's a, b (softplus outputs),
        # warns that a non-leaf's .grad is not populated: harmless
        warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not "
                                "a leaf", category=UserWarning)
        torch.testing.assert_close(torch.compile(layer64)(x64), layer64(x64), atol=1e-12, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention fast path needs CUDA")
def test_flex_attention_path_on_cuda_matches_the_banded_cpu_path():
    torch.manual_seed(7)
    m = sa.models.expanding_attention(64, heads=4, variant="exact", tol=0.01)
    x = torch.randn(2, 300, 64)
    y_cpu = sa.compile(m)(x)
    y_gpu = sa.compile(m.cuda())(x.cuda())
    torch.testing.assert_close(y_gpu.cpu(), y_cpu, atol=2e-3, rtol=2e-3)


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
        prior = sa.priors.BetaGeometric(8.0, 1.0, inference="mean_field", window_rule="edge",
                                        initial_window=2, tol=0.05)
        phi = sa.edges("attn", t, t, prior)
        sa.potential(phi, sa.potentials.Bilinear(Wq, Wk, temperature=1.0))
        return sa.value(phi, sa.values.Identity())

    _, post, trace = sa.compile(prog)(x, return_posterior=True, return_trace=True)
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
        prior = sa.priors.BetaGeometric(30.0, 2.0, inference="mean_field", window_rule=rule,
                                        initial_window=4, tol=0.05)
        phi = sa.edges("attn", t, t, prior)
        sa.potential(phi, sa.potentials.Bilinear(Wq, Wk, temperature=1.0))
        return sa.value(phi, sa.values.Identity())

    i = torch.arange(61, n)
    _, post, trace = sa.compile(prog)(x, "evidence", return_posterior=True, return_trace=True)
    w = trace.windows[-1, 0, 0][i]
    found = w >= back[i]
    assert float(found.double().mean()) > 0.95, float(found.double().mean())
    assert bool((w[found] <= torch.maximum(2 * back[i][found], torch.tensor(4))).all())
    assert float(post[0, 0, i[found], target[i[found]]].min()) > 0.9
    _, wide = sa.compile(prog)(x, "predictive", return_trace=True)
    assert float(w.double().mean()) < 0.5 * float(wide.windows[-1, 0, 0][i].double().mean())


def test_grad_last_trains_a_and_b_and_agrees_with_the_forward():
    """grad="last": a and b get gradients; and a child stopped by max_iters keeps the Beta and
    window of its final posterior, so the differentiable step reproduces the forward (also
    when nothing converged)."""
    torch.manual_seed(9)
    x, W = torch.randn(2, 30, 4, dtype=f64), torch.randn(4, 4, dtype=f64) * 2
    for max_iters in (1, 2, 50):
        kw = dict(inference="mean_field", max_iters=max_iters, initial_window=2)
        last = sa.priors.BetaGeometric(2.0, 0.7, grad="last", **kw)
        unroll = sa.priors.BetaGeometric(2.0, 0.7, grad="unroll", **kw)
        _, p_last = sa.compile(program)(x, W, last, return_posterior=True)
        _, p_unroll = sa.compile(program)(x, W, unroll, return_posterior=True)
        with torch.no_grad():
            _, p_free = sa.compile(program)(x, W, last, return_posterior=True)
        torch.testing.assert_close(p_last, p_unroll, atol=1e-12, rtol=0)
        torch.testing.assert_close(p_free, p_unroll, atol=1e-12, rtol=0)
    m = sa.models.expanding_attention(4, heads=2, variant="mean_field", grad="last", dtype=f64)
    sa.compile(m)(torch.randn(2, 12, 4, dtype=f64)).sum().backward()
    assert m.raw_prior.grad is not None and bool(torch.isfinite(m.raw_prior.grad).all())
    assert bool((m.raw_prior.grad != 0).all())


def test_mean_field_drawing_shows_the_inferred_posterior():
    """The mean-field prior is the whole beta-geometric (its tol shapes inference, not the
    model): the drawing keeps every edge the posterior reaches and marks its argmax."""
    torch.manual_seed(10)
    m = sa.models.expanding_attention(8, heads=2, a=2.0, b=2.0)
    x = torch.randn(1, 60, 8) * 3
    _, post = sa.compile(m)(x, return_posterior=True)
    G = sa.to_networkx(m, x, top_k=2)
    for u, v, d in G.edges(data=True):
        if d["map"]:
            i, j = G.nodes[v]["index"], G.nodes[u]["index"]
            assert int(post[0, d["head"], i].argmax()) == j
    reached = int((post[0] > 0).sum())
    assert sa.to_networkx(m, x).number_of_edges() >= reached


def test_trace_of_a_sequence_without_past():
    m = sa.models.expanding_attention(4, variant="mean_field")
    _, trace = sa.compile(m)(torch.randn(2, 1, 4), return_trace=True)
    assert trace.iterations == 0 and trace.mean_window == 0.0
    assert trace.relative_operations(4) == 0.0
