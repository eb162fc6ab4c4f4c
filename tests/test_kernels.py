"""The compiled mean-field kernel (structattn/csrc/mean_field_windows.cpp) against the Python
loop it replaces on the CPU, and its fallback.

The loop itself is checked against a float64 brute force of the equations in
tests/windows/test_windows.py (which also runs the kernel against that brute force); here the two
implementations are compared over random sizes, options and every field of the trace.
"""

import warnings

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

import structattn as sa
from structattn import kernels

from .programs import history, program
from .reference import band_per_child

f64 = torch.float64


@pytest.fixture(scope="module", autouse=True)
def kernel_built():
    """The set-up script builds the kernel: a machine without it fails here, loudly, rather
    than skipping (``STRUCTATTN_KERNELS=0`` says on purpose that there is none)."""
    if not kernels.available():
        pytest.fail(f"the mean-field kernel is not available: {kernels.build_error()}")


def both(x, W, prior, heads, scheme):
    """(output, posterior, history) by the kernel and by the loop, without a graph."""
    layer = sa.compile(program)
    with torch.no_grad():
        y1, p1, t1 = layer(x, W, prior, heads, scheme, return_posterior=True, return_trace=True)
        with kernels.disabled():
            y0, p0, t0 = layer(x, W, prior, heads, scheme, return_posterior=True,
                               return_trace=True)
    return (y1, p1, history(t1)), (y0, p0, history(t0))


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 45), heads=st.integers(1, 2), batch=st.integers(1, 2),
       rule=st.sampled_from(["predictive", "edge", "evidence"]),
       expectation=st.sampled_from(["digamma", "plug_in"]),
       update=st.sampled_from(["conjugate", "accumulate"]),
       max_window=st.one_of(st.none(), st.integers(1, 20)),
       max_iters=st.sampled_from([1, 3, 50]), initial=st.one_of(st.none(), st.integers(1, 6)),
       tol=st.sampled_from([1e-4, 0.05, 0.3]), gain=st.floats(0.2, 3.0), seed=st.integers(0, 99))
def test_kernel_equals_the_loop(n, heads, batch, rule, expectation, update, max_window,
                                max_iters, initial, tol, gain, seed):
    g = torch.Generator().manual_seed(seed)
    d = 2 * heads
    x = torch.randn(batch, n, d, generator=g, dtype=f64)
    W = torch.randn(d, d, generator=g, dtype=f64) * gain
    a = torch.rand(heads, generator=g, dtype=f64) * 3 + 0.2
    b = torch.rand(heads, generator=g, dtype=f64) * 3 + 0.2
    prior = sa.priors.BetaGeometric(a, b, block_size=8)
    scheme = sa.MeanFieldWindows(tol=tol, window_rule=rule, expectation=expectation,
                                 update=update, max_window=max_window, max_iters=max_iters,
                                 initial_window=initial)
    (y1, p1, t1), (y0, p0, t0) = both(x, W, prior, heads, scheme)
    torch.testing.assert_close(y1, y0, atol=1e-12, rtol=0)
    torch.testing.assert_close(p1, p0, atol=1e-12, rtol=0)
    assert t1.iterations == t0.iterations and t1.converged == t0.converged
    assert torch.equal(t1.windows, t0.windows)
    assert torch.equal(t1.child_iterations, t0.child_iterations)
    # the kernel sums in another order than the loop: over tens of rounds the rounding
    # differences grow with the values (α ~ E[φ] ~ tens: 1.4e-11 seen at n = 44, 31 rounds)
    for name in ("alpha", "beta", "expected_distance", "discarded"):
        torch.testing.assert_close(getattr(t1, name), getattr(t0, name), atol=1e-11, rtol=1e-11)
    # the kernel's band is the widest window scored each round; the loop's band covers it
    assert len(t1.band) == len(t0.band)
    assert all(k <= w for k, w in zip(t1.band, t0.band, strict=True))


def test_without_a_trace_the_output_is_the_same():
    """Nobody asks for the trace: the kernel keeps no history, and the output is unchanged."""
    torch.manual_seed(1)
    m = sa.models.expanding_attention(8, heads=2, a=2.0, b=1.0, dtype=f64,
                                      inference=sa.MeanFieldWindows(window_rule="evidence",
                                                                    initial_window=4))
    layer, x = sa.compile(m), torch.randn(3, 40, 8, dtype=f64)
    with torch.no_grad():
        y_traced, trace = layer(x, return_trace=True)
        y = layer(x)
        with kernels.disabled():
            y_loop = layer(x)
    torch.testing.assert_close(y, y_traced, atol=0, rtol=0)
    torch.testing.assert_close(y, y_loop, atol=1e-12, rtol=0)
    assert history(trace).windows.shape[0] == history(trace).iterations > 1


