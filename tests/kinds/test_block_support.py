"""Supports read by blocks: the classification of a support's tiles (``kinds/blocks.py``)
against its ``contains`` on the whole grid, and attention over the listed tiles
(``kinds/block_support.py``: the compiled kernel ``csrc/block_support.cpp`` and its Python
loop) against a masked softmax written out in float64 — outputs and gradients, children with
no parent included — by gradcheck and opcheck, over random unions and intersections of bands,
global tokens, strides, masks, windows and j ≤ i on sizes that are not multiples of the
blocks."""

import doctest

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import structattn as sa
from structattn import kernels
from structattn.kinds import Before, Causal, Mask, Window, grid
from structattn.kinds import block_support as block_support_module
from structattn.kinds import blocks as blocks_module
from structattn.kinds.block_support import block_support_attention, by_child_blocks, uses_kernel
from structattn.kinds.blocks import SupportBlocks, classify

from ..supports import Band, Global, Stride

f64 = torch.float64


@pytest.fixture(scope="module", autouse=True)
def kernel_built():
    """The set-up script builds the kernels: a machine without this one fails here, loudly,
    rather than testing the Python loop twice."""
    if kernels.block_support() is None:
        pytest.fail(f"the block-support kernel is not available: {kernels.build_error()}")


@st.composite
def supports(draw, C, P):
    """A union or intersection of up to three random parts on C children × P parents."""
    def part():
        kind = draw(st.sampled_from(["band", "global", "stride", "mask", "causal", "before",
                                     "window"]))
        if kind == "band":
            return Band(draw(st.integers(0, 6)))
        if kind == "global":
            return Global(draw(st.integers(0, 3)))
        if kind == "stride":
            return Stride(draw(st.integers(2, 5)))
        if kind == "mask":
            g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 16)))
            return Mask(torch.rand(C, P, generator=g) < draw(st.sampled_from([0.05, 0.3, 0.9])))
        if kind == "window":
            return Window(draw(st.integers(1, 6)), first=draw(st.integers(0, 1)))
        return Causal() if kind == "causal" else Before()
    support = part()
    for _ in range(draw(st.integers(0, 2))):
        support = (support | part()) if draw(st.booleans()) else (support & part())
    return support


@st.composite
def cases(draw, most=40):
    """(C, P, support, BQ, BK): sizes mostly not multiples of the blocks."""
    C, P = draw(st.integers(0, most)), draw(st.integers(0, most))
    sizes = st.sampled_from([1, 2, 3, 5, 7, 8, 16])
    return C, P, draw(supports(C, P)), draw(sizes), draw(sizes)


def allowed(support, C, P) -> torch.Tensor:
    """The support's (C, P) mask on the whole grid."""
    return support.contains(*grid(C, P, "cpu")).expand(C, P)


def tiles_of(s: SupportBlocks) -> torch.Tensor:
    """The structure written back as a padded (nq·BQ, nk·BK) mask: full tiles all True."""
    BQ, BK = s.block_q, s.block_k
    out = torch.zeros(s.num_child_blocks * BQ, s.num_parent_blocks * BK, dtype=torch.bool)
    for r in range(s.num_child_blocks):
        for e in range(int(s.offsets[r]), int(s.offsets[r + 1])):
            c, m = int(s.blocks[e]), int(s.mask_index[e])
            out[r * BQ:(r + 1) * BQ, c * BK:(c + 1) * BK] = True if m < 0 else s.masks[m]
    return out


def by_hand(a, b, u, inside, scale):
    """softmax_j(scale·⟨a_i, b_j⟩) u_j over the allowed j, 0 for a child without any."""
    s = (scale * a @ b.transpose(-1, -2)).masked_fill(~inside, float("-inf"))
    has = inside.any(-1, keepdim=True)
    return torch.where(has, s, 0.0).softmax(-1) * has @ u


def factors(C, P, lead=(2, 3), d=4, d_v=3, dtype=f64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*lead, C, d, generator=g, dtype=dtype),
            torch.randn(*lead, P, d, generator=g, dtype=dtype),
            torch.randn(*lead, P, d_v, generator=g, dtype=dtype))


