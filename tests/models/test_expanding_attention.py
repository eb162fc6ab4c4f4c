"""Expanding attention (SPEC.md §5.2), the catalogue model: its own Pyro reading, the last
tokens, learned a and b, argument checks, an ordinary module. The prior is tested in
tests/priors/test_beta_geometric.py, its mean-field reading in tests/windows/test_windows.py."""

import contextlib
import inspect
import math
import re
import warnings

import pytest
import torch

import structattn as sa

from ..programs import program

f64 = torch.float64


def test_the_declarations_own_pyro_reading_agrees():
    torch.manual_seed(0)
    m = sa.models.expanding_attention(6, heads=2, a=0.8, b=1.7, inference=None, dtype=f64)
    report = sa.inference.compare(m, torch.randn(2, 7, 6, dtype=f64))
    assert report.passed and report.max_abs_diff < 1e-10, str(report)


def test_last_tokens_against_pyro_and_the_full_forward():
    """``layer(x, last=k)``: children are the last k tokens, parents all n. Exact: Pyro's own
    reading of that declaration (children at positions n − k + i). Both readings, both
    mean-field paths, with and without a graph: the rows of the full forward, its posterior
    rows, its trace columns, and the same gradients."""
    torch.manual_seed(12)
    x = torch.randn(2, 30, 6, dtype=f64)
    m = sa.models.expanding_attention(6, heads=2, a=0.8, b=1.7, inference=None, dtype=f64)
    report = sa.inference.compare(m, x[:, :7], last=3)
    assert report.passed and report.max_abs_diff < 1e-10, str(report)
    for inference in (None,
                      sa.MeanFieldWindows(window_rule="evidence", initial_window=2),
                      sa.MeanFieldWindows(window_rule="evidence", initial_window=2,
                                          grad="last")):
        m = sa.models.expanding_attention(6, heads=2, a=1.5, b=1.0, inference=inference,
                                          dtype=f64)
        layer = sa.compile(m)
        for kernel in (True, False):
            with contextlib.nullcontext() if kernel else sa.kernels.disabled():
                with torch.no_grad():
                    y, post = layer(x, return_posterior=True)
                    y4, post4 = layer(x, last=4, return_posterior=True)
                torch.testing.assert_close(y4, y[:, -4:], atol=1e-12, rtol=0)
                torch.testing.assert_close(post4, post[..., -4:, :], atol=1e-12, rtol=0)
                if inference is not None:
                    with torch.no_grad():
                        t = layer(x, return_trace=True)[1].mean_field["attn"]
                        t4 = layer(x, last=4, return_trace=True)[1].mean_field["attn"]
                        t1 = layer(x, last=1, return_trace=True)[1].mean_field["attn"]
                    assert torch.equal(t4.windows[-1], t.windows[-1][..., -4:])
                    assert torch.equal(t4.child_iterations, t.child_iterations[..., -4:])
                    # the metrics count the last tokens' windows against reading all 30
                    w4 = t4.windows[-1].double()
                    assert t4.offset == 26 and t4.mean_window == pytest.approx(float(w4.mean()))
                    assert t1.mean_window == pytest.approx(float(t1.windows[-1].double().mean()))
                    its = t4.child_iterations.double()
                    assert t4.relative_operations(6) == pytest.approx(
                        float((w4 * (6 + its + 1)).mean()) / (30 * 6))
                xg = x.clone().requires_grad_()
                grads = []
                for last in (None, 4):
                    m.zero_grad()
                    xg.grad = None
                    out = layer(xg)[:, -4:] if last is None else layer(xg, last=last)
                    (out ** 2).sum().backward()
                    grads.append([xg.grad.clone()] + [p.grad.clone() for p in m.parameters()])
                for got, want in zip(*grads, strict=True):
                    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("inference", [None, sa.MeanFieldWindows()], ids=["exact", "mean_field"])
