"""The fixed-capacity cache (``layer.new_cache(capacity=L)``): its steps replay one recorded
plan (no recording after warm-up), ``torch.compile`` traces a step once, the storage keeps
its shape and is written in place, and a call beyond the capacity is refused in one line.
(Its outputs against the full forward: tests/test_decode_cache.py, parametrised by the
cache's kind.)"""

import pytest
import torch

import structattn as sa
from tests.registry import CASES
from tests.test_decode_cache import DECODED, _causal

#: read eagerly, row by row, whatever the cache (its windows are re-inferred from each row's
#: past): expanding attention's mean field
EAGER = [k for k in DECODED if CASES[k].model == "expanding_attention"
         and _causal(CASES[k])[0].inference is not None]
PLANNED = [k for k in DECODED if k not in EAGER]


def _steps(layer, x, capacity, prefill=3):
    """A prefill of ``prefill`` tokens and one-token steps over ``x (B, N, d)``, without
    gradients; the outputs ``(B, N, d_out)`` and the cache."""
    cache = layer.new_cache(capacity=capacity)
    with torch.no_grad():
        ys = [layer(x[:, :prefill], cache=cache)]
        ys += [layer(x[:, t:t + 1], cache=cache) for t in range(prefill, x.shape[1])]
    return torch.cat(ys, 1), cache


@pytest.mark.parametrize("case", PLANNED)
def test_a_step_after_warm_up_records_no_plan(case):
    """Two steps record the step's plan; eight more replay it — no new recording, the same
    plan serving each — and the outputs are the full forward's."""
    model, _ = _causal(CASES[case])
    layer = sa.compile(model)
    N = 3 + 2 + 8
    capacity = 16 if getattr(model, "positions", None) is None else min(16, model.max_len)
    x = torch.randn(2, min(N, capacity), model.d_model, dtype=torch.float64)
    cache = layer.new_cache(capacity=capacity)
    with torch.no_grad():
        ys = [layer(x[:, :3], cache=cache)] + [layer(x[:, t:t + 1], cache=cache)
                                                for t in (3, 4)]
        warm = {key: plan.calls for key, plan in cache.plans.items()}
        step = [key for key in warm if warm[key]]  # the step's signature: replayed once
        assert len(step) == 1 and cache.plans[step[0]].graph is not None, \
            {k: p.reason for k, p in cache.plans.items()}
        ys += [layer(x[:, t:t + 1], cache=cache) for t in range(5, x.shape[1])]
    after = {key: plan.calls for key, plan in cache.plans.items()}
    assert after.keys() == warm.keys()  # nothing recorded
    assert after[step[0]] - warm[step[0]] == x.shape[1] - 5  # the one plan served every step
    assert cache.keys.shape[-2] == capacity and len(cache) == x.shape[1]
    torch.testing.assert_close(torch.cat(ys, 1), layer(x), rtol=0, atol=1e-10)


@pytest.mark.parametrize("case", EAGER)
def test_a_model_read_eagerly_still_decodes_with_a_fixed_capacity(case):
    """Expanding attention's mean field re-infers each new token's window from its row's
    past, a reading whose shapes follow the lengths: no plan is recorded, and the outputs
    are the full forward's."""
    model, _ = _causal(CASES[case])
    layer = sa.compile(model)
    x = torch.randn(2, 7, model.d_model, dtype=torch.float64)
    y, cache = _steps(layer, x, capacity=9)
    assert cache.plans == {} and cache.keys.shape[-2] == 9
    torch.testing.assert_close(y, layer(x), rtol=0, atol=1e-10)


