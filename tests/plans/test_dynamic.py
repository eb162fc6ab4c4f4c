"""Plans with symbolic sizes (``sa.compile(model, dynamic=True)``, the default): once two sizes
of the same inputs have plans, one plan records the reading with its inputs' sizes as symbols
and serves every further size its guards accept — bit for bit what a reading computes."""

import warnings

import pytest
import torch
from torch.utils import _pytree as pytree

import structattn as sa

from ..registry import CASES

#: readings whose window sizes are read from the data: no plan at all (tests/compiling/test_replay.py)
NOT_REPLAYED = {"expanding_attention"}


def _resized(inputs, n):
    """The first input with ``n`` tokens (its dim −2; its dim 0 when it has one dim only) —
    fresh values of the same dtype; the other inputs as they are, but for an edge list
    (graph attention's ``(2, E)``), which gains a self-loop for each new node (so the number
    of edges varies too)."""
    x = inputs[0]
    if len(inputs) == 2 and inputs[1].dtype == torch.long and inputs[1].shape[0] == 2:
        edges, old = inputs[1], int(inputs[1].max()) + 1
        loops = torch.arange(old, max(old, n)).repeat(2, 1)
        keep = edges[:, (edges < n).all(0)]
        return (torch.randn(*x.shape[:-2], n, x.shape[-1], dtype=x.dtype),
                torch.cat([keep, loops], 1))
    dim = -2 if x.dim() >= 2 else 0
    shape = list(x.shape)
    shape[dim] = n
    new = torch.randn(shape, dtype=x.dtype) if x.is_floating_point() else x
    return (new, *inputs[1:])


def _equal(a, b) -> bool:
    la, lb = pytree.tree_leaves(a), pytree.tree_leaves(b)
    return len(la) == len(lb) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
        for x, y in zip(la, lb, strict=True))


#: every case with a plan; the default run takes each model's default configuration, the
#: variants run with ``-m slow``
REPLAYED = sorted(c for c in CASES if CASES[c].model not in NOT_REPLAYED and c not in NOT_REPLAYED)


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if ":" in c else c
                                  for c in REPLAYED])
def test_every_size_replays_what_a_reading_computes(case):
    torch.manual_seed(0)
    model, inputs = CASES[case]()
    layer = sa.compile(model)
    base = inputs[0].shape[-2 if inputs[0].dim() >= 2 else 0]
    for n in (base, base + 1, base + 3, base + 2, base + 5):
        sized = _resized(inputs, n)
        for _ in range(2):
            torch.manual_seed(1)
            got = layer(*sized)
            torch.manual_seed(1)
            assert _equal(got, layer.interpret(*sized)), (case, n)


def test_one_plan_serves_every_further_length():
    m = sa.models.self_attention(16, heads=2, causal=True, dtype=torch.float64)
    layer = sa.compile(m)
    xs = {n: torch.randn(2, n, 16, dtype=torch.float64) for n in (5, 7, 9, 11, 30, 4, 100)}
    for x in xs.values():
        for _ in range(3):
            assert torch.equal(layer(x), layer.interpret(x))
    assert len(layer.plans) == 2  # lengths 5 and 7, one plan each
    (plan,) = layer.dynamic_plans.values()
    assert plan.graph is not None and plan.calls == 15  # 5 further lengths × 3 calls
    assert "L['t0'].size()[1]" in plan.guards  # the length is a symbol, guarded not fixed
    with torch.no_grad():  # another grad mode: another sizes-free signature
        for x in list(xs.values())[:3]:
            for _ in range(3):
                assert torch.equal(layer(x), layer.interpret(x))
    assert len(layer.dynamic_plans) == 2


def test_gradients_through_a_plan_with_symbolic_sizes():
    m = sa.models.self_attention(8, heads=2, dtype=torch.float64)
    layer = sa.compile(m)
    params = list(layer.parameters())
    for n in (3, 4, 6, 9):
        x = torch.randn(1, n, 8, dtype=torch.float64, requires_grad=True)
        for _ in range(2):
            got = torch.autograd.grad(layer(x).sum(), [x, *params])
            want = torch.autograd.grad(layer.interpret(x).sum(), [x, *params])
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), n
    assert next(iter(layer.dynamic_plans.values())).calls >= 4


def test_a_size_the_guards_refuse_is_read():
    """Absolute positions fix the longest sequence (their table's rows): beyond it the plan's
    guard refuses the call, which is read, and raises the reading's own message."""
    torch.manual_seed(0)
    model, inputs = CASES["absolute_position_attention"]()
    layer = sa.compile(model)
    longest = model.max_len
    for n in (3, 4, 5):
        for _ in range(2):
            layer(*_resized(inputs, n))
    (plan,) = layer.dynamic_plans.values()
    assert plan.graph is not None and plan.guards is not None
    with pytest.raises(ValueError, match=rf"but positional encodings exist for "
                                         rf"max_len={longest}"):
        layer(*_resized(inputs, longest + 1))


