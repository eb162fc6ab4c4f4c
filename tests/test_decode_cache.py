"""Decoding with a cache (``structattn.decoding``): for every causal catalogue model, prefill
and steps of random sizes over ragged batches equal the full forward on every position, the
posteriors too (float64, 1e-10), and the last token's posterior equals Pyro's enumeration.

The models come from the catalogue (tests/registry.py): every case whose model is causal,
and every token-attention case with a ``causal`` option, made causal. A new causal model is
covered here as soon as it joins the catalogue; one without an incremental reading fails.
"""

import contextlib
import random

import pytest
import torch

import structattn as sa
from structattn.models._projections import TokenAttention
from tests.registry import CASES


def _causal(case):
    """The case's model made causal where it has the option (None: not a causal model)."""
    model, (x, *_) = case()
    if getattr(model, "causal", None) is False and isinstance(model, TokenAttention):
        model.causal = True
    return (model, x) if getattr(model, "causal", False) else None


CAUSAL = sorted(k for k, c in CASES.items() if _causal(c) is not None)
NOT_CAUSAL = sorted(k for k, c in CASES.items() if _causal(c) is None)
#: causal models without an incremental reading yet, refused with a NotImplementedError:
#: graph attention (its adjacency is an input of every call, which a cached call would have
#: to extend)
NOT_YET = sorted(k for k in CAUSAL if CASES[k].model == "graph_attention")
DECODED = [k for k in CAUSAL if k not in NOT_YET]


def test_the_catalogue_has_causal_models_to_decode():
    names = {CASES[k].model for k in DECODED}
    assert {"self_attention", "rope_attention", "alibi_attention", "forgetting_attention",
            "relative_position_attention", "generalised_gaussian_attention",
            "stick_breaking_attention", "expanding_attention",
            "absolute_position_attention", "multihop_attention"} <= names
    assert {"cross_attention", "hopfield"} <= {CASES[k].model for k in NOT_CAUSAL}


def _full(layer, x):
    """The full forward of one row ``(1, n, d)``: outputs ``(n, d_out)`` and the posterior
    ``(H, n, n)``."""
    y, post = layer(x, return_posterior=True)
    return y[0], post[0]


def _decode(layer, x, total, rng, max_step, capacity=None):
    """Read rows of ``x (B, N, d)`` holding ``total[b]`` tokens in random blocks: a prefill
    then steps, each row taking a random share (0 allowed) of each call's k tokens, into a
    cache that grows (``capacity`` None) or has that fixed capacity. Returns per row the
    outputs ``(total_b, d_out)``, the posterior rows ``(H, total_b, total_b)`` and the
    cache."""
    B, N, _ = x.shape
    cache = layer.new_cache(capacity=capacity)
    assert len(cache) == 0
    done = [0] * B
    ys = [[] for _ in range(B)]
    posts = [[] for _ in range(B)]
    while any(done[b] < total[b] for b in range(B)):
        k = rng.randint(1, max_step)
        counts = [min(rng.randint(0, k), total[b] - done[b]) for b in range(B)]
        if not any(counts):
            continue
        x_new = torch.randn(B, k, x.shape[-1], dtype=x.dtype)  # padding: any values
        for b in range(B):
            x_new[b, :counts[b]] = x[b, done[b]:done[b] + counts[b]]
        y, post = layer(x_new, cache=cache, lengths=torch.tensor(counts),
                        return_posterior=True)
        assert len(cache) == max(d + c for d, c in zip(done, counts, strict=True))
        assert post.shape[-1] == (len(cache) if capacity is None else capacity)
        for b in range(B):
            c = counts[b]
            assert torch.equal(y[b, c:], torch.zeros_like(y[b, c:]))  # padding reads nothing
            assert not post[b, :, c:].any()
            ys[b].append(y[b, :c])
            posts[b].append(post[b, :, :c, :done[b] + c])
            assert not post[b, :, :, done[b] + c:].any()  # nothing beyond the row's tokens
            done[b] += c
    assert cache.lengths.tolist() == list(total)
    out = []
    for b in range(B):
        p = torch.zeros(posts[b][0].shape[0], total[b], total[b], dtype=x.dtype)
        row = 0
        for block in posts[b]:
            p[:, row:row + block.shape[-2], :block.shape[-1]] = block
            row += block.shape[-2]
        out.append((torch.cat(ys[b], 0), p))
    return out, cache


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("kind", ["growing", "fixed"])
@pytest.mark.parametrize("case", DECODED)
def test_prefill_and_steps_equal_the_full_forward(case, kind, seed):
    rng = random.Random(f"{case}-{seed}")
    torch.manual_seed(seed)
    model, x0 = _causal(CASES[case])
    layer = sa.compile(model)
    B = rng.randint(1, 3)
    longest = 9 if getattr(model, "positions", None) is None else min(9, model.max_len)
    total = [rng.randint(1, longest) for _ in range(B)]
    x = torch.randn(B, max(total), x0.shape[-1], dtype=torch.float64)
    # a fixed capacity: from exactly the longest row's tokens to a few slots more
    capacity = None if kind == "growing" else rng.randint(max(total), longest + 3)
    if capacity is not None and getattr(model, "positions", None) is not None:
        capacity = min(capacity, model.max_len)
    # odd seeds without gradients: the cache is then written in place
    with torch.no_grad() if seed % 2 else contextlib.nullcontext():
        got, cache = _decode(layer, x, total, rng, max_step=rng.choice([1, 2, 4]),
                             capacity=capacity)
    assert len(cache) == max(total)
    if capacity is not None:
        assert cache.keys.shape[-2] == capacity
    for b in range(B):
        y, post = _full(layer, x[b:b + 1, :total[b]])
        torch.testing.assert_close(got[b][0], y, rtol=0, atol=1e-10)
        torch.testing.assert_close(got[b][1], post, rtol=0, atol=1e-10)


