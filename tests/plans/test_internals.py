"""The contracts of the torch internals the plan compiler relies on (``structattn.plans.
internals``), each checked by name: a torch release that changes one fails here."""

import torch
import torch.nn.functional as F
from torch import nn

from structattn.plans import internals


def test_trace_keeps_composite_operators_whole():
    """Pre-dispatch ``make_fx``: ``linear`` and ``scaled_dot_product_attention`` are one node
    each, not their decompositions."""
    w = torch.randn(4, 4)

    def f(x):
        y = F.linear(x, w)
        return F.scaled_dot_product_attention(y, y, y)

    graph = internals.trace(f)(torch.randn(2, 3, 4))
    targets = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
    assert any("linear" in t for t in targets), targets
    assert any("scaled_dot_product_attention" in t for t in targets), targets
    assert not any(t.startswith("aten.mm") or "softmax" in t for t in targets), targets
    assert all(isinstance(n.target, internals.OpOverload) for n in graph.graph.nodes
               if n.op == "call_function" and str(n.target).startswith("aten."))


def test_reparametrized_swaps_a_modules_parameters():
    m = nn.Linear(3, 2, bias=False)
    other = torch.zeros(2, 3)
    with internals.reparametrized(m, {"weight": other}):
        assert torch.equal(m(torch.ones(1, 3)), torch.zeros(1, 2))
    assert m.weight is not other


def test_version_moves_on_in_place_writes_and_storage_on_new_data():
    p = nn.Parameter(torch.randn(3))
    v, s = internals.version(p), internals.storage_id(p)
    with torch.no_grad():
        p.add_(1)
    assert internals.version(p) > v and internals.storage_id(p) == s
    held = internals.storage_ref(p)  # as the plans hold it: no new storage takes its address
    p.data = torch.randn(3)  # new values in another storage, the version counter as it was
    assert internals.storage_id(p) != s
    s, held = internals.storage_id(p), [held, internals.storage_ref(p)]
    torch.nn.utils.vector_to_parameters(torch.randn(3), [p])  # the same: a new storage
    assert internals.storage_id(p) != s
    assert eval(internals.VERSION.format("p")) == internals.version(p)
    # (the expression as the fast path evaluates it: its one global bound there)
    assert eval(internals.STORAGE.format("p"),
                {"_sa_storage_address": internals.storage_address}, {"p": p}) \
        == internals.storage_id(p) == p.untyped_storage()._cdata


def test_a_storage_ref_expires_with_its_storage():
    t = torch.randn(4)
    ref = internals.storage_ref(t)
    assert not ref.expired()
    del t
    assert ref.expired()


def test_tensor_guards_accept_the_recorded_signature_only():
    x = torch.randn(2, 3)
    check = internals.tensor_guards([x])
    assert check(torch.randn(2, 3))
    assert not check(torch.randn(2, 4))
    assert not check(torch.randn(2, 3, dtype=torch.float64))
    assert not check(torch.randn(2, 3, requires_grad=True))
    assert not check(torch.randn(2, 3).to(torch.float16))


def test_tensor_guards_with_free_sizes_check_all_but_the_sizes():
    x, w = torch.randn(2, 3), torch.randn(4)
    check = internals.tensor_guards([x, w], free=1)
    assert check(torch.randn(5, 7), torch.randn(4))
    assert not check(torch.randn(5, 7), torch.randn(5))  # only the first tensor's are free
    assert not check(torch.randn(5, 7, 1), torch.randn(4))  # the rank is not
    assert not check(torch.randn(5, 7, dtype=torch.float64), torch.randn(4))


def test_trace_symbolic_and_size_guard():
    """make_fx on fake tensors of a ShapeEnv of its own: the graph runs at other sizes, and
    the guard accepts the sizes its reading allows and refuses the others."""
    w = torch.randn(3, 3)

    def f(w, x):
        torch._check(x.shape[-1] == 3)
        return (x @ w).sum(-2) if x.shape[-2] > 1 else x @ w

    graph, fakes = internals.trace_symbolic(f, [w], [torch.randn(4, 3)])
    guard, text, specialized = internals.size_guard(graph, fakes)
    assert not specialized and "L['t0'].size()[0]" in text
    x = torch.randn(9, 3)
    assert guard([x]) and torch.equal(graph(w, x), f(w, x))
    assert not guard([torch.randn(9, 4)])  # the checked width
    assert not guard([torch.randn(1, 3)])  # the branch not taken


def test_tracing_state_is_set_inside_jit_trace_only():
    assert internals.tracing_state() is None
    seen = []

    def f(x):
        seen.append(internals.tracing_state() is not None)
        return x * 2

    torch.jit.trace(f, torch.randn(2), check_trace=False)
    assert seen == [True] and internals.tracing_state() is None


def test_global_hooks_are_the_dicts_torch_registers_into():
    assert not any(internals.GLOBAL_HOOKS)
    handles = [nn.modules.module.register_module_forward_pre_hook(lambda m, a: None),
               nn.modules.module.register_module_forward_hook(lambda m, a, o: None),
               nn.modules.module.register_module_full_backward_hook(lambda m, gi, go: None),
               nn.modules.module.register_module_full_backward_pre_hook(lambda m, go: None)]
    try:
        assert all(internals.GLOBAL_HOOKS)
    finally:
        for h in handles:
            h.remove()
    assert not any(internals.GLOBAL_HOOKS)


def test_autocast_modes_name_each_device_type_on_and_its_dtype():
    """``torch.is_autocast_enabled()`` is CUDA's alone: the signature reads every device type."""
    assert internals.autocast_modes() is False
    with torch.autocast("cpu", torch.bfloat16):
        assert not torch.is_autocast_enabled()
        assert internals.autocast_modes() == (("cpu", torch.bfloat16),)
    with torch.autocast("cpu", torch.float16):
        assert internals.autocast_modes() == (("cpu", torch.float16),)
    assert internals.autocast_modes() is False
