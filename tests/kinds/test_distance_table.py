"""A log prior that is a function of i − j alone, read from its table per tile of scores
(``kinds/distance_table.py``, ``csrc/distance_table.cpp``): the op against softmax written out
in float64 with autograd, over random sizes crossing the kernel's tiles (128 × 512 forward,
64 × 256 backward) and every band; gradcheck; and declared priors — a user's ALiBi and power
law, the catalogue's ALiBi on every parent, relative positions and the generalised Gaussian —
against Pyro's exact enumeration and against the dense reading, every parameter's gradient
included; no (…, N, N) tensor in the forward or backward at N = 1,024."""

import contextlib
import math
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import structattn as sa
from structattn.kinds import distance_table

f64 = torch.float64
pytestmark = pytest.mark.skipif(distance_table._ops() is None,
                                reason="the compiled distance-table kernel is not built")


def by_hand(q, k, v, table, shift, lo, hi, scale):
    """softmax_j(scale·⟨q_i, k_j⟩ + table[h, i − j + shift]) v_j over lo ≤ i − j ≤ hi, a zero
    row where no parent is left, written out in float64."""
    C, P = q.shape[-2], k.shape[-2]
    d = torch.arange(C)[:, None] - torch.arange(P)[None, :]
    inside = (d >= lo) & (d <= hi)
    bias = table[:, (d + shift).clamp(0, table.shape[-1] - 1)]  # (H|1, C, P)
    s = (scale * q @ k.transpose(-1, -2) + bias).masked_fill(~inside, float("-inf"))
    none = torch.isneginf(s).all(-1, keepdim=True)  # such a row: zeros, and no gradient
    return s.masked_fill(none, 0.0).softmax(-1).masked_fill(none, 0.0) @ v


def _case(g, B, H, C, P, d, dv, rows, causal, first, window, dead):
    q = torch.randn(B, H, C, d, generator=g, dtype=f64)
    k = torch.randn(B, H, P, d, generator=g, dtype=f64)
    v = torch.randn(B, H, P, dv, generator=g, dtype=f64)
    lowest = 0 if causal else 1 - P
    table = torch.randn(rows, C - lowest, generator=g, dtype=f64)
    if dead:  # −∞ excludes a distance, like a mask
        table[:, torch.randperm(table.shape[-1], generator=g)[:dead]] = float("-inf")
    lo = max(first, lowest) if causal else lowest
    hi = C - 1 if window is None else window
    return (x.requires_grad_() for x in (q, k, v, table)), -lowest, lo, hi


@settings(max_examples=25, deadline=None)
@given(C=st.integers(1, 300), extra=st.integers(0, 300), d=st.integers(1, 5),
       dv=st.integers(1, 5), heads=st.integers(1, 3), batch=st.integers(1, 2),
       causal=st.booleans(), shared=st.booleans(), first=st.integers(0, 2),
       window=st.one_of(st.none(), st.integers(0, 40)), dead=st.integers(0, 3),
       seed=st.integers(0, 10_000))
def test_op_equals_softmax_written_out_with_every_gradient(C, extra, d, dv, heads, batch, causal,
                                                         shared, first, window, dead, seed):
    g = torch.Generator().manual_seed(seed)
    P = C + extra
    (q, k, v, table), shift, lo, hi = _case(g, batch, heads, C, P, d, dv, 1 if shared else heads,
                                            causal, first, window, dead)
    out, lse = torch.ops.structattn_distance_table.forward(q, k, v, table, shift, lo, hi, 0.7)
    ref = by_hand(q, k, v, table, shift, lo, hi, 0.7)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    dout = torch.randn_like(ref)
    got = torch.autograd.grad(out, (q, k, v, table), dout)
    want = torch.autograd.grad(ref, (q, k, v, table), dout)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)
    empty = torch.isneginf(lse)  # a child with no parent: −∞ and a zero row
    assert (out[empty] == 0).all()


def test_gradcheck_through_the_op():
    g = torch.Generator().manual_seed(0)
    for causal, window in ((True, None), (False, None), (True, 3)):
        (q, k, v, table), shift, lo, hi = _case(g, 1, 2, 6, 7, 3, 2, 2, causal, 0, window, 1)
        torch.autograd.gradcheck(
            lambda q, k, v, t, band=(shift, lo, hi): torch.ops.structattn_distance_table.forward(
                q, k, v, t, *band, 0.5)[0], (q, k, v, table))


