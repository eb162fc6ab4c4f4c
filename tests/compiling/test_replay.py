"""Compile once per input signature (structattn/compiling/replay.py): the replayed graph is the reading.

The first call with a signature reads the declaration, the second records a plan, later calls
replay it. Every catalogue model must replay bit for bit what a reading computes — outputs,
posteriors, traces, gradients, random draws — and re-read when the signature changes.
"""

import pytest
import torch
from torch.utils import _pytree as pytree

import structattn as sa

from ..registry import CASES

#: what cannot be a plan, and why: its reading branches on tensor values
NOT_REPLAYED = {
    "expanding_attention": "windows/loop.py",  # mean-field windows: data-dependent sizes
}


def _leaves_equal(a, b) -> bool:
    la, lb = pytree.tree_leaves(a), pytree.tree_leaves(b)
    return len(la) == len(lb) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(la, lb, strict=True))


def _options(layer, inputs):
    """The option sets the case supports: plain, with the posterior, with the trace."""
    out = [{}, {"return_posterior": True}]
    try:
        layer.interpret(*inputs, return_trace=True)
        out.append({"return_trace": True})
    except ValueError:  # no iteration to trace
        pass
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_replay_equals_the_reading_bit_for_bit(case):
    model, inputs = CASES[case]()
    layer = sa.compile(model)
    for opts in _options(layer, inputs):
        results = []
        for _ in range(3):  # read, record, replay
            torch.manual_seed(1)  # a model drawing at random (slot init) draws the same
            results.append(layer(*inputs, **opts))
        torch.manual_seed(1)
        read = layer.interpret(*inputs, **opts)
        for got in results:
            assert _leaves_equal(got, read), (case, opts)
    plans = list(layer.plans.values())
    assert len(plans) == len(_options(layer, inputs))
    if CASES[case].model in NOT_REPLAYED and case == CASES[case].model:
        where = NOT_REPLAYED[case]
        assert all(p.graph is None and where in p.reason for p in plans), plans
    else:
        assert all(p.graph is not None for p in plans), [p.reason for p in plans]
        assert all(p.calls >= 2 for p in plans)  # the recording call and the third


@pytest.mark.parametrize("case", ["self_attention", "hopfield", "slot_attention",
                                  "predictive_coding", "block_slot_attention", "graph_attention"])
def test_replay_gradients_equal_the_reading(case):
    model, inputs = CASES[case]()
    layer = sa.compile(model)
    params = [p for p in layer.parameters() if p.requires_grad]
    grads = []
    for _ in range(3):
        torch.manual_seed(1)
        out = layer(*inputs)
        grads.append(torch.autograd.grad(pytree.tree_leaves(out)[0].sum(), params,
                                         allow_unused=True))
    assert next(iter(layer.plans.values())).graph is not None
    for g in grads[1:]:
        assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(g, grads[0], strict=True))


def test_a_new_signature_is_read_then_recorded():
    m = sa.models.self_attention(8, d_k=4, heads=2, causal=True, dtype=torch.float64)
    layer = sa.compile(m)
    x5, x6 = torch.randn(2, 5, 8, dtype=torch.float64), torch.randn(2, 6, 8, dtype=torch.float64)
    layer(x5)
    assert layer.plans == {}  # a shape seen once costs nothing more than a reading
    layer(x5)
    assert len(layer.plans) == 1
    layer(x6)
    layer(x6)
    assert len(layer.plans) == 2
    torch.testing.assert_close(layer(x6), layer.interpret(x6), rtol=0, atol=0)
    with torch.no_grad():  # grad mode is part of the signature
        layer(x6)
        layer(x6)
    with sa.validation(False):  # so is the validation mode
        layer(x6)
        layer(x6)
    assert len(layer.plans) == 4


def test_autocast_and_its_dtype_are_part_of_the_signature():
    """A reading may branch on autocast (``kinds.key_bias.folds_terms``: h is not folded into
    factors that autocast sends to half precision): a plan recorded without CPU autocast
    (which ``torch.is_autocast_enabled()`` does not see) is not replayed under it, nor one
    recorded under bfloat16 under float16."""
    torch.manual_seed(0)
    m = sa.models.self_attention(8, d_k=4, heads=2, causal=True)
    layer, x = sa.compile(m), torch.randn(2, 5, 8)
    for _ in range(3):
        assert layer(x).dtype == torch.float32
    for dtype in (torch.bfloat16, torch.float16):
        with torch.autocast("cpu", dtype):
            ys = [layer(x) for _ in range(3)]
            want = layer.interpret(x)
        for y in ys:
            assert y.dtype == dtype
            torch.testing.assert_close(y, want, rtol=0, atol=0)
    assert len(layer.plans) == 3