def test_the_storage_keeps_its_shape_and_is_written_in_place():
    layer = sa.compile(sa.models.forgetting_attention(6, heads=2, dtype=torch.float64))
    x = torch.randn(2, 8, 6, dtype=torch.float64)
    cache = layer.new_cache(capacity=10)
    assert repr(cache) == "DecodeCache(capacity=10, empty)" and cache.capacity == 10
    with torch.no_grad():
        layer(x[:, :3], cache=cache)
        shapes = [t.shape for t in (cache.keys, cache.values, cache.state)]
        where = [t.data_ptr() for t in (cache.keys, cache.values, cache.state)]
        for t in range(3, 8):
            layer(x[:, t:t + 1], cache=cache)
    assert [t.shape for t in (cache.keys, cache.values, cache.state)] == shapes
    assert [t.data_ptr() for t in (cache.keys, cache.values, cache.state)] == where
    assert shapes == [(2, 2, 10, 3), (2, 2, 10, 3), (2, 2, 10)]
    assert "DecodeCache(capacity=10, batch=(2,), tokens=8" in repr(cache)


def test_beyond_the_capacity_a_call_is_refused_in_one_line():
    layer = sa.compile(sa.models.alibi_attention(6, heads=2, dtype=torch.float64))
    x = torch.randn(2, 6, 6, dtype=torch.float64)
    cache = layer.new_cache(capacity=4)
    layer(x[:, :3], cache=cache)
    with pytest.raises(ValueError, match=r"^ALiBiAttention: the cache would hold 5 tokens in a "
                                         r"row, beyond its capacity=4 \(layer.new_cache\("
                                         r"capacity=…\)\)$"):
        layer(x[:, 3:5], cache=cache)
    assert len(cache) == 3  # the refused call wrote nothing
    # padding may reach beyond the capacity: only the real tokens take slots
    y = layer(x[:, 3:5], cache=cache, lengths=torch.tensor([1, 0]))
    assert cache.lengths.tolist() == [4, 3]
    torch.testing.assert_close(y[0, 0], layer(x[:1, :4])[0, 3], rtol=0, atol=1e-10)
    with pytest.raises(ValueError, match=r"hold 5 tokens in a row, beyond its capacity=4"):
        layer(x[:, 4:5], cache=cache)