@pytest.mark.parametrize("case", [k for k in DECODED if CASES[k].exact])
def test_last_token_posterior_is_pyros(case):
    """The last token's posterior after a prefill and steps, against exact enumeration (the
    cases read exactly: expanding attention's mean field is checked against its own full
    forward above, and its exact variant here)."""
    model, _ = _causal(CASES[case])
    layer = sa.compile(model)
    x = torch.randn(1, 5, model.d_model, dtype=torch.float64)
    cache = layer.new_cache()
    layer(x[:, :2], cache=cache)
    layer(x[:, 2:4], cache=cache)
    y, post = layer(x[:, 4:], cache=cache, return_posterior=True)
    exact = sa.inference.exact(model, x)
    marginal = exact.marginals[model.family_name]  # (1, H, 5, 5): the layer's edges
    torch.testing.assert_close(post[0, :, -1], marginal[0, :, -1], rtol=0, atol=1e-6)
    torch.testing.assert_close(y[0, -1], exact.output[0, -1], rtol=0, atol=1e-6)


@pytest.mark.parametrize("case", NOT_YET)
def test_readings_without_an_incremental_one_refuse(case):
    layer = sa.compile(_causal(CASES[case])[0])
    with pytest.raises(NotImplementedError, match="not read incrementally|no incremental "
                                                  "reading for this model"):
        layer.new_cache()


@pytest.mark.parametrize("case", NOT_CAUSAL)
def test_a_model_that_is_not_causal_refuses_the_cache(case):
    model, inputs = CASES[case]()
    layer = sa.compile(model)
    with pytest.raises(ValueError, match=r"cache= \(incremental decoding\) needs a causal model"):
        layer.new_cache()
    with pytest.raises(ValueError, match=r"cache= .* is not causal$"):
        layer(*inputs, cache=object())


def _layer():
    return sa.compile(sa.models.forgetting_attention(6, heads=2, dtype=torch.float64))


def test_bad_inputs_are_refused_naming_the_argument():
    layer = _layer()
    cache = layer.new_cache()
    x = torch.randn(2, 3, 6, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"x_new must be a floating-point tensor \(\*batch, "
                                         r"k ≥ 1, d_model=6\); got \(2, 3, 5\)"):
        layer(torch.randn(2, 3, 5, dtype=torch.float64), cache=cache)
    with pytest.raises(ValueError, match=r"x_new must have the parameters' dtype"):
        layer(x.float(), cache=cache)
    with pytest.raises(ValueError, match="cache must be a DecodeCache"):
        layer(x, cache=None)
    with pytest.raises(ValueError, match="cache holds another layer's tokens"):
        layer(x, cache=_layer().new_cache())
    with pytest.raises(ValueError, match=r"lengths \(the real new tokens of each row\) must be"):
        layer(x, cache=cache, lengths=torch.tensor([1, 4]))
    with pytest.raises(ValueError, match=r"lengths .* batch shape \(2,\)"):
        layer(x, cache=cache, lengths=torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match=r"takes x_new, lengths= and return_posterior=; "
                                         r"got 1 positional inputs and \['return_trace'\]"):
        layer(x, cache=cache, return_trace=True)
    with pytest.raises(ValueError, match="x_new must be finite"):
        layer(x.masked_fill(x > 1, float("nan")), cache=cache)
    assert len(cache) == 0  # nothing refused was appended
    layer(x, cache=cache)
    with pytest.raises(ValueError, match=r"x_new's batch shape must be the cache's, \(2,\); "
                                         r"got \(3,\)"):
        layer(torch.randn(3, 1, 6, dtype=torch.float64), cache=cache)
    layer.float()  # the parameters move on; the cache holds float64 keys
    with pytest.raises(ValueError, match=r"x_new must have the cache's dtype and device "
                                         r"\(torch.float64, cpu\); got \(torch.float32, cpu\)"):
        layer(x.float(), cache=cache)


