"""Graph attention over an edge list: fast (custom Function) == naive twin == dense masked softmax."""

import pytest
import torch

import structattn as sa
import structattn.operators.segment
import structattn.priors.tables
from structattn.operators.segment import segment_attention, segment_attention_naive

F64 = torch.float64


def random_graph(C, P, density=0.4, *, min_parents=1):
    """Duplicate-free edges in shuffled order; every child has ≥ min_parents parents."""
    mask = torch.rand(C, P) < density
    if min_parents:
        mask[torch.arange(C), torch.randint(P, (C,))] = True
    dst, src = mask.nonzero().unbind(1)
    perm = torch.randperm(src.numel())
    return src[perm].contiguous(), dst[perm].contiguous()


def dense_reference(a, b, v, src, dst, scale=1.0):
    """Masked dense softmax(scale·a bᵀ) @ v; rows with no parent give zero. Also the dense posterior."""
    C, P = a.shape[-2], b.shape[-2]
    mask = torch.zeros(C, P, dtype=torch.bool)
    mask[dst, src] = True
    s = scale * (a @ b.transpose(-1, -2))
    s = s.masked_fill(~mask, float("-inf"))
    post = torch.softmax(s, dim=-1)
    post = torch.where(mask.any(-1, keepdim=True), post, torch.zeros_like(post))
    return post @ v, post


def rand_inputs(lead, C, P, k, d_v, dtype=F64, requires_grad=False):
    a = torch.randn(*lead, C, k, dtype=dtype, requires_grad=requires_grad)
    b = torch.randn(*lead, P, k, dtype=dtype, requires_grad=requires_grad)
    v = torch.randn(*lead, P, d_v, dtype=dtype, requires_grad=requires_grad)
    return a, b, v