# -- the classification ------------------------------------------------------------------

@settings(max_examples=150, deadline=None)
@given(case=cases(), chunk=st.one_of(st.none(), st.integers(1, 3)))
def test_the_tiles_equal_contains_on_the_grid(case, chunk):
    C, P, support, BQ, BK = case
    s = classify(support, C, P, BQ, BK, chunk=chunk)
    want = allowed(support, C, P)
    nq, nk = -(-C // BQ), -(-P // BK)
    assert (s.num_child_blocks, s.num_parent_blocks) == (nq, nk)
    assert s.offsets.shape == (nq + 1,) and s.offsets.dtype == torch.long
    assert s.blocks.dtype == s.mask_index.dtype == torch.long
    assert s.masks.shape == (int((s.mask_index >= 0).sum()), BQ, BK)
    assert s.masks.dtype == torch.bool
    padded = tiles_of(s)
    assert padded[:C, :P].equal(want)  # listed = non-empty, full = every pair, masks exact
    for r in range(nq):  # ascending, each listed once
        row = s.blocks[s.offsets[r]:s.offsets[r + 1]]
        assert bool((row[1:] > row[:-1]).all())
    for m, e in enumerate((s.mask_index >= 0).nonzero()[:, 0].tolist()):
        r = int(torch.searchsorted(s.offsets, e, right=True)) - 1
        rows, cols = min(BQ, C - r * BQ), min(BK, P - int(s.blocks[e]) * BK)
        tile = s.masks[m]
        assert s.mask_index[e] == m  # masks in the listed order
        assert not tile[rows:].any() and not tile[:, cols:].any()  # beyond C or P: False
        assert tile.any() and not tile[:rows, :cols].all()  # partial: some pairs, not all
    assert s.counts.equal(want.sum(-1)) and s.empty.equal(~want.any(-1))
    assert s.fraction == (s.nnz / (nq * nk) if nq * nk else 0.0)


def test_the_longformer_pattern_reads_a_band_of_tiles():
    """Band(4) | Global(2) on 40 tokens in 8 × 8 tiles: row 0 reads every key block (its
    global children), the others their band and key block 0 (the global parents)."""
    s = classify(Band(4) | Global(2), 40, 40, 8, 8)
    rows = [s.blocks[s.offsets[r]:s.offsets[r + 1]].tolist() for r in range(5)]
    assert rows == [[0, 1, 2, 3, 4], [0, 1, 2], [0, 1, 2, 3], [0, 2, 3, 4], [0, 3, 4]]
    assert s.fraction == 19 / 25 and not s.empty.any()


def test_the_classification_never_holds_the_whole_grid(monkeypatch):
    """``contains`` is called on at most ``chunk`` blocks of children (or ``PAIRS`` pairs by
    default), never on the (C, P) grid."""
    seen = []

    class Recording(sa.kinds.Support):
        def contains(self, child, parent):
            seen.append(torch.broadcast_shapes(child.shape, parent.shape))
            return (child - parent).abs() <= 3

    C, P = 100, 90
    s = classify(Recording(), C, P, 8, 8, chunk=2)
    assert max(r for r, _ in seen) == 16 and all(p == P for _, p in seen)
    assert s.blocks.numel() and len(seen) == 7  # ⌈13 blocks / 2⌉ chunks
    seen.clear()
    monkeypatch.setattr(blocks_module, "PAIRS", 24 * P)  # default chunk: 3 blocks of 8
    classify(Recording(), C, P, 8, 8)
    assert max(r * p for r, p in seen) <= 24 * P < C * P
    seen.clear()
    monkeypatch.setattr(blocks_module, "PAIRS", 1)  # at least one block
    classify(Recording(), C, P, 8, 8)
    assert max(r for r, _ in seen) == 8


@pytest.mark.parametrize("C, P", [(0, 5), (5, 0), (0, 0)])
def test_an_empty_grid(C, P):
    s = classify(Band(1), C, P, 4, 4)
    assert s.nnz == 0 and s.offsets.tolist() == [0] * (-(-C // 4) + 1)
    assert s.counts.shape == (C,) and bool(s.empty.all()) and s.fraction == 0.0


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="classify: block_q must be a positive int; got 0"):
        classify(Causal(), 4, 4, 0, 4)
    with pytest.raises(ValueError, match="classify: num_parents must be an int ≥ 0; got -1"):
        classify(Causal(), 4, -1, 2, 2)
    with pytest.raises(ValueError, match="classify: chunk must be a positive int; got 2.5"):
        classify(Causal(), 4, 4, 2, 2, chunk=2.5)
    with pytest.raises(ValueError, match="classify: support must be a structattn.kinds.Support"):
        classify(torch.ones(4, 4, dtype=torch.bool), 4, 4, 2, 2)
    with pytest.raises(ValueError, match=r"leading dims \(2,\) \(a mask per batch or head\)"):
        classify(Mask(torch.ones(2, 4, 4, dtype=torch.bool)), 4, 4, 2, 2)

    class Numbers(sa.kinds.Support):
        def contains(self, child, parent):
            return child - parent

    with pytest.raises(ValueError, match="contains.* must return a bool tensor; got torch.int64"):
        classify(Numbers(), 4, 4, 2, 2)


def test_a_mask_with_unit_leading_dims_is_one_support():
    m = torch.rand(1, 1, 9, 7) < 0.4
    s = classify(Mask(m), 9, 7, 4, 3)
    assert tiles_of(s)[:9, :7].equal(m[0, 0])


# -- attention over the listed tiles ----------------------------------------------------

@settings(max_examples=80, deadline=None)
@given(case=cases(most=70), scale=st.sampled_from([0.3, 1.0]), seed=st.integers(0, 10_000))
def test_the_kernel_equals_a_masked_softmax_with_its_gradients(case, scale, seed):
    """The kernel's output and its backward's dq, dk, dv against autograd through the masked
    softmax written out, float64, to 1e-10; children with no parent read 0."""
    C, P, support, BQ, BK = case
    a, b, u = factors(C, P, seed=seed)
    assert uses_kernel(a, b, u)
    inside = allowed(support, C, P)
    s = classify(support, C, P, BQ, BK)
    dout = torch.randn(2, 3, C, u.shape[-1], generator=torch.Generator().manual_seed(seed), dtype=f64)
    ins = [t.clone().requires_grad_() for t in (a, b, u)]
    out = block_support_attention(*ins, s, scale)
    got = torch.autograd.grad(out, ins, dout) if C and P else None
    ref = [t.clone().requires_grad_() for t in (a, b, u)]
    want_out = by_hand(*ref, inside, scale)
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-10)
    assert bool((out[..., s.empty, :] == 0).all())
    if got is not None:
        want = torch.autograd.grad(want_out, ref, dout)
        for x, y in zip(got, want, strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=1e-10)


def sparse_mask(C, P, density, seed=0):
    return Mask(torch.rand(C, P, generator=torch.Generator().manual_seed(seed)) < density)


@pytest.mark.parametrize("support", [Before(), Band(1) & Global(0), sparse_mask(23, 19, 0.03),
                                     Band(2) | sparse_mask(23, 19, 0.01), Stride(3) & Before()],
                         ids=lambda s: s.describe())
def test_children_with_no_parent_read_zero_with_zero_gradients(support):
    C, P = 23, 19
    s = classify(support, C, P, 4, 8)
    assert s.empty.any()
    a, b, u = (t.requires_grad_() for t in factors(C, P))
    out = block_support_attention(a, b, u, s, 0.5)
    assert bool((out[..., s.empty, :] == 0).all())
    torch.testing.assert_close(out, by_hand(a, b, u, allowed(support, C, P), 0.5), rtol=0,
                               atol=1e-12)
    da, db, du = torch.autograd.grad(out.square().sum(), (a, b, u))
    assert bool((da[..., s.empty, :] == 0).all())
    assert all(bool(g.isfinite().all()) for g in (da, db, du))


def test_float32_agrees_with_float64():
    support = Band(5) | Global(2) | Stride(7) & Causal()
    s = classify(support, 61, 57, 16, 8)
    a, b, u = factors(61, 57, seed=3)
    out = block_support_attention(a.float(), b.float(), u.float(), s, 0.4)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), by_hand(a, b, u, allowed(support, 61, 57), 0.4),
                               rtol=0, atol=1e-5)