def test_transposed_heads_are_read_in_place():
    """A projection's heads, a (B, N, H, d) tensor seen as (B, H, N, d): the same numbers."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 300, 3, 4, generator=g, dtype=f64).transpose(1, 2) for _ in range(3))
    table = torch.randn(3, 300, generator=g, dtype=f64)
    out = torch.ops.structattn_distance_table.forward(q, k, v, table, 0, 0, 299, 0.5)[0]
    torch.testing.assert_close(out, by_hand(q, k, v, table, 0, 0, 299, 0.5), atol=1e-12, rtol=0)


def test_a_table_short_of_the_band_is_refused_by_name():
    q = torch.randn(1, 1, 5, 2)
    with pytest.raises(RuntimeError, match=r"distance_table.forward: the table holds the "
                                           r"distances 0 … 3 but the band reads 0 … 4"):
        torch.ops.structattn_distance_table.forward(q, q, q, torch.zeros(1, 4), 0, 0, 4, 1.0)
    with pytest.raises(RuntimeError, match="float32 or float64"):
        torch.ops.structattn_distance_table.forward(q.half(), q.half(), q.half(),
                                                    torch.zeros(1, 5), 0, 0, 4, 1.0)


# -- declared priors ------------------------------------------------------------------------

class UserALiBi(sa.priors.DistancePrior):
    """ALiBi as a user states it: log w(d) = −m_h·|d|, nothing else."""

    def __init__(self, slopes, causal=True):
        self.slopes = slopes
        super().__init__("UserALiBi prior", causal=causal)

    def log_at_distance(self, d, dtype=None):
        m = self.slopes if dtype is None else self.slopes.to(dtype)
        return -m.reshape(-1, *([1] * d.dim())) * d.abs().to(m.dtype)


class PowerLaw(sa.priors.DistancePrior):
    """log w(d) = −a_h·log(1 + |d|), a learned a per head."""

    def __init__(self, a, causal=True):
        self.a = a
        super().__init__("PowerLaw prior", causal=causal)

    def log_at_distance(self, d, dtype=None):
        a = self.a if dtype is None else self.a.to(dtype)
        return -a.reshape(-1, *([1] * d.dim())) * torch.log1p(d.abs().to(a.dtype))


class StrictPowerLaw(PowerLaw):
    """The declaring guide's power law over the strict past (``first = 1``: a window of every
    earlier token; the first token reads nothing, a zero row), −∞ below distance 1."""

    first = 1

    def __init__(self, a, causal=True):
        super().__init__(a, causal=True)

    def log_at_distance(self, d, dtype=None):
        return super().log_at_distance(d, dtype).masked_fill(d < 1, float("-inf"))


def _priors(heads, causal, g):
    """name → (prior factory, its learned parameters)."""
    a = torch.rand(heads, generator=g, dtype=f64).add(0.2).requires_grad_()
    m = torch.rand(heads, generator=g, dtype=f64).add(0.1).requires_grad_()
    logits = torch.randn(heads, 7, generator=g, dtype=f64).requires_grad_()
    mu, s, beta = (torch.rand(heads, generator=g, dtype=f64).add(0.5).requires_grad_()
                   for _ in range(3))
    return {
        "user_alibi": (lambda: UserALiBi(m, causal), [m]),
        "power_law": (lambda: PowerLaw(a, causal), [a]),
        "strict_power_law": (lambda: StrictPowerLaw(a), [a]),
        "alibi": (lambda: sa.priors.ALiBi(heads, slopes=m, causal=causal), [m]),
        "relative": (lambda: sa.priors.RelativePosition(logits, causal=causal), [logits]),
        "generalised_gaussian": (lambda: sa.priors.GeneralisedGaussian(mu, s, beta.add(1.0),
                                                                       causal=causal),
                                 [mu, s, beta]),
    }


def _program(prior_fn, W, heads):
    def program(x):
        t = sa.nodes("x", x)
        phi = sa.edges("attn", t, t, prior_fn(), heads=heads)
        sa.potential(phi, sa.potentials.Bilinear(W[0], W[1], heads=heads))
        return sa.value(phi, sa.values.Linear(W[2], heads=heads))
    return program


@contextlib.contextmanager
def _spy():
    """The calls of the kernel's reading inside the block."""
    calls = []
    real = distance_table.distance_table_attention

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)
    with mock.patch.object(distance_table, "distance_table_attention", spy):
        yield calls


NAMES = ["user_alibi", "power_law", "strict_power_law", "alibi", "relative",
         "generalised_gaussian"]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("causal", [True, False])
