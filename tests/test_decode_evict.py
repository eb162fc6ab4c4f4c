"""Certified eviction (``layer.new_cache(tol=…)``, ``structattn.decoding.evict``): at every
step, the true posterior mass of the evicted tokens — read from the full forward's posterior
in float64, which shares no code with the bound — never exceeds the bound the trace reports
for that step, under attack (priors, gate values, query sharpness up to the ceilings, far
keys planted to match the later queries, lengths up to 4,096); a token beyond a ceiling stops
eviction and says so; unsupported models and bad arguments are refused in one line.
"""

import math
import warnings

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings, target
from hypothesis import strategies as st

import structattn as sa
from structattn.decoding.evict import EvictionWarning

pytestmark = pytest.mark.usefixtures("_no_grad")

f64 = torch.float64
#: (checked steps, steps whose bound was positive): shows the attack evicted something
SEEN = {"steps": 0, "evicting": 0, "violations": 0}


def _model(kind, heads, params, temperature, dtype=f64):
    """An ALiBi, FoX or generalised Gaussian layer, d_model 8, d_k 4, with the drawn prior."""
    kw = dict(heads=heads, d_k=4, temperature=temperature, dtype=dtype)
    if kind == "alibi":
        m = sa.models.alibi_attention(8, **kw)
        m.slopes.copy_(torch.tensor(params[:heads], dtype=dtype))
    elif kind == "fox":
        m = sa.models.forgetting_attention(8, gate_bias=params[0], **kw)
        with torch.no_grad():
            m.W_f.mul_(params[1])
    else:
        m = sa.models.generalised_gaussian_attention(8, **kw)
        with torch.no_grad():
            m.loc.fill_(-params[0])
            m.log_scale.fill_(params[1])
            m.log_shape.fill_(math.log(params[2]))
    return sa.compile(m)


