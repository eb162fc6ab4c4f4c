"""Expanding attention (SPEC.md §5.2), the catalogue model: its own Pyro reading, the last
tokens, learned a and b, argument checks, an ordinary module. The prior is tested in
tests/priors/test_beta_geometric.py, its mean-field reading in tests/windows/test_windows.py."""

import contextlib
import warnings

import pytest
import torch

import structattn as sa

from ..programs import program

f64 = torch.float64


def test_the_declarations_own_pyro_reading_agrees():
    torch.manual_seed(0)
    m = sa.models.expanding_attention(6, heads=2, a=0.8, b=1.7, variant="exact", dtype=f64)
    report = sa.inference.compare(m, torch.randn(2, 7, 6, dtype=f64))
    assert report.passed and report.max_abs_diff < 1e-10, str(report)


def test_last_tokens_against_pyro_and_the_full_forward():
    """``layer(x, last=k)``: children are the last k tokens, parents all n. Exact: Pyro's own
    reading of that declaration (children at positions n − k + i). Both variants, both
    mean-field paths, with and without a graph: the rows of the full forward, its posterior
    rows, its trace columns, and the same gradients."""
    torch.manual_seed(12)
    x = torch.randn(2, 30, 6, dtype=f64)
    m = sa.models.expanding_attention(6, heads=2, a=0.8, b=1.7, variant="exact", dtype=f64)
    report = sa.inference.compare(m, x[:, :7], last=3)
    assert report.passed and report.max_abs_diff < 1e-10, str(report)
    for variant, grad in (("exact", "unroll"), ("mean_field", "unroll"), ("mean_field", "last")):
        m = sa.models.expanding_attention(6, heads=2, a=1.5, b=1.0, variant=variant, grad=grad,
                                          window_rule="evidence", initial_window=2, dtype=f64)
        layer = sa.compile(m)
        for kernel in (True, False):
            with contextlib.nullcontext() if kernel else sa.kernels.disabled():
                with torch.no_grad():
                    y, post = layer(x, return_posterior=True)
                    y4, post4 = layer(x, last=4, return_posterior=True)
                torch.testing.assert_close(y4, y[:, -4:], atol=1e-12, rtol=0)
                torch.testing.assert_close(post4, post[..., -4:, :], atol=1e-12, rtol=0)
                if variant == "mean_field":
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


@pytest.mark.parametrize("variant", ["exact", "mean_field"])
def test_gradcheck_including_a_and_b(variant):
    torch.manual_seed(4)
    m = sa.models.expanding_attention(4, heads=2, a=1.2, b=1.8, variant=variant,
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
    m = sa.models.expanding_attention(8, a=2.0, b=1.0, variant="mean_field", dtype=f64)
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
        sa.models.expanding_attention(8, tol=2.0)
    with pytest.raises(ValueError, match="variant must be one of"):
        sa.models.expanding_attention(8, variant="approx")
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
    m = sa.models.expanding_attention(8, heads=2, variant="mean_field")
    layer = sa.compile(m)
    x = torch.randn(2, 50, 8)
    y = layer(x)
    for dtype in (torch.float64, torch.bfloat16):
        m2 = sa.models.expanding_attention(8, heads=2, variant="mean_field").to(dtype)
        m2.load_state_dict({k: v.to(dtype) for k, v in m.state_dict().items()})
        y2 = sa.compile(m2)(x.to(dtype))
        assert y2.dtype == dtype and bool(torch.isfinite(y2).all())
        # a child settles when E[φ_i] moves by ≤ 1e-3 relative: float32 and float64 may settle
        # a step apart, so they agree to the iteration's tolerance, not to rounding
        torch.testing.assert_close(y2.float(), y, atol=0.1 if dtype == torch.bfloat16 else 2e-3,
                                   rtol=0.1 if dtype == torch.bfloat16 else 2e-3)
    torch.save(m.state_dict(), tmp_path / "m.pt")
    m3 = sa.models.expanding_attention(8, heads=2, variant="mean_field")
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
    m = sa.models.expanding_attention(64, heads=4, variant="exact", prior_tol=0.01)
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
    m = sa.models.expanding_attention(4, variant="mean_field")
    _, trace = sa.compile(m)(torch.randn(2, 1, 4), return_trace=True)
    assert trace.steps == 0 and trace.converged
    trace = trace.mean_field["attn"]
    assert trace.iterations == 0 and trace.mean_window == 0.0
    assert trace.relative_operations(4) == 0.0
