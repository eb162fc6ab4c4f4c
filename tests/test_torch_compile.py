"""Every catalogue model compiles with ``torch.compile(layer, fullgraph=True)``: dynamo reads the
declaration itself (plans are bypassed under it) and finds no graph break."""

import pytest
import torch

import structattn as sa

from .registry import CASES

#: readings that branch on tensor values cannot be one graph: the mean-field windows' sizes
#: depend on the data (the compiled kernel and the loop run eagerly under torch.compile)
NOT_ONE_GRAPH = {"expanding_attention"}
#: the CPU, and a CUDA device where there is one (tests/test_cuda.py has the rest of the GPU's)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", sorted(c for c in CASES if c not in NOT_ONE_GRAPH))
def test_fullgraph_compile_equals_the_reading(case, device):
    torch._dynamo.reset()
    model, inputs = CASES[case]()
    model = model.to(device)
    inputs = tuple(x.to(device) for x in inputs)
    layer = sa.compile(model)
    compiled = torch.compile(layer, fullgraph=True, backend="eager")
    torch.manual_seed(3)
    got = compiled(*inputs)
    torch.manual_seed(3)
    want = layer(*inputs)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores")  # inductor's advice on CUDA
def test_fullgraph_compile_with_inductor_trains(device):
    """Inductor's code for one catalogue model, forward and backward, equals the reading."""
    torch._dynamo.reset()
    m = sa.models.self_attention(16, d_k=4, heads=4, causal=True, device=device)
    layer = sa.compile(m)
    x = torch.randn(2, 9, 16, device=device)
    compiled = torch.compile(layer, fullgraph=True)
    torch.testing.assert_close(compiled(x), layer(x))
    compiled(x).sum().backward()
    g = m.W_q.grad.clone()
    m.zero_grad()
    layer(x).sum().backward()
    torch.testing.assert_close(g, m.W_q.grad)