def _inputs(layer, n, rows, x_norm, plant, g):
    """``(rows, n, 8)`` tokens of norm ≤ x_norm, most at it (the sharpest queries the ceiling
    allows); with ``plant``, the later half repeats one token u and a few early tokens are the
    unit x that maximises ⟨W_q u, W_k x⟩ summed over the heads: far keys that match."""
    x = torch.randn(rows, n, 8, generator=g, dtype=f64)
    x = x / x.norm(dim=-1, keepdim=True) * x_norm
    x[:, ::3] *= torch.rand(rows, len(range(0, n, 3)), 1, generator=g, dtype=f64)
    if plant:
        m = layer.declaration
        Wq, Wk = m.W_q.detach().to(f64), m.W_k.detach().to(f64)
        u = x[:, n // 2:n // 2 + 1].clone()
        x[:, n // 2:] = u
        v = u @ Wq.T @ Wk  # (rows, 1, 8): the direction of the best-matching key
        v = v / v.norm(dim=-1, keepdim=True) * x_norm
        for j in range(0, min(n // 2, 12), 3):
            x[:, j:j + 1] = v
    return x.to(layer.declaration.W_q.dtype)


def _decode_and_check(layer, x, lengths, steps, tol, ceilings, block):
    """Read rows of ``x`` holding ``lengths[b]`` tokens in calls of ``steps`` tokens with an
    evicting cache; check every call's queries against the full forward's posterior. Returns
    the cache and the largest ratio of a true evicted mass to its bound."""
    rows, n, _ = x.shape
    worst = 0.0
    with torch.no_grad():
        _, post = layer(x, return_posterior=True)  # (B, H, n, n)
    post = post.to(f64)
    cache = layer.new_cache(tol=tol, block=block, **ceilings)
    done = [0] * rows
    call = 0
    while any(done[b] < lengths[b] for b in range(rows)):
        k = steps[call % len(steps)]
        call += 1
        counts = [min(k, lengths[b] - done[b]) for b in range(rows)]
        if not any(counts):
            continue
        x_new = torch.zeros(rows, k, x.shape[-1], dtype=x.dtype)
        for b in range(rows):
            x_new[b, :counts[b]] = x[b, done[b]:done[b] + counts[b]]
        evicted = cache.evicted  # before the call: what this call's queries lose
        with torch.no_grad():
            layer(x_new, cache=cache, lengths=torch.tensor(counts))
        step = cache.trace[-1]
        assert step.bound <= tol and step.certified
        assert step.evicted == cache.evicted and step.held == len(cache)
        assert (step.bounds is None) == (evicted == 0)
        for b in range(rows):
            for i in range(done[b], done[b] + counts[b]):
                true = post[b, :, i, :evicted].sum(-1)  # (H,): each head's evicted mass
                bound = step.bounds[b] if evicted else torch.zeros_like(true)
                SEEN["steps"] += 1
                SEEN["evicting"] += step.bound > 0
                if not bool((true <= bound * (1 + 1e-9)).all()):
                    SEEN["violations"] += 1
                    raise AssertionError(f"row {b}, query {i}: evicted mass per head "
                                         f"{true.tolist()} > bound {bound.tolist()}")
                assert float(bound.max()) <= step.bound
                if step.bound > 0:
                    worst = max(worst, float((true / bound.clamp(min=1e-300)).max()))
            done[b] += counts[b]
    assert all(cache.lengths.reshape(-1)[b] + cache.evicted == lengths[b] for b in range(rows))
    return cache, worst


def _ceilings(layer, x, route, margin):
    """``input_norm`` = the longest token, or the longest query's and key's norms per head."""
    if route == "input":
        return {"input_norm": float(x.to(f64).norm(dim=-1).max()) * (1 + margin)}
    m = layer.declaration
    H = m.heads

    def longest(W):
        return (x.to(f64) @ W.detach().to(f64).T).unflatten(-1, (H, -1)).norm(dim=-1) \
            .amax(dim=(0, 1))
    return {"query_norm": longest(m.W_q) * (1 + margin) + 1e-9,
            "key_norm": longest(m.W_k) * (1 + margin) + 1e-9}


PRIORS = st.one_of(
    st.tuples(st.just("alibi"), st.lists(st.floats(0.02, 2.0), min_size=3, max_size=3)),
    st.tuples(st.just("fox"), st.tuples(st.floats(-2.0, 4.0), st.floats(0.0, 3.0))),
    st.tuples(st.just("gg"), st.tuples(st.floats(0.0, 5.0), st.floats(-3.0, 0.5),
                                       st.floats(0.5, 2.5))))


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(prior=PRIORS, heads=st.integers(1, 3), temperature=st.floats(0.1, 4.0),
       x_norm=st.floats(0.5, 4.0), plant=st.booleans(), n=st.integers(8, 160),
       rows=st.integers(1, 2), steps=st.lists(st.integers(1, 4), min_size=1, max_size=3),
       tol=st.floats(1e-6, 0.3), block=st.sampled_from([1, 4, 16]),
       route=st.sampled_from(["input", "norms"]), margin=st.floats(0.0, 0.5),
       seed=st.integers(0, 2**16))
def test_evicted_mass_never_exceeds_the_bound(prior, heads, temperature, x_norm, plant, n,
                                              rows, steps, tol, block, route, margin, seed):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    kind, params = prior
    layer = _model(kind, heads, params, temperature)
    x = _inputs(layer, n, rows, x_norm, plant, g)
    lengths = [n] + [int(torch.randint(1, n + 1, (), generator=g))] * (rows - 1)
    cache, worst = _decode_and_check(layer, x, lengths, steps, tol,
                                     _ceilings(layer, x, route, margin), block)
    event("evicted" if cache.evicted else "nothing evicted")
    target(worst, label="true evicted mass / bound")  # the attack: push the ratio up
    assert SEEN["violations"] == 0


@pytest.mark.parametrize("kind,params", [("alibi", [0.3, 0.1]), ("fox", (1.0, 1.0)),
                                         ("gg", (1.0, -1.5, 1.5))])
def test_eviction_keeps_the_cache_bounded_at_4096(kind, params):
    """Token by token to 4,096: the evicting cache stays far below the sequence, and every
    step's queries stay within their bound (the full forward's posterior, float64)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    layer = _model(kind, 2, params, None)
    n = 4096 if kind != "gg" else 1024
    x = _inputs(layer, n, 1, 1.0, False, g)
    cache, _ = _decode_and_check(layer, x, [n], [1], 1e-4, {"input_norm": 1.0}, 64)
    assert cache.evicted > 0 and len(cache) < n // 2
    assert max(s.held for s in cache.trace) < n // 2
    assert any(s.bound > 0 for s in cache.trace)


def test_outputs_stay_within_the_bound_of_the_full_cache():
    """What eviction changes in an output is at most 2·bound·max‖v‖ (the dropped mass moved
    to the kept tokens), float64 against the full cache."""
    torch.manual_seed(3)
    layer = _model("alibi", 2, [0.4, 0.2], 1.0)
    x = _inputs(layer, 300, 1, 2.0, False, torch.Generator().manual_seed(0))
    ev, full = layer.new_cache(tol=1e-3, input_norm=2.0, block=8), layer.new_cache()
    W_v, W_o = layer.declaration.W_v.detach(), layer.declaration.W_o
    for t in range(300):
        y1, y2 = layer(x[:, t:t + 1], cache=ev), layer(x[:, t:t + 1], cache=full)
        bound = ev.trace[-1].bound
        v = torch.linalg.matrix_norm(W_v, ord=2) * 2.0  # ‖v‖ ≤ ‖W_V‖·‖x‖
        o = torch.linalg.matrix_norm(W_o.detach(), ord=2) if W_o is not None else 1.0
        assert float((y1 - y2).norm()) <= 2 * bound * float(v * o) * math.sqrt(2) + 1e-12
    assert ev.evicted > 0
    # the posterior over the tokens held: the full one's over them, renormalised
    x_new = torch.nn.functional.normalize(torch.randn(1, 1, 8, dtype=f64), dim=-1)
    _, p_ev = layer(x_new, cache=ev, return_posterior=True)
    _, p_full = layer(x_new, cache=full, return_posterior=True)
    kept = p_full[..., ev.evicted:]
    assert p_ev.shape[-1] == len(ev) == 301 - ev.evicted
    torch.testing.assert_close(p_ev, kept / kept.sum(-1, keepdim=True), rtol=1e-10, atol=1e-12)


def test_a_token_beyond_the_ceilings_stops_eviction_and_says_so():
    torch.manual_seed(0)
    layer = _model("alibi", 2, [0.5, 0.5], None)
    x = _inputs(layer, 400, 1, 1.0, False, torch.Generator().manual_seed(0))
    W0 = layer.declaration.W_q.detach()[:4]  # head 0's query projection
    top = torch.linalg.svd(W0).Vh[0]  # the unit x with the longest query of head 0
    x[0, 300] = 2 * top  # ‖x‖ = 2 > input_norm: head 0's query is twice its ceiling
    cache = layer.new_cache(tol=1e-4, input_norm=1.0, block=16)
    for t in range(300):
        layer(x[:, t:t + 1], cache=cache)
    evicted = cache.evicted
    assert evicted > 0 and all(s.certified for s in cache.trace)
    with pytest.warns(EvictionWarning, match=r"position 300.*ceiling.*eviction stops"):
        layer(x[:, 300:301], cache=cache)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        for t in range(301, 400):
            layer(x[:, t:t + 1], cache=cache)
    assert cache.evicted == evicted  # no eviction after the breach
    assert not any(s.certified for s in cache.trace[300:])
    assert len(cache) == 400 - evicted


def test_a_cache_without_tol_is_unchanged():
    layer = _model("fox", 2, (1.0, 1.0), None)
    cache = layer.new_cache()
    layer(torch.randn(1, 5, 8, dtype=f64), cache=cache)
    assert cache.trace is None and cache.evicted == 0 and len(cache) == 5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lower_precisions_evict_within_the_bound(dtype):
    """float32 and bfloat16 layers: the rounding is charged, so the bound holds against the
    full cache's own posterior in that precision."""
    torch.manual_seed(0)
    layer = _model("alibi", 2, [0.5, 0.3], None, dtype=dtype)
    x = torch.randn(1, 300, 8)
    x = (x / x.norm(dim=-1, keepdim=True)).to(dtype)
    ev, full = layer.new_cache(tol=1e-3, input_norm=1.0, block=16), layer.new_cache()
    for t in range(300):
        evicted = ev.evicted
        layer(x[:, t:t + 1], cache=ev)
        _, p = layer(x[:, t:t + 1], cache=full, return_posterior=True)
        assert float(p[0, :, 0, :evicted].to(f64).sum(-1).max()) <= ev.trace[-1].bound + 1e-30
    assert ev.evicted > 0


# -- refusals ------------------------------------------------------------------------------

def test_models_without_a_falling_prior_refuse_tol():
    layer = sa.compile(sa.models.self_attention(8, causal=True, dtype=f64))
    with pytest.raises(ValueError, match=r"new_cache\(tol=…\).*SelfAttention's prior"):
        layer.new_cache(tol=1e-3, input_norm=1.0)
    gg = _model("gg", 2, (1.0, 0.0, 1.0), None)
    with torch.no_grad():
        gg.declaration.loc.fill_(2.0)
    with pytest.raises(ValueError, match=r"loc ≤ 0.*got loc \[2.0"):
        gg.new_cache(tol=1e-3, input_norm=1.0)
    alibi = _model("alibi", 2, [0.5, -0.1], None)
    with pytest.raises(ValueError, match=r"slopes ≥ 0"):
        alibi.new_cache(tol=1e-3, input_norm=1.0)


def test_a_model_that_is_not_causal_refuses_a_cache():
    layer = sa.compile(sa.models.alibi_attention(8, causal=False, dtype=f64))
    with pytest.raises(ValueError, match=r"cache=.*needs a causal model"):
        layer.new_cache(tol=1e-3, input_norm=1.0)


@pytest.mark.parametrize("tol", [0, 0.0, -0.1, 1, 1.0, 1.5, float("nan"), float("inf"), True,
                                 "0.1"])
def test_bad_tol_is_refused(tol):
    layer = _model("alibi", 2, [0.5, 0.5], None)
    with pytest.raises(ValueError, match=r"tol .*must be a number in \(0, 1\); got"):
        layer.new_cache(tol=tol, input_norm=1.0)


@pytest.mark.parametrize("kwargs,match", [
    ({}, r"needs ceilings.*query_norm= and key_norm=, or input_norm="),
    ({"query_norm": 1.0}, r"needs ceilings"),
    ({"input_norm": 1.0, "query_norm": 1.0}, r"input_norm or query_norm and key_norm"),
    ({"input_norm": -1.0}, r"input_norm must be a positive finite number.*got"),
    ({"input_norm": float("nan")}, r"input_norm must be a positive finite"),
    ({"query_norm": torch.ones(3), "key_norm": 1.0}, r"query_norm .*tensor of 2.*got \(3,\)"),
    ({"input_norm": 1.0, "block": 0}, r"block .*positive int; got 0"),
])
def test_bad_ceilings_are_refused(kwargs, match):
    layer = _model("alibi", 2, [0.5, 0.5], None)
    with pytest.raises(ValueError, match=match):
        layer.new_cache(tol=1e-3, **kwargs)


def test_ceilings_without_tol_are_refused():
    layer = _model("alibi", 2, [0.5, 0.5], None)
    with pytest.raises(ValueError, match=r"\['input_norm'\] are certified eviction's; they "
                                         r"need tol="):
        layer.new_cache(input_norm=1.0)


@pytest.fixture
def _no_grad():
    """Decoding reads without gradients (the cache is then written in place)."""
    with torch.no_grad():
        yield


def test_eviction_with_gradients_on():
    """Decoding with autograd on: eviction reads no gradient and the outputs back-propagate."""
    torch.manual_seed(0)
    layer = _model("fox", 2, (0.0, 1.0), None)
    x = _inputs(layer, 200, 1, 1.0, False, torch.Generator().manual_seed(0))
    cache = layer.new_cache(tol=1e-3, input_norm=1.0, block=16)
    with torch.enable_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        for t in range(200):
            y = layer(x[:, t:t + 1], cache=cache)
        y.sum().backward()
    assert cache.evicted > 0 and layer.declaration.W_q.grad is not None


def test_tol_with_a_fixed_capacity_is_refused():
    layer = _model("alibi", 2, [0.5, 0.5], None)
    with pytest.raises(ValueError, match=r"capacity= or tol=.*not both; got capacity=64"):
        layer.new_cache(64, tol=1e-3, input_norm=1.0)