@pytest.mark.parametrize("rule", ["predictive", "evidence", "certified"])
def test_grad_last_gradients_equal_the_loop(rule):
    """grad="last" with grad enabled: the kernel finds the fixed point, its band per child
    takes the one differentiable step; gradients in x, W_q, W_k, W_v, a and b match the
    loop's."""
    torch.manual_seed(2)
    m = sa.models.expanding_attention(8, heads=2, a=torch.tensor([1.5, 3.0]), b=1.0, dtype=f64,
                                      inference=sa.MeanFieldWindows(grad="last", window_rule=rule,
                                                                    initial_window=3))
    layer = sa.compile(m)
    x = torch.randn(2, 35, 8, dtype=f64, requires_grad=True)
    grads = []
    for off in (False, True):
        m.zero_grad()
        x.grad = None
        ctx = kernels.disabled() if off else torch.enable_grad()
        with ctx:
            (layer(x) ** 2).sum().backward()
        grads.append([x.grad.clone()] + [p.grad.clone() for p in m.parameters()])
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    assert bool((m.raw_prior.grad != 0).all())


def test_float32_and_bfloat16_agree_with_the_loop():
    torch.manual_seed(3)
    m = sa.models.expanding_attention(16, heads=2, a=2.0, b=1.0)
    x = torch.randn(2, 60, 16)
    layer = sa.compile(m)
    for dtype in (torch.float32, torch.bfloat16):
        layer_d = sa.compile(sa.models.expanding_attention(16, heads=2, a=2.0, b=1.0).to(dtype))
        layer_d.declaration.load_state_dict({k: v.to(dtype) for k, v in m.state_dict().items()})
        with torch.no_grad():
            y = layer_d(x.to(dtype))
            with kernels.disabled():
                y_loop = layer_d(x.to(dtype))
        assert y.dtype == dtype
        # a child settles when E[φ] moves by ≤ 1e-3 relative: summation orders differ, so
        # the two agree to the iteration's tolerance, not to rounding
        tol = 2e-3 if dtype == torch.float32 else 5e-2
        torch.testing.assert_close(y.float(), y_loop.float(), atol=tol, rtol=tol)
    with torch.no_grad():
        y32 = layer(x)
    assert bool(torch.isfinite(y32).all())


def test_a_failed_build_warns_once_and_falls_back_to_the_loop(monkeypatch):
    saved = dict(kernels._states["mean_field"])

    def broken(kernel="mean_field"):
        raise RuntimeError("Ninja is required to load C++ extensions")
    monkeypatch.setattr(kernels, "_build", broken)
    kernels._states["mean_field"].update(ops=None, error=None, tried=False)
    try:
        torch.manual_seed(4)
        m = sa.models.expanding_attention(4, dtype=f64)
        x = torch.randn(1, 20, 4, dtype=f64)
        with pytest.warns(RuntimeWarning, match="could not be built.*Ninja is required"):
            with torch.no_grad():
                y = sa.compile(m)(x)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once: no second warning
            with torch.no_grad():
                y2 = sa.compile(m)(x)
        assert not kernels.available() and "Ninja" in kernels.build_error()
        torch.testing.assert_close(y, y2, atol=0, rtol=0)
    finally:
        kernels._states["mean_field"].clear()
        kernels._states["mean_field"].update(saved)
    with torch.no_grad(), kernels.disabled():
        torch.testing.assert_close(sa.compile(m)(x), y, atol=0, rtol=0)


def test_environment_switch_turns_the_kernel_off(monkeypatch):
    monkeypatch.setenv("STRUCTATTN_KERNELS", "0")
    assert kernels.mean_field_windows() is None
    monkeypatch.delenv("STRUCTATTN_KERNELS")
    assert kernels.mean_field_windows() is not None


def test_torch_compile_runs_the_kernel_path():
    """Without a graph the compiled module reaches the C++ call: torch.compile runs it
    eagerly (a graph break), and the result is the eager one."""
    torch.manual_seed(5)
    m = sa.models.expanding_attention(8, heads=2, a=1.5, b=1.0, dtype=f64)
    layer, x = sa.compile(m), torch.randn(2, 40, 8, dtype=f64)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning)  # dynamo's graph-break notes
        torch.testing.assert_close(torch.compile(layer)(x), layer(x), atol=1e-12, rtol=0)