def test_parameter_values_are_inputs_of_the_plan():
    m = sa.models.self_attention(8, d_k=4, heads=2, dtype=torch.float64)
    layer = sa.compile(m)
    x = torch.randn(1, 5, 8, dtype=torch.float64)
    layer(x), layer(x)
    with torch.no_grad():
        m.W_v.mul_(2.0)
    torch.testing.assert_close(layer(x), layer.interpret(x), rtol=0, atol=0)
    m.load_state_dict({k: torch.randn_like(v) for k, v in m.state_dict().items()})
    torch.testing.assert_close(layer(x), layer.interpret(x), rtol=0, atol=0)
    assert len(layer.plans) == 1  # values changed, the plan did not


def test_an_attribute_change_re_reads():
    m = sa.models.self_attention(8, d_k=4, heads=2, causal=False, dtype=torch.float64)
    layer = sa.compile(m)
    x = torch.randn(1, 5, 8, dtype=torch.float64)
    layer(x), layer(x)
    m.causal = True
    torch.testing.assert_close(layer(x), layer.interpret(x), rtol=0, atol=0)
    layer(x)
    assert len(layer.plans) == 2
    m.to(torch.float32)  # a new dtype of the parameters: a new signature
    x32 = x.float()
    layer(x32), layer(x32)
    torch.testing.assert_close(layer(x32), layer.interpret(x32), rtol=0, atol=0)


def test_value_checks_fire_on_a_replayed_call():
    m = sa.models.self_attention(8, d_k=4, heads=2, dtype=torch.float64)
    layer = sa.compile(m)
    x = torch.randn(1, 5, 8, dtype=torch.float64)
    layer(x), layer(x), layer(x)
    assert next(iter(layer.plans.values())).flags == ("finite",)
    bad = x.clone()
    bad[0, 3, 1] = float("nan")
    with pytest.raises(ValueError, match=r"node set 'x' contains non-finite values .* index "
                                         r"\(0, 3, 1\)"):
        layer(bad)
    with sa.validation(False):
        layer(x), layer(x)
        y = layer(x)
        # on the CPU the checks are the unchecked plan's guards: no error, and a call that
        # fails one is read again, unchecked — NaN carried exactly as the reading carries it
        nan_out = layer(bad)
        read = layer.interpret(bad)
    off = [p for p in layer.plans.values() if p is not next(iter(layer.plans.values()))]
    assert len(off) == 1 and off[0].graph is not None and off[0].flags == ("finite",)
    assert off[0].calls >= 2 and torch.equal(y, layer.interpret(x))
    assert torch.isnan(nan_out).any()
    torch.testing.assert_close(nan_out, read, rtol=0, atol=0, equal_nan=True)


def test_edge_index_checks_fire_on_a_repeated_call():
    model, (x, edge_index) = CASES["graph_attention"]()
    layer = sa.compile(model)
    layer(x, edge_index), layer(x, edge_index), layer(x, edge_index)
    bad = edge_index.clone()
    bad[0, 0] = x.shape[-2] + 3
    with pytest.raises(ValueError, match="must be in"):
        layer(x, bad)


def test_a_reading_that_reads_values_says_why_it_is_not_replayed():
    model, inputs = CASES["expanding_attention"]()
    layer = sa.compile(model)
    layer(*inputs), layer(*inputs)
    (plan,) = layer.plans.values()
    assert plan.graph is None and "windows/loop.py" in plan.reason
    torch.testing.assert_close(layer(*inputs), layer.interpret(*inputs), rtol=0, atol=0)


def test_replay_off_reads_every_call():
    layer = sa.compile(sa.models.self_attention(8, d_k=4, heads=2), replay=False)
    x = torch.randn(1, 5, 8)
    layer(x), layer(x), layer(x)
    assert layer.plans == {}


def test_plans_are_not_state():
    import copy
    import pickle

    layer = sa.compile(sa.models.self_attention(8, d_k=4, heads=2))
    x = torch.randn(1, 5, 8)
    layer(x), layer(x)
    assert set(layer.state_dict()) == {f"declaration.{k}" for k in layer.declaration.state_dict()}
    assert copy.deepcopy(layer).plans == {}
    assert pickle.loads(pickle.dumps(layer)).plans == {}
    layer.reset()
    assert layer.plans == {}