def test_dynamic_false_records_a_plan_per_size_and_is_checked():
    m = sa.models.self_attention(8, heads=2, dtype=torch.float64)
    layer = sa.compile(m, dynamic=False)
    for n in (3, 4, 5, 6):
        x = torch.randn(1, n, 8, dtype=torch.float64)
        for _ in range(2):
            layer(x)
    assert len(layer.plans) == 4 and layer.dynamic_plans == {}
    with pytest.raises(ValueError, match=r"dynamic .* must be True or False; got 1"):
        sa.compile(m, dynamic=1)


def test_a_reading_that_fixes_every_size_keeps_plans_per_size():
    """A reading that turns each size into a number (here: a Python loop over the tokens) has
    no plan with symbolic sizes; the module says why and keeps a plan per size."""
    def per_token(x):
        tokens = sa.nodes("x", x)
        phi = sa.edges("attn", tokens, tokens, sa.priors.Uniform(causal=True))
        sa.potential(phi, sa.potentials.DotProduct())
        out = sa.value(phi, sa.values.Identity())
        return torch.stack([out[..., i, :] for i in range(int(x.shape[-2]))], -2)

    layer = sa.compile(per_token)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for n in (3, 4, 5, 6):
            x = torch.randn(1, n, 4, dtype=torch.float64)
            for _ in range(2):
                assert torch.equal(layer(x), layer.interpret(x))
    (plan,) = layer.dynamic_plans.values()
    assert plan.graph is None and "fixes the sizes of its inputs" in plan.reason
    assert len(layer.plans) == 4


def test_many_lengths_with_few_plans_are_served_without_a_warning():
    """Fifty lengths through a module of two plans: the plan with symbolic sizes serves all
    but the first two, and the full cache's warning (tests/compiling/test_replay.py) is not given."""
    m = sa.models.self_attention(8, heads=2, dtype=torch.float64)
    layer = sa.compile(m, max_plans=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for n in range(3, 53):
            x = torch.randn(1, n, 8, dtype=torch.float64)
            for _ in range(2):
                assert torch.equal(layer(x), layer.interpret(x))
    assert len(layer.plans) == 2
    (plan,) = layer.dynamic_plans.values()
    assert plan.calls == 2 * 48


def test_the_guards_check_every_size_the_reading_fixed():
    """The model width is fixed by the reading (``features=``): a plan with symbolic sizes
    guards it by value, so another width is read, and refused with the reading's message;
    a non-contiguous input (another stride) is read too, with the same result."""
    m = sa.models.self_attention(8, heads=2, dtype=torch.float64)
    layer = sa.compile(m)
    for n in (3, 4, 5):
        for _ in range(2):
            layer(torch.randn(1, n, 8, dtype=torch.float64))
    (plan,) = layer.dynamic_plans.values()
    assert "L['t0'].size()[2] == 8" in plan.guards
    assert not plan.guard([torch.randn(1, 6, 9, dtype=torch.float64)])
    with pytest.raises(ValueError, match=r"node set 'x'.*\(\*batch, n, 8\)"):
        layer(torch.randn(1, 6, 9, dtype=torch.float64))
    wide = torch.randn(1, 6, 16, dtype=torch.float64)[..., ::2]  # (1, 6, 8), stride 2
    assert not plan.guard([wide])
    assert torch.equal(layer(wide), layer.interpret(wide))


def test_calls_with_another_number_of_inputs_keep_their_own_plans():
    """Signatures of one module that differ in their inputs' number or kind (a second input
    given or not) are told apart when sizes are compared: each gets its plans, every call
    equal to its reading."""
    def program(x, scale=None):
        tokens = sa.nodes("x", x if scale is None else x * scale)
        phi = sa.edges("attn", tokens, tokens, sa.priors.Uniform(causal=True))
        sa.potential(phi, sa.potentials.DotProduct())
        return sa.value(phi, sa.values.Identity())

    layer = sa.compile(program)
    for n in (3, 4, 5, 6):
        x = torch.randn(1, n, 4, dtype=torch.float64)
        for args in ((x,), (x, torch.tensor(2.0, dtype=torch.float64)), (x, 3.0)):
            for _ in range(2):
                assert torch.equal(layer(*args), layer.interpret(*args))
    assert len(layer.dynamic_plans) == 3