def test_a_certified_window_is_refused():
    layer = sa.compile(sa.models.alibi_attention(6, tol=0.01, dtype=torch.float64))
    with pytest.raises(NotImplementedError, match=r"certified window \(tol=0.01\)"):
        layer.new_cache()


def test_the_cache_extends_batches_of_any_shape_and_the_plans_are_untouched():
    """(*batch) = (2, 3) rows, steps of one token; the full forward's plan still replays."""
    model = sa.models.rope_attention(8, heads=2, rope_base=100.0, dtype=torch.float64)
    layer = sa.compile(model)
    x = torch.randn(2, 3, 6, 8, dtype=torch.float64)
    full = layer(x)
    cache = layer.new_cache()
    steps = [layer(x[..., :3, :], cache=cache)]
    steps += [layer(x[..., t:t + 1, :], cache=cache) for t in range(3, 6)]
    torch.testing.assert_close(torch.cat(steps, -2), full, rtol=0, atol=1e-10)
    assert len(cache) == 6 and cache.lengths.shape == (2, 3)
    assert "DecodeCache(batch=(2, 3), tokens=6" in repr(cache)
    torch.testing.assert_close(layer(x), full, rtol=0, atol=0)


def test_gradients_flow_through_a_cached_step():
    """A step's output is differentiable in the parameters and the cached tokens' inputs:
    its gradient equals the full forward's last token's."""
    model = sa.models.forgetting_attention(6, heads=2, dtype=torch.float64)
    layer = sa.compile(model)
    x = torch.randn(1, 5, 6, dtype=torch.float64, requires_grad=True)
    cache = layer.new_cache()
    layer(x[:, :4], cache=cache)
    g_step = torch.autograd.grad(layer(x[:, 4:], cache=cache).sum(), (x, model.W_f))
    g_full = torch.autograd.grad(layer(x)[:, -1].sum(), (x, model.W_f))
    for a, b in zip(g_step, g_full, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["growing", "fixed"])
@pytest.mark.parametrize("case", DECODED)
def test_lower_precision_follows_the_full_forward(case, kind, dtype):
    """In float32 and bfloat16 a prefill and a step agree with the full forward to the
    dtype's rounding, in the dtype of the parameters."""
    model, _ = _causal(CASES[case])
    model = model.to(dtype)
    layer = sa.compile(model)
    x = torch.randn(2, 5, model.d_model, dtype=dtype)
    cache = layer.new_cache(capacity=None if kind == "growing" else 5)
    with torch.no_grad():
        y = torch.cat([layer(x[:, :3], cache=cache), layer(x[:, 3:4], cache=cache),
                       layer(x[:, 4:], cache=cache)], 1)
    assert y.dtype == dtype and cache.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(y, layer(x), rtol=tol, atol=tol)


def test_without_gradients_the_cache_grows_by_doubling_and_is_written_in_place():
    layer = _layer()
    x = torch.randn(2, 6, 6, dtype=torch.float64)
    cache = layer.new_cache()
    with torch.no_grad():
        layer(x[:, :3], cache=cache)
        layer(x[:, 3:4], cache=cache)  # 4 tokens: the storage doubles to 6
        keys, state = cache.keys.data_ptr(), cache.state.data_ptr()
        assert cache.keys.shape[-2] == 6
        layer(x[:, 4:5], cache=cache)
        layer(x[:, 5:], cache=cache)
    assert (cache.keys.data_ptr(), cache.state.data_ptr()) == (keys, state)
    assert cache.keys.shape == (2, 2, 6, 3) and len(cache) == 6


def test_an_unbatched_sequence_is_one_row():
    layer = sa.compile(sa.models.alibi_attention(6, heads=2, dtype=torch.float64))
    x = torch.randn(5, 6, dtype=torch.float64)
    cache = layer.new_cache()
    y = torch.cat([layer(x[:3], cache=cache), layer(x[3:], cache=cache, lengths=2)])
    torch.testing.assert_close(y, layer(x), rtol=0, atol=1e-10)
    assert len(cache) == 5 and cache.lengths.shape == ()