@pytest.mark.parametrize("lead_a, lead_b", [((), ()), ((3,), (3,)), ((2, 3), (3,)),
                                            ((2, 1, 3), (4, 1))])
def test_any_leading_dims_broadcast(lead_a, lead_b):
    support = Band(2) | Global(1)
    a = torch.randn(*lead_a, 9, 4, dtype=f64)
    b, u = torch.randn(*lead_b, 11, 4, dtype=f64), torch.randn(*lead_b, 11, 2, dtype=f64)
    out = block_support_attention(a, b, u, classify(support, 9, 11, 4, 4), 0.7)
    want = by_hand(a, b, u, allowed(support, 9, 11), 0.7)
    assert out.shape == want.shape
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("support", [Band(1) | Global(1), Before() & Stride(2)],
                         ids=lambda s: s.describe())
def test_gradcheck(support):
    torch.manual_seed(1)
    a, b, u = (t.requires_grad_() for t in factors(7, 6, lead=(2,), d=3, d_v=2))
    s = classify(support, 7, 6, 3, 2)
    assert torch.autograd.gradcheck(lambda *t: block_support_attention(*t, s, 0.6), (a, b, u))


@settings(max_examples=40, deadline=None)
@given(case=cases(most=50), seed=st.integers(0, 10_000))
def test_the_python_loop_equals_the_kernel(case, seed):
    """With the kernels off, the Python loop over child blocks: the kernel's numbers and
    gradients to rounding."""
    C, P, support, BQ, BK = case
    s = classify(support, C, P, BQ, BK)
    a, b, u = factors(C, P, seed=seed)
    dout = torch.randn(2, 3, C, u.shape[-1], dtype=f64)
    results = []
    for off in (False, True):
        ins = [t.clone().requires_grad_() for t in (a, b, u)]
        if off:
            with kernels.disabled():
                assert not uses_kernel(*ins)
                out = block_support_attention(*ins, s, 0.8)
        else:
            out = block_support_attention(*ins, s, 0.8)
        grads = torch.autograd.grad(out, ins, dout) if C and P else ()
        results.append((out, *grads))
    for x, y in zip(*results, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-12)