@pytest.mark.parametrize("capacity", [0, -3, 2.5, True, "8"])
def test_a_bad_capacity_is_refused_naming_it(capacity):
    layer = sa.compile(sa.models.alibi_attention(6, heads=2, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"capacity \(the tokens a fixed-capacity cache holds "
                                         r"per row\) must be an int ≥ 1 or None; got "):
        layer.new_cache(capacity=capacity)


def test_a_capacity_beyond_the_positions_is_refused():
    model = sa.models.absolute_position_attention(6, max_len=8, causal=True,
                                                 dtype=torch.float64)
    with pytest.raises(ValueError, match=r"capacity=9 exceeds max_len=8"):
        sa.compile(model).new_cache(capacity=9)


def test_gradients_flow_through_a_step_of_a_fixed_capacity():
    """With gradients the storage is copied, not written in place (an earlier call's graph
    holds it), and keeps its shape; the step's gradient is the full forward's last token's."""
    model = sa.models.forgetting_attention(6, heads=2, dtype=torch.float64)
    layer = sa.compile(model)
    x = torch.randn(1, 5, 6, dtype=torch.float64, requires_grad=True)
    cache = layer.new_cache(capacity=7)
    layer(x[:, :3], cache=cache)
    layer(x[:, 3:4], cache=cache)
    g_step = torch.autograd.grad(layer(x[:, 4:], cache=cache).sum(), (x, model.W_f))
    g_full = torch.autograd.grad(layer(x)[:, -1].sum(), (x, model.W_f))
    assert cache.keys.shape == (1, 2, 7, 3)
    for a, b in zip(g_step, g_full, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def test_a_non_finite_step_is_refused_and_leaves_the_cache_as_it_was():
    layer = sa.compile(sa.models.self_attention(6, heads=2, causal=True, dtype=torch.float64))
    x = torch.randn(1, 8, 6, dtype=torch.float64)
    cache = layer.new_cache(capacity=8)
    with torch.no_grad():
        for t in range(4):  # the step's plan recorded and replayed
            layer(x[:, t:t + 1], cache=cache)
        with pytest.raises(ValueError, match="x_new contains non-finite values"):
            layer(torch.full_like(x[:, :1], float("nan")), cache=cache)
        assert len(cache) == 4
        ys = [layer(x[:, t:t + 1], cache=cache) for t in range(4, 8)]
    torch.testing.assert_close(torch.cat(ys, 1), layer(x)[:, 4:], rtol=0, atol=1e-10)


@pytest.mark.parametrize("name", ["self_attention", "forgetting_attention"])
def test_torch_compile_traces_a_step_once(name):
    """A function doing a step, compiled whole (``fullgraph``), is not compiled again on
    later steps (``error_on_recompile``) and gives the eager step's outputs; a compiled
    step beyond the capacity fails in the step."""
    import torch._dynamo

    kwargs = {"causal": True} if name == "self_attention" else {}
    model = getattr(sa.models, name)(8, heads=2, dtype=torch.float64, **kwargs)
    layer = sa.compile(model)
    x = torch.randn(2, 7, 8, dtype=torch.float64)
    cache = layer.new_cache(capacity=7)
    compiled = torch.compile(lambda x_new: layer(x_new, cache=cache), fullgraph=True)
    torch._dynamo.reset()
    with torch.no_grad():
        ys = [layer(x[:, :3], cache=cache), compiled(x[:, 3:4])]
        with torch._dynamo.config.patch(error_on_recompile=True):
            ys += [compiled(x[:, t:t + 1]) for t in range(4, 7)]
            with pytest.raises(RuntimeError, match=r"more tokens in a row than its "
                                                   r"capacity=7"):
                compiled(x[:, :1])
    assert len(cache) == 7
    eager, _ = _steps(layer, x, capacity=7)
    torch.testing.assert_close(torch.cat(ys, 1), eager, rtol=0, atol=1e-10)
    torch.testing.assert_close(eager, layer(x), rtol=0, atol=1e-10)


def test_after_warm_up_a_bad_step_is_still_refused_naming_the_argument():
    """A step the last plan would serve skips ``read``'s checks: one that plan would not
    serve — another batch shape, width, dtype, a hook — is read and checked as before."""
    layer = sa.compile(sa.models.forgetting_attention(6, heads=2, dtype=torch.float64))
    x = torch.randn(2, 8, 6, dtype=torch.float64)
    cache = layer.new_cache(capacity=8)
    with torch.no_grad():
        for t in range(4):
            layer(x[:, t:t + 1], cache=cache)
        with pytest.raises(ValueError, match=r"batch shape must be the cache's, \(2,\); got "
                                             r"\(3,\)"):
            layer(torch.randn(3, 1, 6, dtype=torch.float64), cache=cache)
        with pytest.raises(ValueError, match=r"d_model=6\); got \(2, 1, 5\)"):
            layer(torch.randn(2, 1, 5, dtype=torch.float64), cache=cache)
        with pytest.raises(ValueError, match=r"x_new must have the parameters' dtype"):
            layer(x[:, 4:5].float(), cache=cache)
        with pytest.raises(ValueError, match="cache holds another layer's tokens"):
            sa.compile(sa.models.forgetting_attention(6, heads=2, dtype=torch.float64))(
                x[:, 4:5], cache=cache)
        assert len(cache) == 4
        seen = []
        handle = layer.register_forward_hook(lambda *args: seen.append(1))
        layer(x[:, 4:5], cache=cache)
        handle.remove()
        ys = [layer(x[:, t:t + 1], cache=cache) for t in range(5, 8)]
    assert seen == [1] and len(cache) == 8
    torch.testing.assert_close(torch.cat(ys, 1), layer(x)[:, 5:], rtol=0, atol=1e-10)


def test_a_layer_that_decoded_still_copies_and_pickles():
    """The step plans are kept beside the layer: a copy or a pickle of it starts without
    them and decodes on its own."""
    import copy
    import pickle

    layer = sa.compile(sa.models.alibi_attention(6, heads=2, dtype=torch.float64))
    x = torch.randn(1, 5, 6, dtype=torch.float64)
    y, _ = _steps(layer, x, capacity=6)
    for other in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        z, cache = _steps(other, x, capacity=6)
        torch.testing.assert_close(z, y, rtol=0, atol=0)
        assert sum(plan.calls for plan in cache.plans.values()) == 1  # its own plan
