"""A prior stating only ``log_weight`` read a block of children at a time (``kinds/row_chunks.py``):
random non-stationary priors on random supports against Pyro's exact enumeration and, with
every gradient (the prior's parameters included), the dense reading, float64, with blocks of
3 children so that small sizes cross them; such a call is read every call, never recorded;
its checks name the child and the NaN; no (…, N, N) tensor at N = 1,024."""

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import structattn as sa
from structattn.kinds import blocks, row_chunks

from ..supports import Band, Global
from .test_distance_table import _Largest, _program

f64 = torch.float64


class Drift(sa.priors.Prior):
    """log w_ij = −a_h·|i − j|·(1 + i/n0) + c_h·[j even]: a slope growing along the sequence
    (not a function of i − j alone), learned a and c, on a support of one's own."""

    def __init__(self, a, c, support=None, n0=8.0):
        self.a, self.c, self._support, self.n0 = a, c, support, n0

    def support(self, num_children, num_parents):
        return self._support or sa.kinds.AllParents()

    def log_weight(self, child, parent, sizes):
        a, c = (t.reshape(-1, 1, 1) for t in (self.a, self.c))
        d = (child - parent).abs().to(a.dtype)
        return -a * d * (1 + child.to(a.dtype) / self.n0) + c * (parent % 2 == 0).to(a.dtype)


@contextlib.contextmanager
def small_rows():
    """Blocks of 3 children, from any size."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(blocks, "BLOCKS_FROM", 1)
        mp.setattr(blocks, "MOST_LISTED", 0.0)  # no support read by blocks: these tests' own
        mp.setattr(row_chunks, "ROWS", 3)
        yield


SUPPORTS = [None, sa.kinds.Causal(), Band(2) | Global(1)]


@settings(max_examples=12, deadline=None)
@given(n=st.integers(1, 11), heads=st.integers(1, 2), which=st.integers(0, 2),
       seed=st.integers(0, 999))
def test_equals_pyro_and_the_dense_reading_with_every_gradient(n, heads, which, seed):
    g = torch.Generator().manual_seed(seed)
    W = [torch.randn(heads * 2, 3, generator=g, dtype=f64).requires_grad_() for _ in range(3)]
    a = torch.rand(heads, generator=g, dtype=f64).requires_grad_()
    c = torch.randn(heads, generator=g, dtype=f64).requires_grad_()
    program = _program(lambda: Drift(a, c, SUPPORTS[which]), W, heads)
    x = torch.randn(2, n, 3, generator=g, dtype=f64)
    with small_rows():
        layer = sa.compile(program)
        assert layer.explain(x)["attn"].reading == "rows"
        out = layer(x)
        report = sa.inference.compare(program, x, atol=1e-10)
    assert report.passed, report
    dense = sa.compile(program)(x)  # under 1,024 tokens: the dense table
    torch.testing.assert_close(out, dense, atol=1e-12, rtol=0)
    dout = torch.randn_like(out)
    leaves = [*W, a, c]
    for got, want in zip(torch.autograd.grad(out, leaves, dout),
                         torch.autograd.grad(dense, leaves, dout), strict=True):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=0)


def test_read_every_call_never_recorded():
    W = [torch.randn(2, 3, dtype=f64) for _ in range(3)]
    one = torch.ones(1, dtype=f64)
    layer = sa.compile(_program(lambda: Drift(one, one), W, 1))
    x = torch.randn(1, 7, 3, dtype=f64)
    with small_rows():
        outs = [layer(x) for _ in range(3)]
    assert all(torch.equal(o, outs[0]) for o in outs)
    reasons = [p.reason for p in layer.plans.values()]
    assert reasons and all("read every call" in str(r) for r in reasons), reasons


def test_checks_name_the_child_and_the_nan():
    class Bad(Drift):
        def log_weight(self, child, parent, sizes):
            lw = super().log_weight(child, parent, sizes)
            return lw.masked_fill((child == 4) & (parent == 2), float("nan"))

    class Empty(Drift):
        def log_weight(self, child, parent, sizes):
            lw = super().log_weight(child, parent, sizes)
            return lw.masked_fill(child == 5, float("-inf"))

    W = [torch.randn(2, 3, dtype=f64) for _ in range(3)]
    one = torch.ones(1, dtype=f64)
    x = torch.randn(1, 8, 3, dtype=f64)
    with small_rows():
        with pytest.raises(ValueError, match=r"prior log weights contain non-finite values .* "
                                             r"at index \(rows 3…\)"):
            sa.compile(_program(lambda: Bad(one, one), W, 1))(x)
        with pytest.raises(ValueError, match=r"edge family 'attn': child 5 \(index \(5,\)\) has "
                                             r"an empty support .* 1 of 8 children"):
            sa.compile(_program(lambda: Empty(one, one), W, 1))(x)


@pytest.mark.parametrize("support", [sa.kinds.Causal(), Band(64) | Global(4)])
def test_no_n_by_n_tensor_forward_or_backward(support):
    N, heads = 1024, 4
    g = torch.Generator().manual_seed(0)
    W = [torch.randn(heads * 8, 16, generator=g).requires_grad_() for _ in range(3)]
    a = torch.rand(heads, generator=g).requires_grad_()
    c = torch.randn(heads, generator=g).requires_grad_()
    layer = sa.compile(_program(lambda: Drift(a, c, support, n0=512.0), W, heads))
    x = torch.randn(1, N, 16)
    assert layer.explain(x)["attn"].reading == "rows"
    for _ in range(2):  # declared and validated too: every block, never the C×P table
        with _Largest(square=N) as seen:
            layer(x).sum().backward()
        assert not seen.square, seen.square
    assert a.grad is not None and c.grad is not None