@pytest.mark.parametrize("case", sorted(CASES))
def test_inference_replay_equals_the_reading_bit_for_bit(case):
    """Without gradients what depends on the parameters alone is computed once per change of
    them (Plan.constants_graph); the replay still equals the reading exactly."""
    model, inputs = CASES[case]()
    layer = sa.compile(model)
    with torch.no_grad():
        for opts in ({}, {"return_posterior": True}):
            for _ in range(4):
                torch.manual_seed(1)
                got = layer(*inputs, **opts)
            torch.manual_seed(1)
            assert _leaves_equal(got, layer.interpret(*inputs, **opts)), (case, opts)


def test_constants_follow_the_parameters():
    m = sa.models.relative_position_attention(8, d_k=4, heads=2, max_distance=3,
                                              dtype=torch.float64)
    layer = sa.compile(m)
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    with torch.no_grad():
        for _ in range(3):
            layer(x)
        (plan,) = layer.plans.values()
        assert plan.constants_graph is not None  # the bias table from the learned logits
        m.position_logits.add_(torch.randn_like(m.position_logits))  # an optimizer step
        torch.testing.assert_close(layer(x), layer.interpret(x), rtol=0, atol=0)
        m.load_state_dict({k: torch.randn_like(v) for k, v in m.state_dict().items()})
        torch.testing.assert_close(layer(x), layer.interpret(x), rtol=0, atol=0)


