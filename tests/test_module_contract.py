"""Compiled modules are ordinary modules: dtypes, torch.compile, state_dict, DDP, no hidden device."""

import os

import pytest
import torch

import structattn as sa

from .reference import random_support, softmax_attention


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_low_precision_error_within_eager_error(dtype, causal):
    """flex_attention's rule: the fast path's error vs a float64 golden is within a small
    factor of the error of the dense eager reference computed at the same dtype."""
    m64 = sa.models.self_attention(32, d_k=8, heads=4, causal=causal, dtype=torch.float64)
    x64 = torch.randn(3, 37, 32, dtype=torch.float64)
    golden, _ = softmax_attention(m64.W_q, m64.W_k, m64.W_v, m64.W_o, x64, x64, 4,
                                  causal=causal)
    m = sa.models.self_attention(32, d_k=8, heads=4, causal=causal, dtype=dtype)
    m.load_state_dict({k: v.to(dtype) for k, v in m64.state_dict().items()})
    x = x64.to(dtype)
    y = sa.compile(m)(x)
    y_post, post = sa.compile(m)(x, return_posterior=True)
    eager, _ = softmax_attention(m.W_q, m.W_k, m.W_v, m.W_o, x, x, 4, causal=causal)
    assert y.dtype == dtype and post.dtype == dtype
    err_fast = (y.double() - golden).abs().max()
    err_dense = (y_post.double() - golden).abs().max()
    err_eager = (eager.double() - golden).abs().max()
    assert err_fast <= 3 * err_eager + 1e-6, (err_fast, err_eager)
    assert err_dense <= 3 * err_eager + 1e-6, (err_dense, err_eager)


def test_bias_prior_in_bfloat16():
    logits = torch.randn(5, 5)
    W = torch.randn(4, 6)
    support = random_support(5, 5)

    def program(x, logits, W):
        n = sa.nodes("x", x)
        phi = sa.edges("attn", n, n, sa.priors.Categorical(logits, support=support))
        sa.potential(phi, sa.potentials.Bilinear(W, W))
        return sa.value(phi, sa.values.Linear(W))

    x = torch.randn(2, 5, 6)
    golden = sa.compile(program)(x.double(), logits.double(), W.double())
    y = sa.compile(program)(x.bfloat16(), logits.bfloat16(), W.bfloat16())
    assert y.dtype == torch.bfloat16
    assert (y.double() - golden).abs().max() < 0.1


@pytest.mark.parametrize("name", ["self_attention", "relative_position_attention",
                                  "alibi_attention", "multihop_attention", "graph_attention"])
def test_torch_compile_traces_one_graph(name):
    """Compiled modules skip Pyro's handler stack, so dynamo sees one graph, no breaks."""
    import torch._dynamo

    from .registry import CASES

    model, inputs = CASES[name]()
    layer = sa.compile(model.float())
    inputs = tuple(x.float() if x.is_floating_point() else x for x in inputs)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(layer)(*inputs)
    assert explained.graph_break_count == 0, explained.break_reasons
    torch.testing.assert_close(torch.compile(layer)(*inputs), layer(*inputs))


#: the same model, input and Inductor compile as test_torch_compile.py's
#: test_fullgraph_compile_with_inductor_trains[cpu], which also holds the graph whole and the
#: gradient equal to the eager one: in the default run that one stands for it
@pytest.mark.slow
def test_torch_compile_matches_eager():
    m = sa.models.self_attention(16, d_k=4, heads=4, causal=True)
    layer = sa.compile(m)
    x = torch.randn(2, 9, 16)
    compiled = torch.compile(layer)
    torch.testing.assert_close(compiled(x), layer(x))
    compiled(x).sum().backward()
    assert m.W_q.grad is not None and torch.isfinite(m.W_q.grad).all()


def test_state_dict_round_trip_weights_only(tmp_path):
    m = sa.models.cross_attention(6, 5, d_k=3, heads=2)
    layer = sa.compile(m)
    assert set(layer.state_dict()) == {f"declaration.{k}" for k in m.state_dict()}
    path = tmp_path / "layer.pt"
    torch.save(layer.state_dict(), path)
    fresh = sa.compile(sa.models.cross_attention(6, 5, d_k=3, heads=2))
    fresh.load_state_dict(torch.load(path, weights_only=True))
    q, k = torch.randn(2, 4, 6), torch.randn(2, 3, 5)
    torch.testing.assert_close(fresh(q, k), layer(q, k))


def test_compiled_module_shares_declaration_parameters():
    m = sa.models.self_attention(6, d_k=2, heads=3)
    layer = sa.compile(m)
    assert {id(p) for p in layer.parameters()} == {id(p) for p in m.parameters()}
    with torch.no_grad():
        m.W_v.zero_()
    assert layer(torch.randn(1, 4, 6)).abs().max() == 0


def test_module_to_moves_everything():
    layer = sa.compile(sa.models.self_attention(6, d_k=2, heads=3)).to(torch.float64)
    assert layer(torch.randn(1, 4, 6, dtype=torch.float64)).dtype == torch.float64


def test_ddp_single_process(tmp_path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from .distributed import release_process_group

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    def check():  # its locals (the DDP reducer) die before the process group
        layer = sa.compile(sa.models.self_attention(8, d_k=4, heads=2, causal=True))
        ddp = DDP(layer)
        x = torch.randn(3, 5, 8)
        out = ddp(x)
        torch.testing.assert_close(out, layer(x))
        out.square().mean().backward()
        assert all(p.grad is not None for p in layer.parameters())

    try:
        check()
    finally:
        release_process_group()


def test_compiled_modules_run_concurrently_in_threads():
    """Readers are per thread (as nn.DataParallel replicas run): no cross-talk between calls."""
    from concurrent.futures import ThreadPoolExecutor

    a = sa.compile(sa.models.self_attention(8, d_k=4, heads=2, causal=True))
    b = sa.compile(sa.models.multihop_attention(8, d_k=4, heads=2))
    xs = [torch.randn(2, 5 + i % 3, 8) for i in range(16)]
    expected = [(a(x), b(x)) for x in xs]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda x: (a(x), b(x)), xs))
    for (ea, eb), (ga, gb) in zip(expected, got, strict=True):
        torch.testing.assert_close(ga, ea)
        torch.testing.assert_close(gb, eb)


def test_float16_runs():
    m = sa.models.self_attention(8, heads=2).to(torch.float16)
    y = sa.compile(m)(torch.randn(2, 5, 8, dtype=torch.float16))
    assert y.dtype == torch.float16 and torch.isfinite(y).all()