@pytest.mark.parametrize("lead,C,P,k,d_v", [
    ((2,), 5, 7, 3, 2),
    ((3,), 11, 5, 7, 3),
    ((2, 3), 7, 11, 2, 5),
    ((), 13, 3, 5, 7),
    ((5,), 2, 2, 11, 2),
])
@pytest.mark.parametrize("chunk_size", [3, None])
def test_fast_naive_dense_agree(lead, C, P, k, d_v, chunk_size):
    src, dst = random_graph(C, P)
    a, b, v = rand_inputs(lead, C, P, k, d_v)
    scale = 0.37
    want, post = dense_reference(a, b, v, src, dst, scale)
    out, p = segment_attention(a, b, v, src, dst, C, scale, chunk_size=chunk_size, return_posterior=True)
    out_n, p_n = segment_attention_naive(a, b, v, src, dst, C, scale, return_posterior=True)
    assert out.shape == (*lead, C, d_v) and p.shape == (*lead, src.numel())
    torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(out_n, want, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(p, post[..., dst, src], atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(p_n, post[..., dst, src], atol=1e-10, rtol=1e-10)
    assert not isinstance(segment_attention(a, b, v, src, dst, C, scale), tuple)


@pytest.mark.parametrize("chunk_size", [2, 5, 1000])
def test_gradients_match_naive(chunk_size):
    C, P = 11, 7
    src, dst = random_graph(C, P)
    a, b, v = rand_inputs((2, 3), C, P, 5, 3, requires_grad=True)
    gout = torch.randn(2, 3, C, 3, dtype=F64)
    gp = torch.randn(2, 3, src.numel(), dtype=F64)
    grads = []
    for fn in (segment_attention, segment_attention_naive):
        out, p = fn(a, b, v, src, dst, C, 0.5, chunk_size=chunk_size, return_posterior=True)
        grads.append(torch.autograd.grad((out * gout).sum() + (p * gp).sum(), (a, b, v)))
    for g_fast, g_naive in zip(*grads, strict=True):
        torch.testing.assert_close(g_fast, g_naive, atol=1e-10, rtol=1e-10)


def test_gradcheck():
    C, P = 5, 3
    src, dst = random_graph(C, P, 0.5)
    a, b, v = rand_inputs((2,), C, P, 3, 2, requires_grad=True)

    def f(a, b, v):
        return segment_attention(a, b, v, src, dst, C, 0.8, chunk_size=3)

    def f_post(a, b, v):
        return segment_attention(a, b, v, src, dst, C, 0.8, chunk_size=2, return_posterior=True)

    assert torch.autograd.gradcheck(f, (a, b, v))
    assert torch.autograd.gradcheck(f_post, (a, b, v))


def test_gradcheck_tensor_scale():
    C, P = 3, 5
    src, dst = random_graph(C, P, 0.5)
    a, b, v = rand_inputs((2,), C, P, 2, 3, requires_grad=True)
    scale = torch.tensor(0.6, dtype=F64, requires_grad=True)

    def f(a, b, v, scale):
        return segment_attention(a, b, v, src, dst, C, scale, chunk_size=3)

    assert torch.autograd.gradcheck(f, (a, b, v, scale))
    out = f(a, b, v, scale)
    out.sum().backward()
    assert scale.grad is not None and scale.grad != 0
    want, _ = dense_reference(a.detach(), b.detach(), v.detach(), src, dst, 0.6)
    torch.testing.assert_close(out.detach(), want, atol=1e-10, rtol=1e-10)


def test_only_selected_inputs_get_gradients():
    C, P = 5, 7
    src, dst = random_graph(C, P)
    a, b, v = rand_inputs((2,), C, P, 3, 2)
    v.requires_grad_(True)
    segment_attention(a, b, v, src, dst, C, chunk_size=4).sum().backward()
    assert a.grad is None and b.grad is None and v.grad is not None


def _graph_with_empty_children(C, P, empty_children):
    src, dst = random_graph(C, P, 0.5)
    keep = ~torch.isin(dst, torch.tensor(empty_children))
    return src[keep], dst[keep]


def test_empty_error_names_the_child():
    C, P = 7, 5
    src, dst = _graph_with_empty_children(C, P, [2, 5])
    a, b, v = rand_inputs((2,), C, P, 3, 2)
    for fn in (segment_attention, segment_attention_naive):
        with pytest.raises(ValueError, match=r"child 2 has no incoming edge \(2 of 7 children"):
            fn(a, b, v, src, dst, C)


@pytest.mark.parametrize("chunk_size", [3, 65536])
def test_empty_zero(chunk_size):
    C, P = 7, 5
    src, dst = _graph_with_empty_children(C, P, [0, 4])
    a, b, v = rand_inputs((2,), C, P, 3, 2, requires_grad=True)
    out, p = segment_attention(a, b, v, src, dst, C, 0.9, chunk_size=chunk_size, empty="zero",
                               return_posterior=True)
    assert torch.isfinite(out).all() and torch.isfinite(p).all()
    assert (out[:, [0, 4]] == 0).all()
    want, post = dense_reference(a.detach(), b.detach(), v.detach(), src, dst, 0.9)
    torch.testing.assert_close(out.detach(), want, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(p.detach(), post[..., dst, src], atol=1e-10, rtol=1e-10)
    gp = torch.randn_like(p)
    (out.sum() + (p * gp).sum()).backward()
    grads_fast = [t.grad for t in (a, b, v)]
    for g in grads_fast:
        assert torch.isfinite(g).all()
    assert (grads_fast[0][:, [0, 4]] == 0).all()  # childless children get no gradient
    for t in (a, b, v):
        t.grad = None
    out_n, p_n = segment_attention_naive(a, b, v, src, dst, C, 0.9, empty="zero", return_posterior=True)
    torch.testing.assert_close(out_n.detach(), want, atol=1e-10, rtol=1e-10)
    (out_n.sum() + (p_n * gp).sum()).backward()
    for g_fast, t in zip(grads_fast, (a, b, v), strict=True):
        torch.testing.assert_close(g_fast, t.grad, atol=1e-10, rtol=1e-10)


def test_validation_off_skips_the_empty_check():
    C, P = 7, 5
    src, dst = _graph_with_empty_children(C, P, [3])
    a, b, v = rand_inputs((2,), C, P, 3, 2)
    with sa.validation(False):
        out = segment_attention(a, b, v, src, dst, C)
    assert (out[:, 3] == 0).all()
    torch.testing.assert_close(out, dense_reference(a, b, v, src, dst)[0], atol=1e-10, rtol=1e-10)


def test_non_contiguous_inputs():
    C, P, k, d_v = 7, 5, 3, 2
    src, dst = random_graph(C, P)
    a = torch.randn(C, 2, k, dtype=F64).transpose(0, 1)
    b = torch.randn(k, 2, P, dtype=F64).permute(1, 2, 0)
    v = torch.randn(2, P, 2 * d_v, dtype=F64)[..., ::2]
    out, p = segment_attention(a, b, v, src, dst, C, chunk_size=4, return_posterior=True)
    want, post = dense_reference(a, b, v, src, dst)
    torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(p, post[..., dst, src], atol=1e-10, rtol=1e-10)


def test_no_edges_at_all_zero_mode():
    C, P = 3, 4
    a, b, v = rand_inputs((2,), C, P, 3, 2, requires_grad=True)
    e = torch.zeros(0, dtype=torch.long)
    out = segment_attention(a, b, v, e, e, C, empty="zero")
    assert out.shape == (2, C, 2) and (out == 0).all()
    out.sum().backward()
    assert (a.grad == 0).all() and (v.grad == 0).all()


def _ok():
    C, P = 5, 7
    src, dst = random_graph(C, P)
    a, b, v = rand_inputs((2,), C, P, 3, 2)
    return dict(a=a, b=b, v=v, src=src, dst=dst, num_children=C)


@pytest.mark.parametrize("fn", [segment_attention, segment_attention_naive])
@pytest.mark.parametrize("change,pattern", [
    (lambda kw: dict(kw, src=kw["src"].float()), r"src must have dtype torch.int64.*torch.float32"),
    (lambda kw: dict(kw, dst=kw["dst"].int()), r"dst must have dtype torch.int64.*torch.int32"),
    (lambda kw: dict(kw, dst=kw["dst"][:-1]), r"src and dst must have equal length.*src \(\d+,\).*dst"),
    (lambda kw: dict(kw, src=kw["src"][None]), r"src must be 1-D.*\(1, \d+\)"),
    (lambda kw: dict(kw, src=torch.where(kw["src"] == 0, 7, kw["src"])),
     r"src must hold indices in \[0, 7\).*value 7"),
    (lambda kw: dict(kw, dst=torch.where(kw["dst"] == 0, -1, kw["dst"])),
     r"dst must hold indices in \[0, 5\).*value -1"),
    (lambda kw: dict(kw, b=torch.randn(3, 7, 3, dtype=F64)), r"leading dims.*b \(3, 7, 3\) \(lead \(3,\)\)"),
    (lambda kw: dict(kw, v=torch.randn(2, 6, 2, dtype=F64)), r"v must have shape.*P=7.*\(2, 6, 2\)"),
    (lambda kw: dict(kw, b=torch.randn(2, 7, 4, dtype=F64)), r"a and b must share their last.*\(2, 7, 4\)"),
    (lambda kw: dict(kw, v=kw["v"].float()), r"a, b and v must share a dtype.*v torch.float32"),
    (lambda kw: dict(kw, a=torch.ones(2, 5, 3, dtype=torch.long)), r"a must be floating point.*torch.int64"),
    (lambda kw: dict(kw, num_children=6), r"a must have shape \(\*lead, num_children=6, k\).*\(2, 5, 3\)"),
    (lambda kw: dict(kw, a=torch.randn(5, dtype=F64)), r"a must have shape \(\*lead, C, k\).*\(5,\)"),
    (lambda kw: dict(kw, scale=torch.ones(2, dtype=F64)), r"scale must be a float or a 0-dim.*\(2,\)"),
    (lambda kw: dict(kw, empty="skip"), r"empty must be one of.*'skip'"),
    (lambda kw: dict(kw, chunk_size=0), r"chunk_size must be a positive int.*0"),
])
def test_bad_input(fn, change, pattern):
    with pytest.raises(ValueError, match=pattern):
        fn(**change(_ok()))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_low_precision_close_to_float64(dtype, tol):
    C, P, k, d_v = 13, 11, 8, 5
    src, dst = random_graph(C, P)
    a, b, v = rand_inputs((3,), C, P, k, d_v)
    a, b, v = (t.to(dtype).to(F64) for t in (a, b, v))  # same values in both precisions
    want, _ = dense_reference(a, b, v, src, dst, k ** -0.5)
    g = torch.randn(3, C, d_v, dtype=F64)
    lo = [t.to(dtype).requires_grad_(True) for t in (a, b, v)]
    hi = [t.clone().requires_grad_(True) for t in (a, b, v)]
    out = segment_attention(*lo, src, dst, C, k ** -0.5, chunk_size=7)
    assert out.dtype == dtype
    (out.to(F64) * g).sum().backward()
    (segment_attention(*hi, src, dst, C, k ** -0.5) * g).sum().backward()
    scale_out = want.abs().max()
    assert (out.to(F64) - want).abs().max() <= tol * scale_out
    for t_lo, t_hi in zip(lo, hi, strict=True):
        assert t_lo.grad.dtype == dtype
        assert (t_lo.grad.to(F64) - t_hi.grad).abs().max() <= tol * t_hi.grad.abs().max()
    out_n = segment_attention_naive(*(t.detach() for t in lo), src, dst, C, k ** -0.5)
    assert out_n.dtype == dtype
    assert (out_n.to(F64) - want).abs().max() <= tol * scale_out


def _saved_numel(fn, *args, **kwargs):
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args, **kwargs)
    return out, total


@pytest.mark.parametrize("scale", [0.125, "tensor"])
def test_saved_tensors_are_linear_in_edges(scale):
    G, C, P, k, d_v = 2, 300, 300, 64, 8
    src, dst = random_graph(C, P, 0.9)
    E = src.numel()
    a, b, v = rand_inputs((G,), C, P, k, d_v, dtype=torch.float32, requires_grad=True)
    if scale == "tensor":
        scale = torch.tensor(0.125, requires_grad=True)
    bound = 4 * E * G + 4 * (C + P) * (k + d_v) * G + 1000
    assert E * k * G > 4 * bound  # the bound is far below anything O(E·k)
    out, fast = _saved_numel(segment_attention, a, b, v, src, dst, C, scale, chunk_size=1024)
    out.sum().backward()
    assert fast < bound, (fast, bound)
    _, naive = _saved_numel(segment_attention_naive, a, b, v, src, dst, C, scale)
    assert naive > bound, (naive, bound)


def _x(*shape, generator=None):
    return torch.randn(*shape, dtype=F64, generator=generator)


@pytest.mark.parametrize("fn", [segment_attention, segment_attention_naive])
@pytest.mark.parametrize("bias_shape", ["E", "HE", "BHE"])
def test_segment_bias_values_and_gradients(fn, bias_shape):
    g = torch.Generator().manual_seed(8)
    B, H, C, P, k, d_v = 2, 3, 5, 7, 3, 2
    mask = (torch.rand(C, P, generator=g) < 0.5)
    mask[torch.arange(C), torch.arange(C)] = True
    dst, src = mask.nonzero().T
    E = src.numel()
    a, b, v = _x(B, H, C, k, generator=g), _x(B, H, P, k, generator=g), _x(B, H, P, d_v, generator=g)
    bias = _x(*{"E": (E,), "HE": (H, E), "BHE": (B, H, E)}[bias_shape], generator=g)
    bias = bias.masked_fill(torch.rand(bias.shape, generator=g) < 0.2, float("-inf"))
    bias[..., (src == dst).nonzero()[:3, 0]] = float("-inf")  # some children lose every edge
    inputs = [t.clone().requires_grad_() for t in (a, b, v, bias)]
    out, p = fn(*inputs[:3], src, dst, C, 0.7, bias=inputs[3], empty="zero", return_posterior=True,
                chunk_size=3)
    (out.square().sum() + (p * torch.arange(E)).sum()).backward()
    # the dense reference
    refs = [t.clone().requires_grad_() for t in (a, b, v, bias)]
    s = 0.7 * refs[0] @ refs[1].transpose(-1, -2)
    full = torch.full((B, H, C, P), float("-inf"), dtype=F64)
    full[..., dst, src] = refs[3].expand(B, H, E) + s[..., dst, src]
    rows = ~full.isneginf().all(-1, keepdim=True)
    post = torch.where(rows, full.masked_fill(~rows, 0).softmax(-1), torch.zeros_like(full))
    want = post @ refs[2]
    (want.square().sum() + (post[..., dst, src] * torch.arange(E)).sum()).backward()
    torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(p, post[..., dst, src], atol=1e-10, rtol=1e-10)
    for got, ref in zip(inputs, refs, strict=True):
        torch.testing.assert_close(got.grad, ref.grad, atol=1e-10, rtol=1e-10)


def test_segment_bias_checks():
    src, dst = torch.tensor([0, 1, 1]), torch.tensor([0, 0, 1])
    a, b, v = _x(2, 3), _x(2, 3), _x(2, 2)
    with pytest.raises(ValueError, match=r"bias must broadcast to \(\*lead, E\)=\(3,\); got \(4,\)"):
        segment_attention(a, b, v, src, dst, 2, bias=_x(4))
    with pytest.raises(ValueError, match=r"bias must be a tensor of a's dtype"):
        segment_attention(a, b, v, src, dst, 2, bias=torch.zeros(3))
    with pytest.raises(ValueError, match=r"bias must hold finite values or -inf"):
        segment_attention(a, b, v, src, dst, 2, bias=torch.tensor([0.0, float("nan"), 0.0], dtype=F64))
    with pytest.raises(ValueError, match=r"child 1 has no incoming edge of finite bias"):
        segment_attention(a, b, v, src, dst, 2, bias=torch.tensor([0.0, 0.0, -float("inf")], dtype=F64))