def test_a_program_closing_over_a_parameter_replays_it_live():
    """A plain Pyro program's captured tensors are read through the plan, not copied: an
    in-place update is seen (with and without gradients), and gradients reach them."""
    logits = torch.nn.Parameter(torch.randn(6, 6, dtype=torch.float64))
    W = torch.randn(4, 4, dtype=torch.float64)

    def program(x):
        n = sa.nodes("x", x)
        phi = sa.edges("attn", n, n, sa.priors.Categorical(logits))
        sa.potential(phi, sa.potentials.Bilinear(W, W))
        return sa.value(phi, sa.values.Linear(W))

    layer = sa.compile(program)
    x = torch.randn(2, 6, 4, dtype=torch.float64)
    for _ in range(3):  # read, record, replay: the last call's gradient
        logits.grad = None
        layer(x).sum().backward()
    g = logits.grad.clone()
    assert [p.graph is not None for p in layer.plans.values()] == [True]
    logits.grad = None
    layer.interpret(x).sum().backward()
    torch.testing.assert_close(g, logits.grad, rtol=0, atol=0)
    with torch.no_grad():
        for _ in range(3):
            layer(x)
        logits.add_(1.5 * torch.randn_like(logits))  # in place: the folded tables follow
        torch.testing.assert_close(layer(x), layer.interpret(x), rtol=0, atol=0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_unchecked_replay_carries_nan_as_the_reading_does(case):
    """Validation off: a replayed call with a NaN in its first floating input gives what an
    unchecked reading gives (the plan's checks guard it and send that call back to a reading),
    and a clean call still equals the reading bit for bit."""
    model, inputs = CASES[case]()
    layer = sa.compile(model)
    first = next(i for i, x in enumerate(inputs)
                 if isinstance(x, torch.Tensor) and x.is_floating_point())
    bad = list(inputs)
    bad[first] = inputs[first].clone()
    bad[first].view(-1)[1] = float("nan")
    with sa.validation(False):
        for _ in range(3):
            torch.manual_seed(1)
            clean = layer(*inputs)
        torch.manual_seed(1)
        assert _leaves_equal(clean, layer.interpret(*inputs)), case
        torch.manual_seed(1)
        got = layer(*bad)
        torch.manual_seed(1)
        want = layer.interpret(*bad)
    assert torch.isnan(got).any(), case
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def _calls(graph):
    return [n for n in graph.graph.nodes if n.op == "call_function"]


def test_an_inference_plan_computes_nothing_twice():
    """A recorded reading is simplified: a pure operator called again on the same arguments
    (a factor each step recomputes) runs once, a chain of views that ends where it began is
    gone, and — nothing being differentiated — no ``detach`` is left (bit for bit: the other
    tests). With gradients, repeated operators stay: merging them would change the order in
    which a backward adds their gradients."""
    from structattn.plans.simplify import _RESHAPES

    torch.manual_seed(0)
    m = sa.models.slot_attention(4, 8, recipe="collapsed", iters=3, dtype=torch.float64)
    layer, x = sa.compile(m), torch.randn(1, 12, 8, dtype=torch.float64)
    with torch.no_grad():
        for _ in range(3):
            layer(x)
    plan = next(iter(layer.plans.values()))
    nodes = _calls(plan.graph)
    keys = [(n.target, n.args, tuple(sorted(n.kwargs.items()))) for n in nodes
            if "randn" not in str(n.target)]
    assert len(keys) == len(set(map(str, keys))), "an operator ran twice on the same arguments"
    assert not any("detach" in str(n.target) for n in nodes)
    for n in nodes:  # no view whose result has its input's layout
        v, a = n.meta.get("val"), n.args[0] if n.args else None
        if isinstance(a, torch.fx.Node) and getattr(n.target, "overloadpacket", None) in _RESHAPES:
            w = a.meta.get("val")
            assert (v.shape, v.stride()) != (w.shape, w.stride()), n
    trained = sa.compile(m)
    for _ in range(3):
        trained(x)
    counts = len(_calls(next(iter(trained.plans.values())).graph))
    assert counts > len(nodes)


def test_a_graph_that_writes_into_a_tensor_is_not_simplified():
    from torch.fx.experimental.proxy_tensor import make_fx

    from structattn.plans.simplify import _simplify

    def f(x):
        a, b = x.exp(), x.exp()  # the same value twice, one of them then written into
        a.add_(1)
        return a + b

    g = make_fx(f, pre_dispatch=True)(torch.randn(3))
    before = len(_calls(g))
    _simplify(g.graph)
    g.recompile()
    assert len(_calls(g)) == before
    x = torch.randn(3)
    torch.testing.assert_close(g(x), f(x), rtol=0, atol=0)


@pytest.mark.parametrize("case", ["self_attention", "hopfield"])
def test_unchecked_replay_carries_a_nan_parameter_as_the_reading_does(case):
    """Validation off: a parameter turned NaN after its plan was recorded (a diverged step)
    sends the call back to the unchecked reading, which carries it — never zeros. (float32,
    no grad and head size 8: where the CPU's fused SDPA kernel turns a row of NaN scores
    into zeros.)"""
    torch.manual_seed(0)
    if case == "self_attention":
        model, inputs = sa.models.self_attention(16, heads=2), (torch.randn(2, 5, 16),)
    else:
        model, inputs = sa.models.hopfield(16, 16, heads=2), (torch.randn(2, 3, 16),
                                                              torch.randn(2, 6, 16))
    layer = sa.compile(model)
    with sa.validation(False), torch.no_grad():
        for _ in range(3):
            layer(*inputs)
        model.W_k.view(-1)[0] = float("nan")
        got = layer(*inputs)
        want = layer.interpret(*inputs)
    assert torch.isnan(got).any(), case
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_checks_implied_by_others_leave_the_plan():
    """A reading that checks an input as a whole and its last tokens again (a view of it, a
    node set of their own): the plan keeps the first, which implies the other — and a NaN in
    the last token is still refused, with the reading's message. No grad-mode switch and no
    ``detach`` is left in a no-grad plan. (Expanding attention's final token did this until
    its kernel checked the keys itself: the test below.)"""
    torch.manual_seed(0)
    W = torch.randn(8, 8, dtype=torch.float64)

    def program(x):
        tokens = sa.nodes("tokens", x)
        last = sa.nodes("last", x[:, -1:])
        phi = sa.edges("attn", last, tokens, sa.priors.Uniform())
        sa.potential(phi, sa.potentials.Bilinear(W, W))
        return sa.value(phi, sa.values.Linear(W))

    layer, x = sa.compile(program), torch.randn(1, 20, 8, dtype=torch.float64)
    with torch.no_grad():
        for _ in range(3):
            y = layer(x)
        (plan,) = layer.plans.values()
        assert plan.calls >= 2 and torch.equal(y, layer.interpret(x))
        assert plan.flags.count("finite") == 1
        names = [str(n.target) for n in _calls(plan.graph)]
        assert not any("set_grad_enabled" in t or "detach" in t or t.endswith("eq") for t in names)
        bad = x.clone()
        bad[0, -1, 2] = float("nan")
        with pytest.raises(ValueError, match=r"node set '\w+' contains non-finite values"):
            layer(bad)


@pytest.mark.parametrize("heads, batch", [(1, 1), (2, 3)])
def test_a_kernel_that_checks_the_keys_implies_the_input_check(heads, batch):
    """Expanding attention's no-grad plan: its ``infer`` call refuses keys b = x W_kᵀ (every
    token) holding NaN or inf, so the plan sums nothing of x, reads no flag of its own every
    call — and a NaN or inf anywhere in x, on a replayed call, is still refused with the
    reading's message (the kernel's refusal sends the call back to the reading). With the
    checks off, the replay gives what an unchecked reading gives: NaN from the final token's
    own NaN."""
    torch.manual_seed(0)
    m = sa.models.expanding_attention(8, heads=heads, dtype=torch.float64)
    layer, x = sa.compile(m), torch.randn(batch, 20, 8, dtype=torch.float64)
    with torch.no_grad():
        for _ in range(3):
            y = layer(x, last=1)
        (plan,) = layer.plans.values()
        assert plan.calls >= 2 and torch.equal(y, layer.interpret(x, last=1))
        assert plan.flags.count("finite") == 0, plan.flags
        calls = _calls(plan.graph)
        assert not any("sum" in str(n.target) for n in calls)
        (infer,) = [n for n in calls if "structattn_mean_field.infer" in str(n.target)]
        assert infer.args[-1] is True
        for where in [(0, 0, 0), (batch - 1, 7, 3), (batch - 1, -1, -1)]:
            for value in (float("nan"), float("inf")):
                bad = x.clone()
                bad[where] = value
                with pytest.raises(ValueError, match=r"^node set '\w+' contains non-finite"):
                    layer(bad, last=1)
                with sa.validation(False):
                    got = layer(bad, last=1)
                    want = layer.interpret(bad, last=1)
                if where[1] == -1:  # the final token itself (one far back may lie outside
                    assert bool(torch.isnan(got).any())  # its window: unread, unchecked)
                torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(layer(x, last=1), y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_entry_poisons_its_row_of_linear_even_through_zero_weights(dtype, bad):
    """What lets a plan drop the check of x where linear(x, W) is checked: every entry of
    the output's row is non-finite, whatever the (finite) weights, all zero included."""
    for n, k, m in [(1, 1, 1), (4, 32, 32), (3, 129, 257)]:
        x = torch.randn(n, k, dtype=dtype)
        x[n - 1, k // 2] = bad
        for W in (torch.zeros(m, k, dtype=dtype), torch.randn(m, k, dtype=dtype)):
            y = torch.nn.functional.linear(x, W)
            assert not bool(torch.isfinite(y[n - 1]).any())


def test_an_input_checked_through_its_projection_leaves_the_plan():
    """Hopfield checks its cue r and the state's initial value W_Q r: the plan keeps the
    second, which implies the first (the weights are known finite) — and a NaN or inf in r is
    still refused with the reading's message naming r's node set, checks on or off."""
    torch.manual_seed(0)
    m = sa.models.hopfield(6, 5, iteration=sa.IterationOptions(steps=2), dtype=torch.float64)
    layer = sa.compile(m)
    r, Y = torch.randn(1, 3, 6, dtype=torch.float64), torch.randn(1, 4, 5, dtype=torch.float64)
    for _ in range(3):
        y = layer(r, Y)
    (plan,) = layer.plans.values()
    assert plan.calls >= 1 and torch.equal(y, layer.interpret(r, Y))
    sums = [n for n in _calls(plan.graph) if "sum" in str(n.target)]
    assert plan.flags == ("finite", "finite") and len(sums) == 2  # Y and W_Q r, not r
    for value in (float("nan"), float("inf")):
        bad = r.clone()
        bad[0, 1, 4] = value
        with pytest.raises(ValueError, match=r"node set 'queries' contains non-finite values"):
            layer(bad, Y)
    with sa.validation(False):
        for _ in range(3):
            layer(r, Y)
        bad = r.clone()
        bad[0, 1, 4] = float("nan")
        torch.testing.assert_close(layer(bad, Y), layer.interpret(bad, Y), rtol=0, atol=0,
                                   equal_nan=True)


def test_the_last_plan_is_replayed_only_when_its_guard_holds():
    """The module keeps its last plan behind a guard (modes, parameter identities, input
    layouts); a call that differs in any of them takes the long way and gets its own answer."""
    torch.manual_seed(0)
    m = sa.models.self_attention(8, d_k=4, heads=2, dtype=torch.float64)
    layer, x = sa.compile(m), torch.randn(2, 5, 8, dtype=torch.float64)
    for _ in range(3):
        layer(x)
    plan = layer._plans._last.plan
    calls = plan.calls
    layer(x)
    assert plan.calls == calls + 1  # the guarded fast path
    with torch.no_grad():  # another grad mode: another plan, read first
        assert torch.equal(layer(x), layer.interpret(x))
    assert plan.calls == calls + 1
    x6 = torch.randn(2, 6, 8, dtype=torch.float64)  # another shape
    assert torch.equal(layer(x6), layer.interpret(x6))
    xg = x.clone().requires_grad_()  # requires_grad differs
    assert torch.equal(layer(xg), layer.interpret(xg))
    # a parameter replaced by another tensor of the same layout is read, not replayed stale
    m.W_q = torch.nn.Parameter(torch.randn_like(m.W_q))
    for _ in range(3):
        assert torch.equal(layer(x), layer.interpret(x))
    with sa.iteration(steps=2):  # an override is part of the modes
        assert torch.equal(layer(x), layer.interpret(x))


def test_a_parameter_replaced_inside_a_plain_sub_module_is_seen():
    torch.manual_seed(0)
    m = sa.models.slot_attention(3, 8, iters=2, dtype=torch.float64)
    layer = sa.compile(m)
    x, z = torch.randn(1, 6, 8, dtype=torch.float64), torch.randn(1, 3, 8, dtype=torch.float64)
    for _ in range(3):
        layer(x, z)
    m.to_q.weight = torch.nn.Parameter(torch.randn_like(m.to_q.weight))  # no version bump
    for _ in range(3):
        assert torch.equal(layer(x, z), layer.interpret(x, z))


def test_the_generated_fast_path_sees_the_environment_and_the_module_dicts(monkeypatch):
    """``_Last.run`` is code generated per plan (the graph inlined, parameters fetched by
    name): what it reads besides the graph — the kernels' environment variable, the
    parameter dicts' contents, the parameters' versions — still sends a call that differs
    the long way."""
    torch.manual_seed(0)
    m = sa.models.self_attention(8, d_k=4, heads=2, dtype=torch.float64)
    layer, x = sa.compile(m), torch.randn(1, 5, 8, dtype=torch.float64)
    for _ in range(3):
        layer(x)
    plan = layer._plans._last.plan
    calls = plan.calls
    monkeypatch.setenv("STRUCTATTN_KERNELS", "0")  # another kernel mode: another plan
    assert torch.equal(layer(x), layer.interpret(x))
    assert plan.calls == calls
    monkeypatch.delenv("STRUCTATTN_KERNELS")
    layer(x)
    assert plan.calls == calls + 1
    # a tensor registered beside the recorded ones: the dict changed, the call is read
    m.register_buffer("extra", torch.zeros(3, dtype=torch.float64))
    assert torch.equal(layer(x), layer.interpret(x))
    assert plan.calls == calls + 1
    del m._buffers["extra"]
    # a parameter made non-finite in place (an optimizer step gone wrong): its check's message
    for _ in range(3):
        layer(x)
    with torch.no_grad():
        m.W_k[0, 0] = float("nan")
    with pytest.raises(ValueError, match="W_k"):
        layer(x)


def test_tied_weights_replay_through_the_module_walk():
    """A tensor shared by two attributes is one input of the plan: the fast path takes the
    module's own (deduplicating) walk and compares identities."""
    torch.manual_seed(0)
    m = sa.models.self_attention(8, d_k=8, heads=1, dtype=torch.float64)
    m.W_k = m.W_q  # tied
    layer, x = sa.compile(m), torch.randn(1, 5, 8, dtype=torch.float64)
    for _ in range(3):
        layer(x)
    plan = layer._plans._last.plan
    calls = plan.calls
    assert torch.equal(layer(x), layer.interpret(x)) and plan.calls == calls + 1
    m.W_k = torch.nn.Parameter(m.W_q.detach().clone())  # untied: read again, its own answer
    assert torch.equal(layer(x), layer.interpret(x))


def test_the_fast_path_serves_calls_with_the_same_options_only():
    """Options passed by keyword (``last=1``, ``return_posterior=True``) are part of the last
    plan's guard, compared by type and value: ``last=2`` or ``last=1.0`` is another call."""
    torch.manual_seed(0)
    model, (x,) = CASES["self_attention"]()
    layer = sa.compile(model)
    for _ in range(3):
        layer(x, return_posterior=True)
    plan = layer._plans._last.plan
    calls = plan.calls
    out, post = layer(x, return_posterior=True)
    assert plan.calls == calls + 1
    want = layer.interpret(x, return_posterior=True)
    assert torch.equal(out, want[0]) and torch.equal(post, want[1])
    assert torch.equal(layer(x), layer.interpret(x))  # no option: not this plan
    # an int for the bool is not this plan's call: read, and refused there (only bool is taken)
    with pytest.raises(TypeError, match="return_posterior must be True or False; got 1"):
        layer(x, return_posterior=1)
    assert plan.calls == calls + 1


def test_each_plan_keeps_its_fast_path_when_calls_alternate():
    """Checks on, checks off, on again: each plan's generated fast path is made once (making
    one costs milliseconds for a long graph, which alternating calls would pay every time)."""
    m = sa.models.self_attention(8, d_k=4, heads=2, dtype=torch.float64)
    layer, x = sa.compile(m), torch.randn(1, 5, 8, dtype=torch.float64)
    for _ in range(3):
        layer(x)
        with sa.validation(False):
            layer(x)
    on, off = list(layer.plans.values())
    fast_on, fast_off = on.last, off.last
    assert fast_on is not None and fast_off is not None and fast_on is not fast_off
    for _ in range(2):
        assert torch.equal(layer(x), layer.interpret(x)) and layer._plans._last is fast_on
        with sa.validation(False):
            assert torch.equal(layer(x), layer.interpret(x))
            assert layer._plans._last is fast_off
    assert on.last is fast_on and off.last is fast_off


def test_recent_plans_serve_calls_that_alternate_without_the_long_way(monkeypatch):
    """Training steps with gradients and evaluation under ``no_grad`` or ``inference_mode``
    in turn, and two input shapes in turn: once each plan is recorded, every call is replayed
    by its own plan's fast path (``Plans.replay_recent``), never the long way, with the
    reading's answer bit for bit; a fast path that waited while a parameter was replaced or
    went non-finite still sees it."""
    from structattn.compiling.replay import RECENT, Plans

    torch.manual_seed(0)
    m = sa.models.self_attention(8, d_k=4, heads=2, dtype=torch.float64)
    layer = sa.compile(m)
    x, x6 = torch.randn(2, 5, 8, dtype=torch.float64), torch.randn(2, 6, 8, dtype=torch.float64)
    modes = [torch.enable_grad, torch.no_grad, torch.inference_mode]
    assert len(modes) + 1 <= RECENT
    for _ in range(3):  # read, record, replay each
        for mode in modes:
            with mode():
                layer(x)
        layer(x6)
    long_way = []
    monkeypatch.setattr(Plans, "__call__", lambda *a, f=Plans.__call__: long_way.append(1) or f(*a))
    for _ in range(2):
        for mode in modes:
            with mode():
                out, want = layer(x), layer.interpret(x)
            assert torch.equal(out, want) and out.requires_grad == want.requires_grad
        assert torch.equal(layer(x6), layer.interpret(x6))
    assert long_way == []
    assert all(plan.calls >= 3 for plan in layer.plans.values())
    m.W_q = torch.nn.Parameter(torch.randn_like(m.W_q))  # replaced: each plan's call is read
    for mode in modes:
        with mode():
            assert torch.equal(layer(x), layer.interpret(x))
    for _ in range(3):
        layer(x)
        with torch.no_grad():
            layer(x)
    with torch.no_grad():
        m.W_k[0, 0] = float("nan")
    layer.interpret(x6)  # not replayed: the no_grad plan's fast path waits behind the last
    with pytest.raises(ValueError, match="W_k"), torch.no_grad():
        layer(x)
    with pytest.raises(ValueError, match="W_k"):
        layer(x)


def test_only_the_most_recent_plans_keep_their_fast_path_in_reach():
    """Beyond ``RECENT`` plans replayed in turn, the oldest leaves the recent ones: its call
    takes the long way (its own plan, its own answer) and brings it back."""
    from structattn.compiling.replay import RECENT

    torch.manual_seed(0)
    m = sa.models.self_attention(8, d_k=4, heads=2, dtype=torch.float64)
    xs = [torch.randn(1, n, 8, dtype=torch.float64) for n in range(3, 3 + RECENT + 1)]
    layer = sa.compile(m, dynamic=False)
    for _ in range(3):
        for x in xs:
            layer(x)
    recent = layer._plans._recent
    assert len(recent) == RECENT and recent[0] is layer._plans._last
    assert [r.plan for r in recent] == [layer.plans[k] for k in list(layer.plans)[::-1][:RECENT]]
    oldest = layer.plans[next(iter(layer.plans))]
    assert all(r.plan is not oldest for r in recent)
    assert torch.equal(layer(xs[0]), layer.interpret(xs[0]))
    assert layer._plans._last.plan is oldest and len(layer._plans._recent) == RECENT


def test_hooks_fire_on_replayed_calls():
    """A replayed call skips nn.Module's call machinery only where nothing needs it: with a
    forward pre-hook, a forward hook or a global hook registered, every call goes through
    them (and is still replayed), and the fast path returns once they are removed."""
    torch.manual_seed(0)
    m = sa.models.self_attention(8, d_k=4, heads=2, dtype=torch.float64)
    layer, x = sa.compile(m), torch.randn(1, 5, 8, dtype=torch.float64)
    for _ in range(3):
        y = layer(x)
    plan = layer._plans._last.plan
    seen = []
    pre = layer.register_forward_pre_hook(lambda mod, args: (2 * args[0],))
    post = layer.register_forward_hook(lambda mod, args, out: seen.append(out) or out + 1)
    calls = plan.calls
    out = layer(x)
    assert torch.equal(out, layer.interpret(2 * x) + 1) and len(seen) == 1
    assert plan.calls == calls + 1  # the hooks ran around a replay
    pre.remove(), post.remove()
    glob = torch.nn.modules.module.register_module_forward_hook(
        lambda mod, args, out: seen.append(out))
    try:
        assert torch.equal(layer(x), y) and len(seen) == 2
    finally:
        glob.remove()
    assert torch.equal(layer(x), y) and len(seen) == 2 and plan.calls == calls + 3


def test_checks_of_the_parameters_alone_are_made_when_they_move():
    """A check on values computed from the parameters alone (expanding attention's Beta
    prior a = softplus(raw) > 0) is a constant of the plan: the fast path looks at it when a
    parameter moves, not every call — and a move that fails it (a finite raw value whose
    softplus underflows to 0) is refused with the reading's message; moved back, replayed."""
    torch.manual_seed(0)
    m = sa.models.expanding_attention(16)
    layer, x = sa.compile(m), torch.randn(1, 50, 16)
    with torch.no_grad():
        for _ in range(4):
            y = layer(x, last=1)
        plan = layer._plans._last.plan
        assert plan.constants_graph is not None and "true" in plan.flags
        calls = plan.calls
        keep = m.raw_prior.clone()
        m.raw_prior.fill_(-200.0)  # in place: the same tensor, a new version
        with pytest.raises(ValueError, match=r"BetaGeometric prior: a must be finite and > 0"):
            layer(x, last=1)
        m.raw_prior.copy_(keep)
        assert torch.equal(layer(x, last=1), y) and plan.calls == calls + 1
        m.raw_prior.add_(0.5)  # a move that passes: the constants follow it
        assert torch.equal(layer(x, last=1), layer.interpret(x, last=1))
        assert plan.calls == calls + 2


def test_a_plan_keeps_none_of_the_tracers_notes():
    """The tracer notes on every node its stack trace and a description of the recording
    call's value; only the simplifying passes read them, so a plan drops them (a plan of a
    200-step relaxation held ~380 MB of them, measured with tracemalloc)."""
    torch.manual_seed(0)
    m = sa.models.expanding_attention(8)
    layer, x = sa.compile(m), torch.randn(1, 20, 8)
    with torch.no_grad():
        for _ in range(3):
            y = layer(x)
    (plan,) = layer.plans.values()
    assert plan.graph is not None and plan.constants_graph is not None
    for g in (plan.graph, plan.constants_graph):
        assert all(not node.meta for node in g.graph.nodes)
    with torch.no_grad():
        assert torch.equal(layer(x), y)


def test_a_full_plan_cache_reads_new_signatures_and_warns_once():
    import warnings

    m = sa.models.self_attention(8, heads=2, dtype=torch.float64)
    layer = sa.compile(m, max_plans=2, dynamic=False)  # a plan per size (tests/plans/
    xs = [torch.randn(1, n, 8, dtype=torch.float64) for n in (3, 4, 5, 6)]  # test_dynamic.py)
    for x in xs[:2]:
        for _ in range(2):  # read, record
            layer(x)
    assert len(layer.plans) == 2
    with pytest.warns(RuntimeWarning, match=r"holds max_plans=2 plans .*sa.compile\(model, "
                                            r"max_plans=…\)"):
        for x in xs[2:]:
            for _ in range(3):
                assert torch.equal(layer(x), layer.interpret(x))  # read, every call
    assert len(layer.plans) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per module
        layer(xs[3])
    with pytest.raises(ValueError, match=r"max_plans .* must be an int ≥ 0; got -1"):
        sa.compile(m, max_plans=-1)
    never = sa.compile(m, max_plans=0)
    with pytest.warns(RuntimeWarning, match="max_plans=0"):
        for _ in range(3):
            never(xs[0])
    assert not never.plans