@settings(max_examples=3, deadline=None)
@given(n=st.integers(1, 7), heads=st.integers(1, 2), seed=st.integers(0, 10_000))
def test_declared_priors_equal_pyro_and_the_dense_reading(name, causal, n, heads, seed):
    """Outputs, posteriors and every parameter's gradient: the kernel's reading equals Pyro's
    exact enumeration and the dense reading (kernels off), float64."""
    if (name == "alibi" and causal) or (name == "strict_power_law" and not causal):
        return  # causal ALiBi separates: the key-bias kernel's (tested there)
    g = torch.Generator().manual_seed(seed)
    W = [torch.randn(heads * 2, 3, generator=g, dtype=f64).requires_grad_() for _ in range(3)]
    prior_fn, params = _priors(heads, causal, g)[name]
    program = _program(prior_fn, W, heads)
    x = torch.randn(2, n, 3, generator=g, dtype=f64)
    with _spy() as calls:
        out = sa.compile(program)(x)
    assert calls, "the distance-table kernel did not serve"
    report = sa.inference.compare(program, x, atol=1e-10)
    assert report.passed, report
    with sa.kernels.disabled():
        dense = sa.compile(program)(x)
    torch.testing.assert_close(out, dense, atol=1e-12, rtol=0)
    dout = torch.randn_like(out)
    leaves = [*W, *params]
    got = torch.autograd.grad(out, leaves, dout)
    want = torch.autograd.grad(dense, leaves, dout)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


class _Largest(TorchDispatchMode):
    """The largest tensor any op returns (numel), forward and backward; with ``square=N``,
    also the shapes of those whose last two dims are both N or more."""

    def __init__(self, square=None):
        super().__init__()
        self.largest, self.n, self.square = 0, square, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
                if self.n and t.dim() >= 2 and min(t.shape[-2:]) >= self.n:
                    self.square.append((str(func), tuple(t.shape)))
        return out


@pytest.mark.parametrize("name", NAMES)
def test_no_n_by_n_tensor_forward_or_backward(name):
    """At N = 1,024 (4 heads, d = 8) no op of the read, recorded or replayed call, forward or
    backward, returns a tensor of N² entries or more: the table is looked up per tile."""
    g = torch.Generator().manual_seed(0)
    heads, N = 4, 1024
    W = [torch.randn(heads * 8, 16, generator=g).requires_grad_() for _ in range(3)]
    prior_fn, params = _priors(heads, False, g)[name]
    params = [p.detach().float().requires_grad_() for p in params]
    factory = {"user_alibi": lambda: UserALiBi(params[0], False),
               "power_law": lambda: PowerLaw(params[0], False),
               "strict_power_law": lambda: StrictPowerLaw(params[0]),
               "alibi": lambda: sa.priors.ALiBi(heads, slopes=params[0], causal=False),
               "relative": lambda: sa.priors.RelativePosition(params[0], causal=False),
               "generalised_gaussian": lambda: sa.priors.GeneralisedGaussian(
                   *params[:2], params[2].detach() + 1.0, causal=False)}[name]
    layer = sa.compile(_program(factory, W, heads))
    x = torch.randn(1, N, 16)
    for _ in range(3):  # read, recorded, replayed
        with _Largest() as seen:
            layer(x).sum().backward()
        assert seen.largest < N * N, f"{name}: an op returned {seen.largest} entries (N² = {N * N})"


def test_validation_reads_the_table_over_the_offsets():
    """NaN in the table is refused naming the offset; a child left without parents by −∞ is
    refused naming the child — both from the (heads, C + P − 1) table, never the C×P one."""
    class Bad(UserALiBi):
        def log_at_distance(self, d, dtype=None):
            return super().log_at_distance(d, dtype).masked_fill(d == 2, float("nan"))

    class Empty(UserALiBi):
        def log_at_distance(self, d, dtype=None):
            return super().log_at_distance(d, dtype).masked_fill(d == 0, float("-inf"))

    W = [torch.randn(2, 3, dtype=f64) for _ in range(3)]
    m = torch.ones(1, dtype=f64)
    x = torch.randn(1, 5, 3, dtype=f64)
    with pytest.raises(ValueError, match=r"prior log weights contain non-finite values .* at "
                                         r"offset index"):
        sa.compile(_program(lambda: Bad(m), W, 1))(x)
    with pytest.raises(ValueError, match=r"edge family 'attn': child 0 \(index \(0,\)\) has an "
                                         r"empty support .* 1 of 5 children"):
        sa.compile(_program(lambda: Empty(m), W, 1))(x)
    sa.compile(_program(lambda: Empty(m, causal=False), W, 1))(x)  # every parent: none empty


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lower_precisions(dtype):
    """float32 through the kernel, bfloat16 through the dense table: both near float64's."""
    g = torch.Generator().manual_seed(3)
    W = [torch.randn(4, 6, generator=g, dtype=f64) for _ in range(3)]
    m = torch.rand(2, generator=g, dtype=f64)
    x = torch.randn(2, 40, 6, generator=g, dtype=f64)
    want = sa.compile(_program(lambda: PowerLaw(m, False), W, 2))(x)
    Wl, ml = [w.to(dtype) for w in W], m.to(dtype)
    got = sa.compile(_program(lambda: PowerLaw(ml, False), Wl, 2))(x.to(dtype))
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got.double(), want, atol=tol * math.sqrt(40), rtol=0)
