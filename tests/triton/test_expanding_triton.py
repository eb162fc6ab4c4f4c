"""Expanding attention's mean field in Triton (structattn/triton_kernels/expanding.py), under
the interpreter where there is no GPU: ``solve`` equals the CPU kernel's fixed point (windows,
steps and whether each child settled exactly; α, β, E[φ] and the certified bound to rounding);
the band per child equals the CPU kernel, softmax written out and its gradients (gradcheck,
opcheck); a whole layer through both equals the brute-force mean field, and its ``grad="last"``
gradients equal the Python loop's; a plan records each op once."""

import pytest
import torch

import structattn as sa
from structattn import kernels, triton_kernels

from ..programs import program, scores_of
from ..reference import band_per_child
from ..windows.test_windows import brute_mean_field, ceilings

f64 = torch.float64
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
#: on a GPU, sizes crossing its wider blocks (64)
GPU_SIZES = [(150, 300, 64, 64)] if DEVICE.type == "cuda" else []


def _ex():
    from structattn.triton_kernels import expanding
    return expanding


def _problem(G, N, P, k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(G, N, k, generator=g, dtype=f64)
    b = torch.randn(G, P, k, generator=g, dtype=f64)
    b[0, P // 3] *= 4  # a long key: the certified ceiling behind it is higher
    a0 = torch.tensor([2.0, 1.2, 0.7][:G], dtype=f64)
    b0 = torch.tensor([1.5, 3.0, 0.9][:G], dtype=f64)
    caps = torch.arange(P).clamp(max=P - 10)
    win0 = torch.minimum(torch.randint(1, 4, (G, N), generator=g), caps[P - N:])
    return [t.to(DEVICE, dtype) for t in (a, b, a0, b0)] + [win0.to(DEVICE), caps.to(DEVICE)]


#: the default run: every option against a prefix of non-children (N < P), and at N = P one
#: case of each option and dtype; the full product with ``-m slow`` (the interpreter runs each
#: case in seconds)
_SOLVE_BY_DEFAULT = {(70, 70, 1, True, True, torch.float32), (70, 70, 3, False, False, f64)}


def _solve_cases():
    for N, P in [(45, 70), (70, 70), (1, 1)]:
        for expectation, update in [(True, True), (False, False)]:
            for rule in (3, 1):
                for dtype in (f64, torch.float32):
                    case = (N, P, rule, expectation, update, dtype)
                    slow = N == P == 70 and case not in _SOLVE_BY_DEFAULT
                    yield pytest.param(*case, marks=(pytest.mark.slow,) if slow else (),
                                       id=f"{N}-{P}-{expectation}-{update}-{rule}-{dtype}")


def _cpu_solve(a, b, N, P, a0, b0, win0, caps, rest, record=False):
    """The C++ kernel's ``solve`` on the CPU (``rest``: tol, converge_tol, max_iters, cap,
    expectation, update, rule)."""
    return kernels.mean_field_windows().solve(
        *(t.cpu() for t in (a, b)), P - N, 0.7, *(t.cpu() for t in (a0, b0, win0, caps)),
        *rest, record)


def _assert_float32_solve_agrees(got, want, history, ctol, on_gpu):
    """float32: the Triton ``solve``'s fixed point ``got`` against the CPU kernel's ``want``.

    The windows agree (on a GPU, 95% of them: float32 exp and log are the hardware's
    approximations, a few ulps, and a child whose bound sits at tol may double where the
    CPU's does not). A child whose |ΔE[φ]| sits at its convergence threshold (converge_tol
    of E[φ]) may stop one step earlier or later than the CPU's, its sums taken in another
    order: a tie, which ``history`` tells from a bug — the CPU kernel never settling
    (converge_tol < 0), its state at every step ``(max_iters, G, N)`` (window, α, β, E[φ]):
    at the earlier of the two stops the CPU's own |ΔE[φ]| is within half the threshold of
    it, and the Triton child's α, β, E[φ] are the CPU's after the Triton child's own number
    of steps. (Under the accumulating update α gains E[φ] − 1 at each step, ~1/steps of
    itself: a child compared with the CPU's state one step away would be off by 5–8%.) Every
    other child's α, β, E[φ] to 1e-3 of their size, its bound to 1e-5."""
    window, alpha, beta, m, steps, _, bound = zip(got, want, strict=True)
    h_win, h_alpha, h_beta, h_m = history
    same = window[0] == window[1]
    assert same.double().mean() >= (0.95 if on_gpu else 1.0)
    assert int((steps[0] - steps[1])[same].abs().max()) <= 1
    tie = same & (steps[0] != steps[1])
    if bool(tie.any()):
        first = torch.minimum(steps[0], steps[1])[tie]  # the earlier stop, ≥ 2 (ΔE[φ] at 1 is NaN)
        at = h_m.flatten(1)[:, tie.flatten()]  # (max_iters, ties): E[φ] step by step
        cols = torch.arange(at.shape[1])
        moved = (at[first - 1, cols] - at[first - 2, cols]).abs()
        threshold = ctol * at[first - 1, cols].abs().clamp(min=1.0)
        assert ((moved - threshold).abs() <= 0.5 * threshold).all(), (moved, threshold)
        # the CPU's state after the Triton child's own number of steps
        mine = (steps[0][tie] - 1)[None]
        for name, x, h in [("window", window[0], h_win), ("α", alpha[0], h_alpha),
                           ("β", beta[0], h_beta), ("E[φ]", m[0], h_m)]:
            y = h.flatten(1)[:, tie.flatten()].gather(0, mine)[0]
            torch.testing.assert_close(x[tie], y.to(x.dtype), atol=0, rtol=1e-3,
                                       msg=f"{name} of a tie")
    agree = same & ~tie
    for name, (x, y) in zip(["α", "β", "E[φ]"], [alpha, beta, m], strict=True):
        torch.testing.assert_close(x[agree], y[agree], atol=0, rtol=1e-3, msg=name)
    torch.testing.assert_close(bound[0][agree], bound[1][agree], atol=1e-5, rtol=0)
    return int(tie.sum())


@pytest.mark.parametrize("N, P, rule, expectation, update, dtype", list(_solve_cases()))
def test_triton_solve_equals_the_cpu_kernel(N, P, rule, expectation, update, dtype):
    """float64: each child's window, steps and settledness exactly, α, β, E[φ] and the bound
    to 1e-12 — children crossing the blocks of 32, a prefix of non-children (P > N), the
    certified and the edge rule, digamma/conjugate and plug-in/accumulate. float32: as
    ``_assert_float32_solve_agrees`` says (a child at its convergence threshold may stop a
    step away from the CPU's: it is compared with the CPU's state at its own step)."""
    assert kernels.available(), kernels.build_error()
    a, b, a0, b0, win0, caps = _problem(2, N, P, 5, dtype, N + rule)
    rest = (0.05, 1e-4, 20, P - 10, expectation, update, rule)
    got = [t.cpu() for t in _ex().solve(a, b, P - N, 0.7, a0, b0, win0, *rest)]
    want = _cpu_solve(a, b, N, P, a0, b0, win0, caps, rest)[:7]
    window, alpha, beta, m, steps, settled, bound = zip(got, want, strict=True)
    if dtype == f64:
        assert torch.equal(*window) and torch.equal(*steps) and torch.equal(*settled)
        for name, (x, y) in zip(["α", "β", "E[φ]", "bound"], [alpha, beta, m, bound],
                                strict=True):
            torch.testing.assert_close(x, y, atol=1e-12, rtol=1e-12, msg=name)
    else:
        never = (rest[0], -1.0, *rest[2:])  # the CPU kernel never settling: every step
        history = _cpu_solve(a, b, N, P, a0, b0, win0, caps, never, record=True)[7:]
        _assert_float32_solve_agrees(got, want, history, rest[1], DEVICE.type == "cuda")
    if N > 1:
        assert int(got[0].max()) > 4 and int(got[4].max()) > 2  # windows grew, over steps


#: float32 problems (N = 45, P = 70, the certified rule, plug-in and accumulating) and keys
#: scaled by 1 ± k ulps (as a GPU's sums and exp may differ from the CPU's) among which to
#: find a child at its convergence threshold: the seeds where the CPU kernel itself stops one
#: child a step apart on the scaled keys come first (20, 32 here)
_TIE = dict(N=45, P=70, rule=3, expectation=False, update=False,
            seeds=(20, 32, 27, 5, 11, 17, 40, 3), scales=(-1, 1, -2, 2, -4, 4))


def _tie_case():
    """``(got, want, history)``: the Triton ``solve`` on scaled keys, the CPU kernel's on the
    keys as they are, and its history never settling — the first problem of ``_TIE`` where
    the CPU kernel's own steps on the scaled keys tie (a step apart, same window) and the
    Triton ``solve``'s do too; None if none does."""
    N, P = _TIE["N"], _TIE["P"]
    rest = (0.05, 1e-4, 20, P - 10, _TIE["expectation"], _TIE["update"], _TIE["rule"])
    for seed in _TIE["seeds"]:
        a, b, a0, b0, win0, caps = _problem(2, N, P, 5, torch.float32, seed)
        want = _cpu_solve(a, b, N, P, a0, b0, win0, caps, rest)[:7]
        for k in _TIE["scales"]:
            scaled = a * (1 + k * 2 ** -23)
            cpu = _cpu_solve(scaled, b, N, P, a0, b0, win0, caps, rest)
            if not bool(((cpu[4] != want[4]) & (cpu[0] == want[0])).any()):
                continue
            got = [t.cpu() for t in _ex().solve(scaled, b, P - N, 0.7, a0, b0, win0, *rest)]
            if bool(((got[4] != want[4]) & (got[0] == want[0])).any()):
                never = (rest[0], -1.0, *rest[2:])
                history = _cpu_solve(a, b, N, P, a0, b0, win0, caps, never, record=True)[7:]
                return got, want, history
    return None


def test_float32_solve_comparison_tells_a_threshold_tie_from_a_bug():
    """An ulp's change in the keys (GPU-like rounding) moves one child's stop by a step: the
    comparison accepts it as a tie (its α then ~6% from the CPU's α at the CPU's step), and
    still refuses a child whose steps agree but whose α took one more update, or a tie child
    whose α is not the CPU's at its own step."""
    case = _tie_case()
    assert case is not None, "no tie among _TIE's problems: the emulation shows nothing"
    got, want, history = case
    on_gpu = DEVICE.type == "cuda"
    assert _assert_float32_solve_agrees(got, want, history, 1e-4, on_gpu) >= 1
    steps = got[4]
    tie = (steps != want[4]) & (got[0] == want[0])
    c = tie.flatten().nonzero()[0, 0]
    off = (want[1].flatten()[c] - got[1].flatten()[c]).abs() / want[1].flatten()[c]
    assert off > 1e-2  # what the former comparison (α to 1e-3 wherever windows agree) refused
    # a child that agrees, settled before the last step, whose update E[φ] − 1 is ≥ 1
    agree = ((steps == want[4]) & (steps > 2) & (steps < 20) & (got[3] > 2)).flatten() \
        .nonzero()[0, 0]
    for child, extra in [(agree, got[3].flatten()[agree] - 1.0),  # one update too many
                         (c, 0.5)]:  # a tie child's α off its own step's
        bad = [t.clone() for t in got]
        bad[1].view(-1)[child] += extra
        with pytest.raises(AssertionError):
            _assert_float32_solve_agrees(bad, want, history, 1e-4, on_gpu)
    late = [t.clone() for t in got]  # a child stopping where the CPU's ΔE[φ] is no tie
    late[4].view(-1)[agree] += 1
    with pytest.raises(AssertionError):
        _assert_float32_solve_agrees(late, want, history, 1e-4, on_gpu)


def test_triton_solve_refuses_a_rule_it_does_not_run():
    a, b, a0, b0, win0, _ = _problem(2, 5, 5, 3, f64, 0)
    with pytest.raises(ValueError, match=r"rule must be one of \[1, 3\].*got 0"):
        _ex().solve(a, b, 0, 0.7, a0, b0, win0, 0.05, 1e-4, 20, 5, True, True, 0)


def _band(G, N, P, k, dv, seed, dtype=f64):
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(G, N, k, generator=g), torch.randn(G, P, k, generator=g)
    u = torch.randn(G, P, dv, generator=g)
    window = torch.minimum(torch.randint(0, 50, (G, N), generator=g),
                           torch.arange(P - N, P))
    alpha, beta = torch.rand(G, N, generator=g) * 3 + 0.5, torch.rand(G, N, generator=g) * 3 + 0.5
    return ([t.to(DEVICE, dtype) for t in (a, b, u)] + [window.to(DEVICE)]
            + [t.to(DEVICE, f64) for t in (alpha, beta)])


@pytest.mark.parametrize("N, P, k, dv", [(70, 90, 5, 7), (33, 33, 16, 16), (1, 2, 3, 1),
                                         *GPU_SIZES])
def test_triton_band_per_child_equals_the_cpu_kernel_and_softmax_written_out(N, P, k, dv):
    a, b, u, window, alpha, beta = _band(2, N, P, k, dv, N + k)
    e = torch.digamma(alpha) - torch.digamma(alpha + beta)
    out, _ = _ex().attend_forward(a, b, u, e, window, P - N, 0.7)
    cpu = kernels.mean_field_windows().attend(a.cpu(), b.cpu(), u.cpu(), P - N, 0.7,
                                              window.cpu(), alpha.cpu(), beta.cpu(), True)
    torch.testing.assert_close(out.cpu(), cpu, atol=1e-12, rtol=0)
    leaves = [t.clone().requires_grad_() for t in (a, b, u, e)]
    want = band_per_child(*leaves, window, P - N, 0.7)
    torch.testing.assert_close(out, want.detach(), atol=1e-12, rtol=0)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad((want * dout).sum(), leaves)
    mine = [t.clone().requires_grad_() for t in (a, b, u, e)]
    got = torch.autograd.grad((_ex().attend_forward(*mine, window, P - N, 0.7)[0]
                               * dout).sum(), mine)
    for name, x, y in zip("a b u e".split(), got, grads, strict=True):
        torch.testing.assert_close(x, y, atol=1e-11, rtol=0, msg=name)


@pytest.mark.parametrize("windows", ["whole past", "narrow"])
def test_the_band_per_childs_db_du_per_block_of_parents_equal_the_atomic_adds(windows,
                                                                            monkeypatch):
    """db and du from the kernel per block of parents (the default: no atomics, the blocks of
    children that reach each block of parents) equal those the children's kernel adds per
    tile (``BACKWARD["db_du"] = "atomic"``), with windows holding each child's whole past
    (the parents' kernel reads every later block) and narrow ones with one far reach (it
    skips the blocks between), children the last 70 of 90 tokens."""
    from structattn.triton_kernels import band_per_child as bpc

    a, b, u, window, alpha, beta = _band(2, 70, 90, 5, 7, 11)
    if windows == "whole past":
        window = torch.arange(20, 90, device=DEVICE).expand(2, 70).clone()
    else:
        window = window.clamp(max=6)
        window[0, 60] = 75  # one child reaches back almost to the start
    e = torch.digamma(alpha) - torch.digamma(alpha + beta)
    out, lse = bpc.attend_forward(a, b, u, e, window, 20, 0.7)
    dout = torch.randn_like(out)
    got = bpc.attend_backward(dout, a, b, u, e, window, out, lse, 20, 0.7)
    monkeypatch.setitem(bpc.BACKWARD, "db_du", "atomic")
    want = bpc.attend_backward(dout, a, b, u, e, window, out, lse, 20, 0.7)
    for name, x, y in zip("a b u e".split(), got, want, strict=True):
        torch.testing.assert_close(x, y, atol=1e-12, rtol=0, msg=name)
    leaves = [t.clone().requires_grad_() for t in (a, b, u, e)]
    exact = band_per_child(*leaves, window, 20, 0.7)
    for name, x, y in zip("a b u e".split(), got,
                          torch.autograd.grad((exact * dout).sum(), leaves), strict=True):
        torch.testing.assert_close(x, y, atol=1e-11, rtol=0, msg=name)


def test_triton_band_per_child_gradcheck_and_opcheck():
    torch.manual_seed(5)
    a, b, u = (torch.randn(1, n, w, dtype=f64, device=DEVICE, requires_grad=True)
               for n, w in ((6, 3), (9, 3), (9, 2)))
    e = (torch.rand(1, 6, dtype=f64, device=DEVICE) - 1).requires_grad_()
    window = torch.tensor([[0, 1, 2, 3, 4, 9]], device=DEVICE)
    assert torch.autograd.gradcheck(
        lambda *t: _ex().attend_forward(*t, window, 3, 0.7)[0], (a, b, u, e))
    torch.library.opcheck(_ex().attend_forward, (a, b, u, e, window, 3, 0.7))
    problem = _problem(2, 6, 9, 3, f64, 1)
    for win0 in (problem[4], problem[4][:, 0]):  # per child, per row
        torch.library.opcheck(_ex().solve, (*problem[:2], 3, 0.7, *problem[2:4], win0,
                                            0.05, 1e-4, 5, 8, True, True, 3),
                              test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("dtype, atol, grad_rtol", [(torch.bfloat16, 2 ** -6, 2 ** -5),
                                                    (torch.float16, 2 ** -9, 2 ** -8)])
def test_triton_band_per_child_takes_half_precision_as_it_is(dtype, atol, grad_rtol):
    a, b, u, window, alpha, beta = _band(2, 70, 90, 16, 16, 3, dtype)
    e = (torch.digamma(alpha) - torch.digamma(alpha + beta)).float()
    out, _ = _ex().attend_forward(a, b, u, e, window, 20, 0.6)
    assert out.dtype == torch.float32
    leaves = [t.double().requires_grad_() for t in (a, b, u, e)]
    want = band_per_child(*leaves, window, 20, 0.6)
    torch.testing.assert_close(out.double(), want.detach(), rtol=0,
                               atol=atol * (1 + want.abs().max().item()))
    dout = torch.randn_like(out)
    got = _ex().attend_backward(dout, a, b, u, e, window, out, _[...], 20, 0.6)
    assert [x.dtype for x in got] == [dtype] * 3 + [torch.float32]
    grads = torch.autograd.grad((want * dout.double()).sum(), leaves)
    for x, w in zip(got, grads, strict=True):
        assert (x.double() - w).norm() <= grad_rtol * w.norm(), (x.dtype, x.shape)


#: the options every length runs by default (the others at n = 40 with ``-m slow``)
_FIRST = ("certified", "digamma", "conjugate")


@pytest.mark.parametrize("n, rule, expectation, update", [
    pytest.param(n, *options, marks=(pytest.mark.slow,) if n == 40 and options != _FIRST else ())
    for n in (9, 40) for options in [
        ("certified", "digamma", "conjugate"), ("certified", "plug_in", "accumulate"),
        ("edge", "digamma", "conjugate")]])
def test_triton_layer_equals_the_brute_force_mean_field(n, rule, expectation, update):
    """A whole layer through the Triton kernels (``on_cpu``, no grad) equals the brute-force
    mean field (tests/windows/test_windows.py: numpy, child by child): posterior and output."""
    g = torch.Generator().manual_seed(n)
    heads, d = 2, 4
    x = torch.randn(2, n, d, generator=g, dtype=f64).to(DEVICE)
    W = (torch.randn(d, d, generator=g, dtype=f64) * 1.5).to(DEVICE)
    a, b = torch.tensor([0.7, 2.0], dtype=f64), torch.tensor([1.3, 0.9], dtype=f64)
    prior = sa.priors.BetaGeometric(a.to(DEVICE), b.to(DEVICE), block_size=8)
    scheme = sa.MeanFieldWindows(tol=0.1, expectation=expectation, update=update,
                                 window_rule=rule, initial_window=2)
    with torch.no_grad(), triton_kernels.on_cpu():
        y, post = sa.compile(program)(x, W, prior, heads, scheme, return_posterior=True)
    s = scores_of(x.cpu(), W.cpu(), heads)
    reach, runs, slack = ceilings(x.cpu(), W.cpu(), heads)
    for bi in range(2):
        for h in range(heads):
            want, *_ = brute_mean_field(
                s[bi, h], float(a[h]), float(b[h]), tol=0.1, expectation=expectation,
                update=update, window_rule=rule, initial_window=2,
                ceiling=(reach[bi, h].tolist(), runs[bi, h].tolist(), slack[bi, h].tolist()))
            torch.testing.assert_close(post[bi, h].cpu(), want, atol=1e-10, rtol=0)
    v = x.unflatten(-1, (heads, -1)).transpose(-2, -3)
    torch.testing.assert_close(y, post @ v, atol=1e-10, rtol=0)


@pytest.mark.parametrize("n, heads", [(12, 1), (45, 2)])
def test_triton_grad_last_equals_the_loops_gradients(n, heads):
    """``grad="last"`` through the Triton kernels: the output and the gradients in the input
    and every parameter — the projections and the prior's a, b — equal the Python loop's
    (kernels off: autograd through PyTorch)."""
    torch.manual_seed(n)
    m = sa.models.expanding_attention(8, heads=heads, inference=sa.MeanFieldWindows(grad="last"),
                                      dtype=f64, device=DEVICE)
    x = (torch.randn(2, n, 8, dtype=f64, device=DEVICE) * 2).requires_grad_()
    params = [p for p in m.parameters() if p.requires_grad]
    with triton_kernels.on_cpu():
        y = sa.compile(m)(x)
        got = torch.autograd.grad(y.square().sum(), [x, *params])
    with sa.kernels.disabled():
        y_loop = sa.compile(m)(x)
        want = torch.autograd.grad(y_loop.square().sum(), [x, *params])
    torch.testing.assert_close(y, y_loop, atol=1e-10, rtol=0)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-10, rtol=0)
    assert any(bool((g != 0).any()) for g in got[1:])


def test_triton_ops_are_one_node_each_of_a_plan():
    """A recorded plan holds ``mean_field_solve`` and the band op once each, and no
    synchronising read of the windows; every call equals the loop's."""
    torch.manual_seed(4)
    m = sa.models.expanding_attention(8, heads=2, inference=sa.MeanFieldWindows(), dtype=f64,
                                      device=DEVICE)
    x = torch.randn(1, 40, 8, dtype=f64, device=DEVICE)
    layer = sa.compile(m)
    with torch.no_grad(), triton_kernels.on_cpu():
        ys = [layer(x) for _ in range(3)]
    (plan,) = layer.plans.values()
    targets = [str(n.target) for n in plan.graph.graph.nodes if n.op == "call_function"]
    assert sum("structattn_triton.mean_field_solve" in t for t in targets) == 1, targets
    assert sum("structattn_triton.mean_field_attend_forward" in t for t in targets) == 1
    assert not any("_local_scalar_dense" in t or ".item" in t for t in targets), targets
    with torch.no_grad(), sa.kernels.disabled():
        plain = layer(x)
    for y in ys:
        torch.testing.assert_close(y, plain, rtol=0, atol=1e-12)
