"""Certified truncation of the distance priors over j ≤ i — ALiBi, FoX's forget gate, the
generalised Gaussian (``tol=ε``): the posterior mass left outside the window read never
exceeds the reported bound, the window is read exactly, and Pyro's whole-past reading is
within that bound.

The oracle is a dense float64 softmax written here: each prior's log weights from its
formula (numpy: −m·d, Σ log f over the tokens between, −|(d − μ)e^s|^β), the scores as a
plain matmul, the mass beyond the window summed over every past parent. Nothing of the
band, of ``certify`` or of the priors' tables is reused."""

import math

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import given, settings

import structattn as sa
from structattn.certificates.certified import certify, skipped_pairs

f64 = torch.float64


# -- the priors' log weights, written from their formulas (numpy) ----------------------------
def alibi_weights(slopes, n):
    d = np.arange(n)[:, None] - np.arange(n)[None, :]
    return torch.tensor(-np.asarray(slopes)[:, None, None] * d)  # (H, N, N)


def gate_weights(log_f, n):
    """log Π_{l=j+1..i} f_l, per child i the suffix sums of its own gates: (…, N, N)."""
    lf = np.asarray(log_f)
    out = np.zeros(lf.shape[:-1] + (n, n))
    for i in range(1, n):
        out[..., i, :i] = np.cumsum(lf[..., i:0:-1], -1)[..., ::-1]  # j < i: Σ_{l=j+1..i}
    return torch.tensor(out)


def gaussian_weights(loc, log_scale, shape, n):
    d = (np.arange(n)[:, None] - np.arange(n)[None, :]).astype(float)
    mu, s, b = (np.asarray(v, dtype=float)[:, None, None] for v in (loc, log_scale, shape))
    return torch.tensor(-np.abs((d - mu) * np.exp(s)) ** b)


def dense_posterior(a, b, scale, log_weights):
    """p(φ_i = j) over j ≤ i, ``(*batch, H, N, N)``, float64."""
    n = a.shape[-2]
    logits = scale * a.to(f64) @ b.to(f64).transpose(-1, -2) + log_weights
    past = torch.ones(n, n, dtype=torch.bool).tril()
    return torch.softmax(logits.masked_fill(~past, float("-inf")), -1)


def beyond(p, width):
    n = p.shape[-1]
    d = torch.arange(n)[:, None] - torch.arange(n)[None, :]
    return (p * (d > width)).sum(-1)


def _prior(kind, heads, g, sharp_prior):
    """A random prior of ``kind`` and its log weights from the formula."""
    if kind == "alibi":
        slopes = torch.rand(heads, generator=g, dtype=f64) * sharp_prior
        return (sa.priors.ALiBi(heads, slopes=slopes, causal=True),
                lambda n: alibi_weights(slopes.numpy(), n))
    if kind == "fox":
        def make(n):
            return torch.nn.functional.logsigmoid(
                torch.randn(2, heads, n, generator=g, dtype=f64) * 2 + 4 / max(sharp_prior, .1))
        return "gate", make
    loc = torch.rand(heads, generator=g, dtype=f64) * 6
    log_scale = torch.rand(heads, generator=g, dtype=f64) * 3 - 3 + math.log(sharp_prior + 1e-3)
    shape = torch.rand(heads, generator=g, dtype=f64) * 2.5 + 0.3
    return (sa.priors.GeneralisedGaussian(loc, log_scale, shape),
            lambda n: gaussian_weights(loc.numpy(), log_scale.numpy(), shape.numpy(), n))


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(["alibi", "fox", "gaussian"]), n=st.integers(2, 90),
       heads=st.integers(1, 3), k=st.integers(1, 6), sharp=st.floats(0.1, 3.0),
       sharp_prior=st.floats(0.01, 2.0),
       scale=st.floats(-2.0, 2.0).filter(lambda s: abs(s) > 1e-3), eps_exp=st.integers(1, 6),
       block=st.integers(1, 40), start=st.integers(1, 20), seed=st.integers(0, 2**31 - 1),
       planted=st.booleans())