def test_gradcheck_including_a_and_b(inference):
    torch.manual_seed(4)
    m = sa.models.expanding_attention(4, heads=2, a=1.2, b=1.8, inference=inference,
                                      block_size=4, dtype=f64)
    layer = sa.compile(m)
    x = torch.randn(2, 9, 4, dtype=f64, requires_grad=True)
    names = [n for n, _ in layer.named_parameters()]
    assert "declaration.raw_prior" in names
    params = tuple(p.detach().clone().requires_grad_() for p in layer.parameters())

    def f(x, *ps):
        return torch.func.functional_call(layer, dict(zip(names, ps, strict=True)), (x,))

    assert torch.autograd.gradcheck(f, (x, *params))
    layer(x).sum().backward()
    assert m.raw_prior.grad is not None and bool((m.raw_prior.grad != 0).all())


def test_learned_prior_moves_towards_the_data():
    """Gradient descent on a and b: a sequence whose parent is always 1 step back makes the
    prior favour short distances (a/(a+b) = E[q] falls)."""
    torch.manual_seed(5)
    m = sa.models.expanding_attention(8, a=2.0, b=1.0, inference=sa.MeanFieldWindows(),
                                      dtype=f64)
    layer = sa.compile(m)
    opt = torch.optim.Adam([m.raw_prior], lr=0.05)
    x = torch.randn(4, 30, 8, dtype=f64)
    target = torch.roll(x, 1, dims=1) @ m.W_v.T.detach() @ m.W_o.T.detach()
    def mean_q():
        with torch.no_grad():
            return float(m.a[0] / (m.a[0] + m.b[0]))

    q0 = mean_q()
    for _ in range(30):
        opt.zero_grad()
        ((layer(x) - target)[:, 1:] ** 2).mean().backward()
        opt.step()
    assert mean_q() < q0 - 0.1, (q0, mean_q())


def test_bad_model_arguments_and_mismatches():
    with pytest.raises(ValueError, match="a must be finite and > 0"):
        sa.models.expanding_attention(8, a=-1.0)
    with pytest.raises(ValueError, match=r"tol .* \(0, 1\)"):
        sa.models.expanding_attention(8, inference=None, tol=2.0)
    with pytest.raises(ValueError, match=r"tol .* \(0, 1\)"):
        sa.models.expanding_attention(8, inference=sa.MeanFieldWindows(tol=2.0))
    with pytest.raises(ValueError, match=r"^ExpandingAttention: inference must be a "
                                         r"structattn.MeanFieldWindows .* or None .*; "
                                         r"got 'approx'$"):
        sa.models.expanding_attention(8, inference="approx")
    x, W = torch.randn(1, 5, 4), torch.randn(4, 4)
    with pytest.raises(ValueError, match=r"BetaGeometric a has 3 entries .* heads=2"):
        sa.compile(program)(x, W, sa.priors.BetaGeometric(torch.ones(3), 1.0), 2)
    with pytest.raises(ValueError, match=r"BetaGeometric b has 2 entries .* heads=3"):
        sa.compile(program)(torch.randn(1, 5, 6), torch.randn(6, 6),
                            sa.priors.BetaGeometric(torch.ones(3), torch.ones(2)), 3)
    with pytest.raises(ValueError, match=r"a must be a float or have one value per head \(2\)"):
        sa.models.expanding_attention(4, heads=2, a=torch.tensor([1.0, 2.0, 3.0]))
    m = sa.models.expanding_attention(4, heads=2, a=torch.tensor([1.0, 2.0]), b=3.0)
    torch.testing.assert_close(m.a.detach(), torch.tensor([1.0, 2.0]))

    def cross(x, y):
        phi = sa.edges("attn", sa.nodes("x", x), sa.nodes("y", y), sa.priors.BetaGeometric())
        sa.potential(phi, sa.potentials.DotProduct())
        return sa.value(phi, sa.values.Identity())

    with pytest.raises(ValueError, match=r"the last C of them\); got 5 children and 4"):
        sa.compile(cross)(x, torch.randn(1, 4, 4))
    # fewer children than parents: they must be the parents' last tokens
    with pytest.raises(ValueError, match=r"node set 'x' is not 'y'\[\.\.\., 1:, :\]"):
        sa.compile(cross)(x, torch.randn(1, 6, 4))
    sa.compile(cross)(x, torch.cat([torch.randn(1, 1, 4), x], 1))  # x is y's last 5: fine
    assert sa.compile(m)(x, last=torch.tensor(2)).shape == (1, 2, 4)
    for last in (0, 6, 2.0, True, torch.tensor([2])):
        with pytest.raises(ValueError, match=r"last \(how many final tokens.*\[1, n = 5\]"):
            sa.compile(m)(x, last=last)