def test_threads_do_not_change_the_result():
    torch.manual_seed(6)
    m = sa.models.expanding_attention(8, heads=2, a=1.5, b=1.0, dtype=f64,
                                      inference=sa.MeanFieldWindows(window_rule="evidence",
                                                                    initial_window=2))
    layer, x = sa.compile(m), torch.randn(3, 300, 8, dtype=f64)
    threads = torch.get_num_threads()
    try:
        outs = []
        for t in (1, 2):
            torch.set_num_threads(t)
            with torch.no_grad():
                outs.append(layer(x, return_trace=True))
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=0, rtol=0)
    assert torch.equal(history(outs[0][1]).windows, history(outs[1][1]).windows)


def test_evaluation_with_grad_enabled_but_nothing_to_differentiate_uses_the_kernel(
        monkeypatch):
    """grad="unroll" needs the loop only when something carries a gradient."""
    torch.manual_seed(7)
    m = sa.models.expanding_attention(8, dtype=f64).requires_grad_(False)
    x = torch.randn(1, 30, 8, dtype=f64)
    calls = []
    monkeypatch.setattr(sa.windows.loop, "mean_field",
                        lambda *a, **k: calls.append(1) or pytest.fail("loop used"))
    y = sa.compile(m)(x)
    assert not calls and not y.requires_grad


@pytest.mark.parametrize("dtype", [torch.float32, f64])
def test_the_kernel_computes_the_score_ceiling_as_certified_does(dtype):
    """``solve`` without ``high``/``slack`` computes the ceiling itself, in double: the
    rounding slack as ``ceilings.score_ceiling``'s and, for the parents beyond each window,
    the longest key farther back than it (a running max; ``tests/windows/test_windows.py``
    checks its values against a brute force). It is never looser than the call given Python's
    ceiling of the longest key of all: no window longer, and where the windows and steps
    agree, no bound larger — and tighter somewhere."""
    from structattn.certificates.ceilings import score_ceiling

    g = torch.Generator().manual_seed(11)
    G, N, P, k = 3, 7, 19, 5
    a, b = torch.randn(G, N, k, generator=g, dtype=dtype), torch.randn(G, P, k, generator=g,
                                                                       dtype=dtype) * 3
    b[:, P - 3] *= 5  # a long key among the children: no farther parent scores that high
    a0, b0 = torch.full((G,), 2.0, dtype=dtype), torch.full((G,), 1.5, dtype=dtype)
    win0, caps = torch.full((G, N), 2, dtype=torch.long), torch.arange(P).clamp(max=P)
    args = (a, b, P - N, 0.7, a0, b0, win0, caps, 0.3, 1e-3, 2, P, True, True, 3, False)
    high, slack = score_ceiling(a, b, 0.7)
    ops = kernels.mean_field_windows()
    given_, computed = ops.solve(*args, high.to(dtype), slack.to(dtype)), ops.solve(*args)
    assert bool((computed[0] <= given_[0]).all())  # windows
    same = (computed[0] == given_[0]) & (computed[4] == given_[4])  # windows and steps
    assert bool(same.any())
    for x, y in zip(given_[1:4], computed[1:4], strict=True):  # α, β, E[φ] where they agree
        assert torch.equal(x[same], y[same])
    assert bool((given_[6] > 0).any())  # a bound that the ceiling decided
    assert bool((computed[6][same] <= given_[6][same] * (1 + 1e-13)).all())
    assert bool((computed[6] < given_[6]).any())
    with pytest.raises(RuntimeError, match="high and slack together"):
        ops.solve(*args, high.to(dtype), None)


@pytest.mark.parametrize("dtype", [torch.float32, f64])
def test_infer_refuses_non_finite_keys_when_asked(dtype):
    """``infer(..., check=True)``: a NaN or ±inf anywhere in the keys b (also outside every
    window) is refused; finite keys give the output of ``check=False`` bit for bit, which is
    ``solve`` then ``attend``; unchecked, a NaN key is not refused."""
    g = torch.Generator().manual_seed(12)
    G, N, P, k, dv = 2, 3, 40, 4, 5
    a, b = (torch.randn(G, n, k, generator=g, dtype=dtype) for n in (N, P))
    u = torch.randn(G, P, dv, generator=g, dtype=dtype)
    a0, b0 = torch.full((G,), 2.0, dtype=dtype), torch.full((G,), 1.5, dtype=dtype)
    win0, caps = torch.full((G, N), 2, dtype=torch.long), torch.arange(P)
    rest = (P - N, 0.7, a0, b0, win0, caps, 0.05, 1e-3, 50, P, True, True, 3)
    ops = kernels.mean_field_windows()
    out = ops.infer(a, b, u, *rest, True)
    assert torch.equal(out, ops.infer(a, b, u, *rest, False))
    s = ops.solve(a, b, *rest, False)
    assert torch.equal(out, ops.attend(a, b, u, P - N, 0.7, s[0], s[1], s[2], True))
    for where in [(0, 0, 0), (1, P - 1, k - 1), (1, 5, 2)]:
        for value in (float("nan"), float("inf"), -float("inf")):
            bad = b.clone()
            bad[where] = value
            with pytest.raises(RuntimeError, match="the keys b hold NaN or inf"):
                ops.infer(a, bad, u, *rest, True)
            ops.infer(a, bad, u, *rest, False)  # not refused