def test_the_true_posterior_mass_beyond_the_window_never_exceeds_the_bound(
        kind, n, heads, k, sharp, sharp_prior, scale, eps_exp, block, start, seed, planted):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(2, heads, n, k, generator=g, dtype=f64) * sharp
    b = torch.randn(2, heads, n, k, generator=g, dtype=f64)
    if planted and n > 4:  # a strong match far back for the last token
        b[..., 1, :] = a[..., -1, :] * 3 * np.sign(scale)
    prior, weights = _prior(kind, heads, g, sharp_prior)
    if prior == "gate":
        log_f = weights(n)
        prior = sa.priors.ForgettingGate(log_f, tol=0.5)
        log_w = gate_weights(log_f.numpy(), n)
    else:
        log_w = weights(n)
    eps = 10.0 ** -eps_exp
    c = certify(a, b, scale, prior, eps, start=start, block=block, first=0)
    assert c.certified and 1 <= c.width <= n - 1
    assert bool((c.bound <= eps).all())
    true = beyond(dense_posterior(a, b, scale, log_w), c.width)
    assert bool((true <= c.bound * (1 + 1e-9) + 1e-300).all()), float((true - c.bound).max())
    assert int(c.window.max()) == c.width and bool((c.window >= 1).all())
    assert c.skipped == pytest.approx(skipped_pairs(n, c.width))


# -- through the models ---------------------------------------------------------------------
def _pair(factory, tol, **kwargs):
    """The same layer twice, without and with ``tol`` (same weights), float64."""
    torch.manual_seed(7)
    full = getattr(sa.models, factory)(16, heads=2, dtype=f64, **kwargs)
    if factory == "alibi_attention":  # two heads' default slopes, 1/16 and 1/256, need ~N
        full.slopes.copy_(torch.tensor([1.0, 0.4], dtype=f64))
    cut = getattr(sa.models, factory)(16, heads=2, tol=tol, block_size=16, dtype=f64, **kwargs)
    cut.load_state_dict(full.state_dict())
    return full, cut


#: each model with a prior whose weight falls fast enough for a window to pay
FALLING = {
    "alibi_attention": {},  # slopes set by _pair
    "forgetting_attention": dict(gate_bias=0.0),  # f ≈ 1/2
    "generalised_gaussian_attention": dict(width=4.0, shape=1.5),
}


def _tokens(n=512, batch=2):
    torch.manual_seed(3)
    return torch.randn(batch, n, 16, dtype=f64)


def _log_weights(factory, layer, x):
    """The layer's prior log weights from the formulas above, ``(…, H, N, N)``."""
    n = x.shape[-2]
    if factory == "alibi_attention":
        return alibi_weights(layer.slopes.numpy(), n)
    if factory == "forgetting_attention":
        return gate_weights(layer.log_gates(x).detach().numpy(), n)
    return gaussian_weights(layer.loc.detach().numpy(), layer.log_scale.detach().numpy(),
                            layer.log_shape.detach().exp().numpy(), n)


def _heads(layer, x, W):
    return (x @ W.T).unflatten(-1, (layer.heads, -1)).transpose(-2, -3)