def test_dtypes_state_dict_and_torch_compile(tmp_path):
    torch.manual_seed(6)
    m = sa.models.expanding_attention(8, heads=2, inference=sa.MeanFieldWindows())
    layer = sa.compile(m)
    x = torch.randn(2, 50, 8)
    y = layer(x)
    for dtype in (torch.float64, torch.bfloat16):
        m2 = sa.models.expanding_attention(8, heads=2, inference=sa.MeanFieldWindows()).to(dtype)
        m2.load_state_dict({k: v.to(dtype) for k, v in m.state_dict().items()})
        y2 = sa.compile(m2)(x.to(dtype))
        assert y2.dtype == dtype and bool(torch.isfinite(y2).all())
        # a child settles when E[φ_i] moves by ≤ 1e-3 relative: float32 and float64 may settle
        # a step apart, so they agree to the iteration's tolerance, not to rounding
        torch.testing.assert_close(y2.float(), y, atol=0.1 if dtype == torch.bfloat16 else 2e-3,
                                   rtol=0.1 if dtype == torch.bfloat16 else 2e-3)
    torch.save(m.state_dict(), tmp_path / "m.pt")
    m3 = sa.models.expanding_attention(8, heads=2, inference=sa.MeanFieldWindows())
    m3.load_state_dict(torch.load(tmp_path / "m.pt", weights_only=True))
    torch.testing.assert_close(sa.compile(m3)(x), y)
    # the mean-field loop (data-dependent length and windows) runs eagerly inside the compiled
    # module; in float64 no window decision can flip between the two
    m64 = m.double()
    layer64, x64 = sa.compile(m64), x.double()
    with warnings.catch_warnings():  # dynamo, wrapping the prior's a, b (softplus outputs),
        # warns that a non-leaf's .grad is not populated: harmless
        warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not "
                                "a leaf", category=UserWarning)
        torch.testing.assert_close(torch.compile(layer64)(x64), layer64(x64), atol=1e-12, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention fast path needs CUDA")
@pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores")  # inductor's advice
# dynamo, wrapping the prior's a, b (softplus outputs), warns that a non-leaf's .grad is not
# populated: harmless (as in the torch.compile test above)
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
def test_flex_attention_path_on_cuda_matches_the_banded_cpu_path():
    """FlexAttention runs fused (torch.compile): called eagerly it would form the N×N scores
    and warn so — a warning is an error here."""
    torch.manual_seed(7)
    m = sa.models.expanding_attention(64, heads=4, inference=None, prior_tol=0.01)
    x = torch.randn(2, 300, 64)
    y_cpu = sa.compile(m)(x)
    y_gpu = sa.compile(m.cuda())(x.cuda())
    torch.testing.assert_close(y_gpu.cpu(), y_cpu, atol=2e-3, rtol=2e-3)


def test_mean_field_drawing_shows_the_inferred_posterior():
    """The mean-field prior is the whole beta-geometric (its tol shapes inference, not the
    model): the drawing keeps every edge the posterior reaches and marks its argmax."""
    torch.manual_seed(10)
    m = sa.models.expanding_attention(8, heads=2, a=2.0, b=2.0)
    x = torch.randn(1, 60, 8) * 3
    _, post = sa.compile(m)(x, return_posterior=True)
    G = sa.to_networkx(m, x, top_k=2)
    for u, v, d in G.edges(data=True):
        if d["map"]:
            i, j = G.nodes[v]["index"], G.nodes[u]["index"]
            assert int(post[0, d["head"], i].argmax()) == j
    reached = int((post[0] > 0).sum())
    assert sa.to_networkx(m, x).number_of_edges() >= reached


def test_trace_of_a_sequence_without_past():
    m = sa.models.expanding_attention(4, inference=sa.MeanFieldWindows())
    _, trace = sa.compile(m)(torch.randn(2, 1, 4), return_trace=True)
    assert trace.steps == 0 and trace.converged
    trace = trace.mean_field["attn"]
    assert trace.iterations == 0 and trace.mean_window == 0.0
    assert trace.relative_operations(4) == 0.0


def test_the_default_scheme_is_mean_field_windows_with_its_own_defaults():
    """``inference`` takes the scheme whole; its default is ``MeanFieldWindows()``, whose own
    defaults are the options the constructor took before it did (tol 0.05, 50 rounds, …):
    giving the default explicitly changes nothing (float64, to 0)."""
    default = inspect.signature(sa.models.ExpandingAttention).parameters["inference"].default
    assert default == sa.MeanFieldWindows() == sa.MeanFieldWindows(
        tol=0.05, max_window=None, max_iters=50, converge_tol=1e-3, expectation="digamma",
        update="conjugate", window_rule="certified", initial_window=None, grad="unroll")
    x = torch.randn(2, 40, 8, dtype=f64)
    outs = []
    for kwargs in ({}, {"inference": sa.MeanFieldWindows()}):
        torch.manual_seed(14)
        m = sa.models.expanding_attention(8, heads=2, a=1.5, b=2.0, dtype=f64, **kwargs)
        assert m.inference == sa.MeanFieldWindows()
        assert m.prior().tol is None and m.prior().max_window is None  # the scheme's windows
        with torch.no_grad():
            outs.append(sa.compile(m)(x, return_trace=True))
    (y0, t0), (y1, t1) = outs
    torch.testing.assert_close(y0, y1, atol=0, rtol=0)
    assert torch.equal(t0.mean_field["attn"].windows[-1], t1.mean_field["attn"].windows[-1])
    scheme = sa.MeanFieldWindows(tol=1e-3, max_window=12, window_rule="evidence", grad="last")
    assert sa.models.expanding_attention(8, inference=scheme).inference is scheme


def _split(t, heads):  # (B, n, H·d) -> (B, H, n, d)
    return t.unflatten(-1, (heads, -1)).transpose(-2, -3)


def _exact_by_hand(m, x):
    """The exact reading written out (float64): per head, token i's posterior over its past
    j < i ∝ exp(q_iᵀk_j/τ) · B(a + d − 1, b + 1)/B(a, b), d = i − j; token 0 reads nothing."""
    H, n = m.heads, x.shape[-2]
    q, k, v = (_split(x @ W.T, H) for W in (m.W_q, m.W_k, m.W_v))
    a, b = m.a[:, None, None], m.b[:, None, None]
    d = (torch.arange(n)[:, None] - torch.arange(n)[None]).to(x.dtype)  # (n, n)

    def log_beta(u, w):
        return torch.lgamma(u) + torch.lgamma(w) - torch.lgamma(u + w)

    log_prior = log_beta(a + d.clamp(min=1) - 1, b + 1) - log_beta(a, b)  # (H, n, n)
    tau = math.sqrt(m.d_k) if m.temperature is None else m.temperature  # None: √d_k
    logits = q @ k.transpose(-1, -2) / tau + log_prior
    logits = logits.masked_fill(d < 1, -math.inf)
    w = torch.softmax(logits, -1).nan_to_num(0.0)  # token 0: an empty row, zero
    return (w @ v).transpose(-2, -3).flatten(-2) @ m.W_o.T


def test_inference_none_is_the_exact_reading():
    """``inference=None`` is what ``variant="exact"`` was: q integrated out, one softmax over
    the whole past (a hand-written loop, to 1e-12); the prior's own options reach the prior;
    the catalogue's exact variant is it."""
    torch.manual_seed(15)
    m = sa.models.expanding_attention(8, heads=2, a=1.5, b=2.0, inference=None, dtype=f64)
    with torch.no_grad():
        m.raw_prior.add_(torch.randn_like(m.raw_prior) * 0.3)  # heads with their own a, b
    assert m.inference is None
    x = torch.randn(2, 20, 8, dtype=f64)
    with torch.no_grad():
        torch.testing.assert_close(sa.compile(m)(x), _exact_by_hand(m, x), atol=1e-12, rtol=0)
    prior = sa.models.expanding_attention(8, inference=None, tol=1e-3, max_window=16,
                                          block_size=8).prior()
    assert (prior.tol, prior.prior_tol, prior.max_window, prior.block_size) == (1e-3, None, 16, 8)
    model, _ = sa.models.CATALOGUE["expanding_attention"].variants["exact"]()
    assert model.inference is None


@pytest.mark.parametrize("bad", ["exact", "mean_field", sa.MeanFieldWindows,
                                 sa.IterationOptions(), sa.priors.BetaGeometric(), 0.05])
def test_a_bad_inference_is_refused(bad):
    with pytest.raises(ValueError, match=rf"^ExpandingAttention: inference must be a "
                                         rf"structattn.MeanFieldWindows \(the mean-field "
                                         rf"reading\) or None \(the exact reading\); got "
                                         rf"{re.escape(repr(bad))}$"):
        sa.models.expanding_attention(8, inference=bad)


@pytest.mark.parametrize("arg, value, scheme", [
    ("tol", 0.01, "MeanFieldWindows(tol=…)"),
    ("prior_tol", 0.1, "MeanFieldWindows(tol=…, window_rule=…)"),
    ("max_window", 8, "MeanFieldWindows(max_window=…)")])
def test_a_prior_option_with_a_mean_field_scheme_is_refused(arg, value, scheme):
    """``tol``, ``prior_tol``, ``max_window`` are the exact reading's prior options: with a
    mean-field scheme (the default or given) they are refused, naming the scheme's own."""
    want = (rf"^ExpandingAttention: {arg} \(an option of the exact reading's prior, "
            rf"inference=None\) must be None with a mean-field scheme, whose windows take "
            rf"{re.escape(scheme)}; got {arg}={re.escape(repr(value))}$")
    for kwargs in ({}, {"inference": sa.MeanFieldWindows(tol=0.01)}):
        with pytest.raises(ValueError, match=want):
            sa.models.expanding_attention(8, **kwargs, **{arg: value})
    m = sa.models.expanding_attention(8, inference=None, **{arg: value})  # the exact reading's
    assert getattr(m.prior(), arg) == value


def test_the_schemes_options_are_not_constructor_arguments():
    """The scheme's options are not the constructor's: a TypeError naming the argument and
    where it lives now (``inference=structattn.MeanFieldWindows(...)``; ``variant``, the
    reading's old name, names ``inference`` itself)."""
    with pytest.raises(TypeError, match=r"variant= is no longer an argument; use inference=None"):
        sa.models.expanding_attention(8, variant="mean_field", grad="last")
    for name, value in (("max_iters", 5), ("converge_tol", 1e-4), ("expectation", "plug_in"),
                        ("update", "accumulate"), ("window_rule", "evidence"),
                        ("initial_window", 4)):
        with pytest.raises(TypeError, match=rf"{name}= is no longer an argument; use "
                                            rf"inference=sa\.MeanFieldWindows\({name}="):
            sa.models.expanding_attention(8, **{name: value})