def test_the_python_loop_serves_other_dtypes():
    support = Band(3) | Global(1)
    a, b, u = factors(20, 20)
    s = classify(support, 20, 20, 8, 8)
    assert not uses_kernel(a.bfloat16(), b.bfloat16(), u.bfloat16())
    out = block_support_attention(a.bfloat16(), b.bfloat16(), u.bfloat16(), s, 0.5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), by_hand(a, b, u, allowed(support, 20, 20), 0.5),
                               rtol=0, atol=0.05)
    torch.testing.assert_close(by_child_blocks(a, b, u, s, 0.5),
                               block_support_attention(a, b, u, s, 0.5), rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, f64])
@pytest.mark.parametrize("heads_view", [True, False])
def test_the_operators_pass_opcheck(dtype, heads_view):
    """The custom operators' schemas, fake kernels (for a projection's transposed heads and
    contiguous tensors) and the forward's autograd rule, as ``torch.library.opcheck`` tests
    them."""
    torch.manual_seed(2)

    def heads(t):  # (B, N, H·d) → (B, H, N, d)
        t = t.view(2, 13, 3, 4).transpose(1, 2)
        return t if heads_view else t.contiguous()
    q, k, v = (heads(torch.randn(2, 13, 12, dtype=dtype)) for _ in range(3))
    s = classify(Band(2) | Global(1) | Before() & Stride(4), 13, 13, 4, 4)
    tiles = (s.offsets, s.blocks, s.mask_index, s.masks, s.block_q, s.block_k, 0.5)
    ops = kernels.block_support()
    block_support_attention(q[:, :, :1], k[:, :, :1], v[:, :, :1],
                            classify(Causal(), 1, 1, 1, 1), 1.0)  # the rules registered
    torch.library.opcheck(ops.forward, (q.requires_grad_(), k, v, *tiles))
    out, lse = ops.forward(q, k, v, *tiles)
    dout = torch.randn_like(out)
    torch.library.opcheck(ops.backward, (dout, q.detach(), k, v, out.detach(), lse, *tiles))


