"""A uniform prior on a support of few tiles, read by blocks (``kinds/blocks.py``,
``kinds/block_support.py``) inside the dense operator: random user declarations — unions and
intersections of bands, global tokens, strides, the strict past and masks — against Pyro's
exact enumeration and, with every gradient, the dense reading (kernels off), float64, with
small tiles so that small sizes cross them; a support's structure computed once per support
and sizes, one holding a mask read densely (an edit in place is seen); no (…, N, N) tensor at
N = 2,048."""

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import structattn as sa
from structattn.kinds import block_support, blocks

from ..supports import Band, Global, Stride
from .test_distance_table import _Largest
from .test_distance_table import _program as one_prior_program

f64 = torch.float64
pytestmark = pytest.mark.skipif(block_support._ops() is None,
                                reason="the compiled block-support kernel is not built")


class SupportPrior(sa.priors.Prior):
    """A uniform prior on a given support; children left without parents read nothing."""

    empty = "zero"

    def __init__(self, support):
        self._support = support

    def support(self, num_children, num_parents):
        return self._support


@contextlib.contextmanager
def small_tiles():
    """Tiles of 4 × 4 read by blocks from any size and any share of the tiles listed."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(blocks, "BLOCK_Q", 4)
        mp.setattr(blocks, "BLOCK_K", 4)
        mp.setattr(blocks, "BLOCKS_FROM", 1)
        mp.setattr(blocks, "MOST_LISTED", 1.0)
        mp.setattr(blocks, "_kept", type(blocks._kept)())
        yield


def _support(draw, n):
    """A random union or intersection of two or three parts."""
    parts = st.one_of(
        st.integers(0, 4).map(Band), st.integers(1, 3).map(Global), st.integers(2, 4).map(Stride),
        st.just(sa.kinds.Before()),
        st.integers(0, 10_000).map(lambda s: sa.kinds.Mask(
            torch.rand(n, n, generator=torch.Generator().manual_seed(s)) < 0.2)))
    chosen = draw(st.lists(parts, min_size=2, max_size=3))
    combined = chosen[0]
    for p in chosen[1:]:
        combined = combined | p if draw(st.booleans()) else combined & p
    return combined


def _program(prior, W, heads):
    """One family over x under ``prior`` (an instance: ``test_distance_table._program``'s)."""
    return one_prior_program(lambda: prior, W, heads)


@settings(max_examples=20, deadline=None)
@given(data=st.data(), n=st.integers(1, 14), heads=st.integers(1, 2), seed=st.integers(0, 999))
def test_random_supports_equal_pyro_and_the_dense_reading(data, n, heads, seed):
    with small_tiles():
        _random_support_case(_support(data.draw, n), n, heads, seed)


def _random_support_case(support, n, heads, seed):
    g = torch.Generator().manual_seed(seed)
    W = [torch.randn(heads * 2, 3, generator=g, dtype=f64).requires_grad_() for _ in range(3)]
    program = _program(SupportPrior(support), W, heads)
    x = torch.randn(2, n, 3, generator=g, dtype=f64)
    layer = sa.compile(program)  # a support holding a Mask: its dense mask
    keyed = blocks.support_key(support) is not None
    assert layer.explain(x)["attn"].reading == ("blocks" if keyed else "dense")
    out = layer(x)
    report = sa.inference.compare(program, x, atol=1e-10)
    assert report.passed, report
    with sa.kernels.disabled():
        dense = sa.compile(program)(x)
    torch.testing.assert_close(out, dense, atol=1e-12, rtol=0)
    dout = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, W, dout), torch.autograd.grad(dense, W, dout),
                    strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


def test_an_empty_row_is_refused_by_name_unless_empty_is_zero():
    with small_tiles():
        _empty_rows()


def _empty_rows():
    class Strict(SupportPrior):
        empty = "error"

    W = [torch.randn(2, 3, dtype=f64) for _ in range(3)]
    x = torch.randn(1, 9, 3, dtype=f64)
    with pytest.raises(ValueError, match=r"edge family 'attn': child 0 \(index \(0,\)\) has an "
                                         r"empty support .* 1 of 9 children"):
        sa.compile(_program(Strict(sa.kinds.Before()), W, 1))(x)
    out = sa.compile(_program(SupportPrior(sa.kinds.Before()), W, 1))(x)
    assert (out[..., 0, :] == 0).all() and (out[..., 1:, :] != 0).all()


def test_a_structure_is_computed_once_per_support_and_sizes_a_mask_never():
    """A support of plain attributes is classified once per sizes (a plan holds it); one with
    a mask is read through its dense mask, never classified, and an edit in place is read."""
    with small_tiles():
        _once_and_every_call()


def _once_and_every_call():
    assert blocks.support_key(Band(3)) == blocks.support_key(Band(3))
    assert blocks.support_key(Band(3)) != blocks.support_key(Band(4))
    assert blocks.support_key(Band(3) | Global(1)) is not None
    mask = torch.rand(12, 12) < 0.3
    assert blocks.support_key(Band(3) | sa.kinds.Mask(mask)) is None
    seen = []
    real = blocks.classify

    def counting(*args, **kwargs):
        seen.append(args[0].describe())
        return real(*args, **kwargs)
    W = [torch.randn(2, 3, dtype=f64) for _ in range(3)]
    x = torch.randn(1, 12, 3, dtype=f64)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(blocks, "classify", counting)
        layer = sa.compile(_program(SupportPrior(Band(2) | Global(1)), W, 1))
        for _ in range(4):  # read, recorded, replayed twice
            layer(x)
        assert len(seen) == 1
        masked = _program(SupportPrior(Band(1) | sa.kinds.Mask(mask)), W, 1)
        layer = sa.compile(masked)
        assert layer.explain(x)["attn"].reading == "dense"  # the mask the caller holds
        for _ in range(3):
            layer(x)
        mask[5] = ~mask[5]  # an edit in place: the next call reads it
        out = layer(x)
        assert len(seen) == 1  # never classified
    with sa.kernels.disabled():
        torch.testing.assert_close(out, sa.compile(masked)(x), atol=1e-12, rtol=0)


def test_longformer_visits_few_tiles_and_no_n_by_n_tensor():
    """The guide's Longformer at N = 2,048 with the library's own tiles: read by blocks,
    forward and backward (read, recorded and replayed), no op returning N²/2 entries."""
    N, heads = 2048, 2
    g = torch.Generator().manual_seed(0)
    W = [torch.randn(heads * 8, 16, generator=g).requires_grad_() for _ in range(3)]
    layer = sa.compile(_program(SupportPrior(Band(64) | Global(8)), W, heads))
    x = torch.randn(1, N, 16)
    low = layer.explain(x)["attn"]
    assert low.reading == "blocks" and low.visited < 0.2, low
    for _ in range(3):
        with _Largest() as seen:
            layer(x).sum().backward()
        assert seen.largest < N * N // 2, seen.largest


def test_an_exported_program_reads_the_dense_mask_and_agrees():
    """``structattn.export`` runs without structattn: no block kernel, no classification in
    the program; its output equals the compiled layer's reading by blocks."""
    W = [torch.randn(4, 3, dtype=f64) for _ in range(3)]
    program = _program(SupportPrior(Band(2) | Global(1)), W, 2)
    x = torch.randn(1, 13, 3, dtype=f64)
    with small_tiles():
        layer = sa.compile(program)
        assert layer.explain(x)["attn"].reading == "blocks"
        out = layer(x)
        exported = sa.export(program, x)
    torch.testing.assert_close(exported.module()(x), out, atol=1e-12, rtol=0)