def test_a_no_grad_plan_holds_one_kernel_call():
    """Without gradients the reading is one ``infer`` call (solve, E[ln q], attend): the
    recorded plan holds it and none of the score ceiling's or the Beta bookkeeping's small
    operations; its output equals solve-then-attend (the traced call) bit for bit."""
    torch.manual_seed(8)
    m = sa.models.expanding_attention(16, heads=2, a=2.0, b=1.0)
    layer, x = sa.compile(m), torch.randn(2, 50, 16)
    with torch.no_grad():
        for _ in range(3):
            y = layer(x, last=1)
        (plan,) = layer.plans.values()
        targets = [str(n.target) for n in plan.graph.graph.nodes if n.op == "call_function"]
        assert sum("structattn_mean_field.infer" in t for t in targets) == 1
        assert not any(w in t for t in targets for w in ("digamma", "norm", "amax", ".solve"))
        y_traced, trace = layer(x, last=1, return_trace=True)
        # the posterior read after infer (its window, α, β) is the traced call's
        y_post, post = layer(x, return_posterior=True)
        y_both, post_both, _ = layer(x, return_posterior=True, return_trace=True)
    assert torch.equal(y, y_traced)
    assert torch.equal(y_post, y_both) and torch.equal(post, post_both)


@settings(max_examples=25, deadline=None)
@given(G=st.integers(1, 3), N=st.integers(1, 300), front=st.integers(0, 40),
       k=st.integers(1, 9), dv=st.integers(1, 9), widest=st.integers(0, 400),
       dtype=st.sampled_from([f64, torch.float32]), seed=st.integers(0, 10_000))
def test_band_per_child_equals_softmax_written_out(G, N, front, k, dv, widest, dtype, seed):
    """``band_forward``/``band_backward``: each child's window read in place (tiles of 64
    children × 256 parents: these sizes cross them), against the band written out — outputs
    and the gradients in a, b, u and the slopes e; float64 to 1e-12, float32 to 1e-5."""
    g = torch.Generator().manual_seed(seed)
    P = front + N
    a, b = torch.randn(G, N, k, generator=g, dtype=dtype), torch.randn(G, P, k, generator=g,
                                                                        dtype=dtype)
    u = torch.randn(G, P, dv, generator=g, dtype=dtype)
    e = -torch.rand(G, N, generator=g, dtype=dtype)
    window = torch.minimum(torch.randint(0, widest + 1, (G, N), generator=g),
                           torch.arange(front, P))
    ops = kernels.mean_field_windows()
    out, lse = ops.band_forward(a, b, u, e, window, front, 0.7)
    leaves = [t.double().requires_grad_() for t in (a, b, u, e)]
    want = band_per_child(*leaves, window, front, 0.7)
    tol = 1e-12 if dtype == f64 else 1e-5
    torch.testing.assert_close(out.double(), want.detach(), atol=tol, rtol=0)
    dout = torch.randn(out.shape, generator=g, dtype=dtype)
    got = ops.band_backward(dout, a, b, u, e, window, out, lse, front, 0.7)
    grads = torch.autograd.grad((want * dout.double()).sum(), leaves)
    for name, x, y in zip("a b u e".split(), got, grads, strict=True):
        torch.testing.assert_close(x.double(), y, atol=tol * 10, rtol=tol, msg=name)


def test_band_per_child_gradcheck_and_opcheck():
    """Its autograd rule (``windows.kernel``) by finite differences, and torch.library's
    schema, fake-kernel and autograd checks."""
    from structattn.windows.kernel import _register

    ops = kernels.with_rules("mean_field", _register)
    torch.manual_seed(5)
    a, b, u = (torch.randn(1, n, w, dtype=f64, requires_grad=True)
               for n, w in ((70, 3), (73, 3), (73, 2)))
    e = (torch.rand(1, 70, dtype=f64) - 1).requires_grad_()
    window = torch.minimum(torch.randint(0, 70, (1, 70)), torch.arange(3, 73))
    assert torch.autograd.gradcheck(lambda *t: ops.band_forward(*t, window, 3, 0.7)[0],
                                    (a, b, u, e))
    torch.library.opcheck(ops.band_forward, (a, b, u, e, window, 3, 0.7))