@pytest.mark.parametrize("factory", sorted(FALLING))
@pytest.mark.parametrize("tol", [0.05, 1e-4])
@torch.no_grad()
def test_the_window_is_read_exactly_and_within_its_bound_of_the_whole_past(factory, tol):
    """The output is the posterior over the window read, renormalised (dense, written here),
    to 1e-10; its total variation from the whole past's is at most the reported bound."""
    full, cut = _pair(factory, tol, **FALLING[factory])
    x = _tokens()
    n = x.shape[-2]
    y, p, trace = sa.compile(cut)(x, return_posterior=True, return_trace=True)
    c = trace.truncation[cut.family_name]
    assert c.certified and c.width < n - 1 and c.skipped > 0
    q, k, v = (_heads(cut, x, W) for W in (cut.W_q, cut.W_k, cut.W_v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    log_w = _log_weights(factory, cut, x)
    whole = dense_posterior(scores, torch.eye(scores.shape[-1], dtype=f64).expand_as(scores),
                            1.0, log_w)
    d = torch.arange(n)[:, None] - torch.arange(n)[None, :]
    # a prior g_i + h_j (ALiBi, a gate) reads a width per head (the compiled band kernel);
    # the generalised Gaussian one width for all
    separable = factory != "generalised_gaussian_attention"
    assert (c.heads is not None) == separable
    reads = c.heads[..., None, None] if separable else c.width
    windowed = whole * (d <= reads)
    windowed = windowed / windowed.sum(-1, keepdim=True)
    torch.testing.assert_close(p, windowed, atol=1e-10, rtol=0)
    want = (windowed @ v).transpose(-3, -2).flatten(-2) @ cut.W_o.T
    torch.testing.assert_close(y, want, atol=1e-10, rtol=0)
    tv = (p - whole).abs().sum(-1) / 2
    assert bool((tv <= c.bound + 1e-12).all()) and bool((c.bound <= tol).all())
    # the whole-past layer (no tol) reads the same model: within the bound, output too
    y_full, p_full = sa.compile(full)(x, return_posterior=True)
    torch.testing.assert_close(p_full, whole, atol=1e-10, rtol=0)
    v_max = float(v.norm(dim=-1).max()) * float(torch.linalg.matrix_norm(cut.W_o, 2))
    assert float((y - y_full).norm(dim=-1).max()) <= 2 * tol * v_max


@pytest.mark.parametrize("factory", sorted(FALLING))
@torch.no_grad()
def test_pyro_reads_the_whole_past_and_the_window_is_within_the_bound(factory):
    """Pyro's enumeration of the same declaration (all of j ≤ i) against the certified
    window: every child's posterior within its bound in total variation."""
    _, cut = _pair(factory, 1e-2, **FALLING[factory])
    x = _tokens(n=200, batch=1)
    _, p, trace = sa.compile(cut)(x, return_posterior=True, return_trace=True)
    c = trace.truncation[cut.family_name]
    assert c.width < 199
    truth = sa.inference.exact(cut, x).marginals[cut.family_name]
    tv = (p - truth).abs().sum(-1) / 2
    assert bool((tv <= c.bound + 1e-10).all())


@pytest.mark.parametrize("factory", sorted(FALLING))
def test_gradients_through_a_certified_window(factory):
    """Including the prior's own parameters (the gate's W_f, b_f; μ, s, β)."""
    torch.manual_seed(1)
    kwargs = FALLING[factory]
    m = getattr(sa.models, factory)(6, heads=2, d_k=3, tol=0.05, block_size=4, dtype=f64,
                                    **kwargs)
    if factory == "alibi_attention":
        m.slopes.copy_(torch.tensor([2.0, 1.0], dtype=f64))
    x = torch.randn(1, 40, 6, dtype=f64)
    layer = sa.compile(m)
    _, trace = layer(x, return_trace=True)
    assert trace.truncation[m.family_name].width < 39
    params = [p for p in m.parameters() if p.requires_grad]

    def f(xx, *ps):
        return layer(xx)
    torch.autograd.gradcheck(f, (x.requires_grad_(), *params))


@torch.no_grad()
def test_a_constant_gate_is_alibi_under_truncation_too():
    """FoX with f constant per head == ALiBi with m = −log f: the same window, and the
    gate's bound (its exact per-child tail) within ALiBi's (summed to the longest distance);
    equal where a child's past reaches the sequence's start's distance."""
    torch.manual_seed(4)
    n, heads, k = 200, 2, 5
    a, b = torch.randn(1, heads, n, k, dtype=f64), torch.randn(1, heads, n, k, dtype=f64)
    m = torch.tensor([0.3, 0.15], dtype=f64)
    gate = sa.priors.ForgettingGate((-m)[:, None].expand(heads, n).clone(), tol=1e-3)
    alibi = sa.priors.ALiBi(heads, slopes=m, causal=True, tol=1e-3)
    c_gate = certify(a, b, 0.5, gate, 1e-3, first=0)
    c_alibi = certify(a, b, 0.5, alibi, 1e-3, first=0)
    assert c_gate.width == c_alibi.width < n - 1
    assert bool((c_gate.bound <= c_alibi.bound * (1 + 1e-9) + 1e-300).all())
    torch.testing.assert_close(c_gate.bound[..., -1], c_alibi.bound[..., -1], rtol=1e-9,
                               atol=0)


@torch.no_grad()
def test_where_the_certificate_needs_the_whole_past_the_layer_is_the_untruncated_one():
    """Gates wide open (f ≈ 1): no window certifies; the dense operator reads all of j ≤ i
    (through the key-bias path), exactly as without tol."""
    full, cut = _pair("forgetting_attention", 1e-6, gate_bias=12.0)
    x = _tokens(n=64)
    y, trace = sa.compile(cut)(x, return_trace=True)
    c = trace.truncation[cut.family_name]
    assert c.width == 63 and c.skipped == 0.0
    torch.testing.assert_close(y, sa.compile(full)(x), atol=1e-12, rtol=0)


@torch.no_grad()
def test_the_window_is_chosen_again_for_every_call():
    """The window depends on the gates and the scores: a replayed call must not keep the
    first call's."""
    _, cut = _pair("forgetting_attention", 1e-3, gate_bias=0.0)
    layer = sa.compile(cut)
    torch.manual_seed(0)
    calm = torch.randn(1, 100, 16, dtype=f64) * 0.1
    wild = torch.randn(1, 100, 16, dtype=f64) * 3
    widths = set()
    for x in (calm, calm, calm, wild, wild, calm, wild):
        want, trace = layer.interpret(x, return_trace=True)
        widths.add(trace.truncation[cut.family_name].width)
        torch.testing.assert_close(layer(x), want, atol=0, rtol=0)
    assert len(widths) > 1


@pytest.mark.parametrize("factory", sorted(FALLING))
def test_bad_truncation_options_are_refused(factory):
    make = getattr(sa.models, factory)
    for tol in (0, 1, 1.5, -0.1, True, "0.1"):
        with pytest.raises(ValueError, match=r"tol .* must be None or in \(0, 1\); got"):
            make(8, tol=tol)
    for block in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match=r"block_size must be a positive int; got"):
            make(8, tol=0.1, block_size=block)
    if factory != "forgetting_attention":  # causal only: FoX always is
        with pytest.raises(ValueError, match="needs the causal support j ≤ i; got causal=False"):
            make(8, tol=0.1, causal=False)


def test_bad_truncation_options_are_refused_by_the_priors():
    with pytest.raises(ValueError, match=r"ALiBi prior: tol .* got 0"):
        sa.priors.ALiBi(2, causal=True, tol=0)
    with pytest.raises(ValueError, match="ALiBi prior: tol .* needs the causal support"):
        sa.priors.ALiBi(2, tol=0.1)
    with pytest.raises(ValueError, match=r"ForgettingGate prior: block_size must be .* got 0"):
        sa.priors.ForgettingGate(torch.zeros(4), tol=0.1, block_size=0)
    with pytest.raises(ValueError, match="GeneralisedGaussian prior: tol .* needs the causal"):
        sa.priors.GeneralisedGaussian(0.0, 0.0, 1.0, causal=False, tol=0.1)
    with pytest.raises(ValueError, match="first .* must be 0 or 1; got 2"):
        certify(torch.randn(1, 1, 5, 2), torch.randn(1, 1, 5, 2), 1.0,
                sa.priors.ALiBi(1, causal=True), 0.1, first=2)


def test_a_generalised_gaussian_window_never_builds_the_dense_table(monkeypatch):
    """Declaring the family checks the (heads, N) distance table, not the N×N one; an empty
    support at distance 0 is still refused by name."""
    calls = []
    cls = sa.priors.GeneralisedGaussian
    table = cls.log_table

    def counting(self, *args):
        calls.append(args)
        return table(self, *args)

    monkeypatch.setattr(cls, "log_table", counting)
    m = sa.models.generalised_gaussian_attention(8, heads=2, width=2.0, tol=1e-3, dtype=f64)
    with torch.no_grad():
        _, trace = sa.compile(m)(torch.randn(1, 600, 8, dtype=f64), return_trace=True)
    assert trace.truncation[m.family_name].width < 599 and not calls
    without = sa.models.generalised_gaussian_attention(8, heads=2, width=2.0, dtype=f64)
    with torch.no_grad(), sa.kernels.disabled():
        sa.compile(without)(torch.randn(1, 20, 8, dtype=f64))
    assert calls  # the counter counts: without tol or kernels the dense bias is the lowering
    # float32: |μ·e^s|² overflows at distance 0, so child 0 would have no parent
    loud = sa.models.generalised_gaussian_attention(8, heads=1, shape=2.0, tol=1e-3)
    with torch.no_grad():
        loud.loc.fill_(1e30)
    with pytest.raises(ValueError, match="log weight at distance 0 is −inf"):
        sa.compile(loud)(torch.randn(1, 20, 8))


@torch.no_grad()
def test_where_no_narrower_window_could_certify_nothing_is_scored():
    """ALiBi's slowest paper slope (1/256): its prior alone leaves more than ε beyond every
    band worth reading, whatever the scores — all of the past, bound 0, no band scored."""
    torch.manual_seed(0)
    n = 1024
    a, b = torch.randn(1, 1, n, 8, dtype=f64), torch.randn(1, 1, n, 8, dtype=f64)

    def counted(slope):
        prior = sa.priors.ALiBi(1, slopes=torch.tensor([slope], dtype=f64), causal=True)
        widths, band_weights = [], prior.log_weights_on_band
        prior.log_weights_on_band = lambda lay, w, *args, **kw: (
            widths.append(w) or band_weights(lay, w, *args, **kw))
        return prior, widths

    slow, scored = counted(1 / 256)
    c = certify(a, b, 0.1, slow, 1e-4, first=0, widest=256)
    assert c.width == n - 1 and c.skipped == 0.0 and c.certified and not scored
    assert bool((c.bound == 0).all())
    # a steep slope certifies a narrow band, from two widths scored at most
    steep, scored = counted(0.5)
    c = certify(a, b, 0.1, steep, 1e-4, first=0, widest=256)
    assert c.width <= 64 and 1 <= len(set(scored)) <= 2
    true = beyond(dense_posterior(a, b, 0.1, alibi_weights([0.5], n)), c.width)
    assert bool((true <= c.bound * (1 + 1e-9) + 1e-300).all())


@torch.no_grad()
def test_a_band_wider_than_half_the_sequence_is_not_read():
    """It would read more pairs than the causal kernel: the layer reads all of the past (the
    key-bias path), reports width N − 1 and nothing skipped, and equals the layer without tol."""
    full, cut = _pair("alibi_attention", 1e-4)
    with torch.no_grad():
        for m in (full, cut):
            m.slopes.copy_(torch.tensor([0.05, 0.04], dtype=f64))  # certifies ~N/2 at best
    x = _tokens(n=200)
    y, trace = sa.compile(cut)(x, return_trace=True)
    c = trace.truncation[cut.family_name]
    assert c.width == 199 and c.skipped == 0.0 and bool((c.bound == 0).all())
    assert int(c.window.max()) > 16  # what a band would have needed
    torch.testing.assert_close(y, sa.compile(full)(x), atol=1e-12, rtol=0)


@pytest.mark.parametrize("kind", ["alibi", "fox", "gaussian"])
def test_scoring_the_band_in_runs_of_blocks_changes_nothing(kind, monkeypatch):
    from structattn.certificates import certified

    g = torch.Generator().manual_seed(5)
    n, heads = 300, 2
    a = torch.randn(2, heads, n, 4, generator=g, dtype=f64)
    b = torch.randn(2, heads, n, 4, generator=g, dtype=f64)
    prior, weights = _prior(kind, heads, g, 2.0)
    if prior == "gate":
        prior = sa.priors.ForgettingGate(weights(n), tol=0.5)
    whole = certify(a, b, 0.3, prior, 1e-2, first=0, block=8)
    monkeypatch.setattr(certified, "RUN_ENTRIES", 2 * heads * 8 * 40)  # a few blocks a run
    runs = certify(a, b, 0.3, prior, 1e-2, first=0, block=8)
    assert runs.width == whole.width < n - 1
    torch.testing.assert_close(runs.bound, whole.bound, rtol=1e-12, atol=0)
    assert torch.equal(runs.window, whole.window)


@pytest.mark.parametrize("tol", [None, 1e-3])
@torch.no_grad()
def test_a_forget_gate_in_bfloat16_sums_its_gates_in_float32(tol):
    """512 gates near ½ sum to ~−350, where bfloat16's spacing is 2: summed in bfloat16, the
    prior was off by up to e² (the output by 1.2 of 3.6); in float32, bfloat16's own rounding
    is what remains."""
    torch.manual_seed(0)
    ref = sa.models.forgetting_attention(16, heads=2, gate_bias=0.0, tol=tol, block_size=16,
                                         dtype=f64)
    low = sa.models.forgetting_attention(16, heads=2, gate_bias=0.0, tol=tol, block_size=16,
                                         dtype=torch.bfloat16)
    low.load_state_dict(ref.state_dict())
    x = torch.randn(1, 512, 16, dtype=f64)
    y = sa.compile(ref)(x)
    y_low = sa.compile(low)(x.bfloat16())
    assert float((y_low.double() - y).abs().max()) < 0.05 * float(y.abs().max())
    assert low.log_gates(x.bfloat16()).dtype == torch.bfloat16  # the gates stay the model's
    gate = sa.priors.ForgettingGate(low.log_gates(x.bfloat16()))
    assert gate.cumulative().dtype == torch.float32


@torch.no_grad()
def test_a_long_key_nearby_does_not_weigh_on_the_tail():
    """The ceiling beyond a window takes the longest key farther back (a running max), not the
    longest of all: a strong match planted 20 back — a key 10× the others' length — no longer
    makes every child's certificate assume a farther parent could score as high."""
    torch.manual_seed(2)
    n, k = 400, 8
    a, b = torch.randn(1, 1, n, k, dtype=f64), torch.randn(1, 1, n, k, dtype=f64)
    b[..., n - 21, :] = a[..., -1, :] / a[..., -1, :].norm() * 10 * math.sqrt(k)
    prior = sa.priors.ALiBi(1, slopes=torch.tensor([0.3], dtype=f64), causal=True)
    c = certify(a, b, 0.5, prior, 1e-4, first=0)
    assert c.width <= 64 and int(c.window[0, 0, -1]) <= 64
    p = dense_posterior(a, b, 0.5, alibi_weights([0.3], n))
    assert float(p[0, 0, -1, n - 21]) > 0.99  # the match is read, inside the window
    true = beyond(p, c.width)
    assert bool((true <= c.bound * (1 + 1e-9) + 1e-300).all())
    # the same long key far back (beyond every window) is charged to every later child's tail
    b[..., n - 21, :] = b[..., 0, :]
    b[..., 0, :] = a[..., -1, :] / a[..., -1, :].norm() * 10 * math.sqrt(k)
    far = certify(a, b, 0.5, prior, 1e-4, first=0)
    assert far.width > c.width
    true = beyond(dense_posterior(a, b, 0.5, alibi_weights([0.3], n)), far.width)
    assert bool((true <= far.bound * (1 + 1e-9) + 1e-300).all())