def test_the_kernel_refuses_a_structure_that_does_not_fit():
    ops = kernels.block_support()
    q = torch.randn(1, 1, 5, 3, dtype=f64)
    s = classify(Causal(), 5, 5, 2, 2)
    tiles = [s.offsets, s.blocks, s.mask_index, s.masks]
    with pytest.raises(RuntimeError, match=r"offsets must have ceil\(C / block_q\) \+ 1 = 3 entries; got 4"):
        ops.forward(q, q, q, *tiles, 3, 2, 1.0)
    with pytest.raises(RuntimeError, match="must ascend within"):
        ops.forward(q, q, q, s.offsets, s.blocks.flip(0), s.mask_index, s.masks, 2, 2, 1.0)
    with pytest.raises(RuntimeError, match=r"mask_index must be in \[-1, 2\)"):
        ops.forward(q, q, q, s.offsets, s.blocks, s.mask_index + 5, s.masks, 2, 2, 1.0)
    with pytest.raises(RuntimeError, match="block_support.forward: float32 or float64"):
        z = q.bfloat16()
        ops.forward(z, z, z, *tiles, 2, 2, 1.0)


def test_bad_arguments_are_named():
    s = classify(Causal(), 5, 5, 2, 2)
    a = torch.randn(5, 3, dtype=f64)
    with pytest.raises(ValueError, match="blocks must be a SupportBlocks"):
        block_support_attention(a, a, a, "causal", 1.0)
    with pytest.raises(ValueError, match="scale must be a float; got True"):
        block_support_attention(a, a, a, s, True)
    with pytest.raises(ValueError, match="u must be floating point; got torch.int64"):
        block_support_attention(a, a, a.long(), s, 1.0)
    with pytest.raises(ValueError, match="a, b and u must share one dtype"):
        block_support_attention(a, a.float(), a, s, 1.0)
    with pytest.raises(ValueError, match=r"b must have the structure's 5 parents in dim −2; got \(6, 3\)"):
        block_support_attention(a, torch.randn(6, 3, dtype=f64), a, s, 1.0)
    with pytest.raises(ValueError, match="a must have the structure's 5 children"):
        block_support_attention(a[:4], a, a, s, 1.0)
    with pytest.raises(ValueError, match="a and b must share their last dim"):
        block_support_attention(a, a[:, :2], a, s, 1.0)
    with pytest.raises(ValueError, match="leading dims of a, b and u must broadcast"):
        block_support_attention(a.expand(2, 5, 3), a.expand(3, 5, 3), a, s, 1.0)


@pytest.mark.parametrize("module", [blocks_module, block_support_module],
                         ids=lambda m: m.__name__)
def test_the_docstring_examples_run(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0, result


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "python"])
def test_a_nan_stays_a_nan(kernel):
    """A NaN in a child's factor makes its output NaN (never a plausible 0), and no other's."""
    support = Band(2) | Global(1)
    a, b, u = factors(30, 30)
    a[0, 1, 17, 2] = float("nan")
    s = classify(support, 30, 30, 8, 8)
    if kernel:
        out = block_support_attention(a, b, u, s, 0.5)
    else:
        with kernels.disabled():
            out = block_support_attention(a, b, u, s, 0.5)
    bad = torch.zeros_like(out, dtype=torch.bool)
    bad[0, 1, 17] = True
    assert bool(out[bad].isnan().all()) and bool(out[~bad].isfinite().all())
