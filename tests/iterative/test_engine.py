"""The iterating reader (structattn/iterative/iterate.py): update rules and damping against their
definitions, tolerance, traces, gradients through the loop, refusals, an ordinary module."""

import math

import pytest
import torch

import structattn as sa

from ..distributed import release_process_group

f64 = torch.float64


def test_gradient_rule_and_damping_follow_their_definitions():
    W = torch.randn(4, 4, dtype=f64)
    x, z0 = torch.randn(2, 5, 4, dtype=f64), torch.randn(2, 3, 4, dtype=f64)

    def program(x, z, update, damping):
        obs = sa.nodes("x", x)
        lat = sa.latent("z", z, scale=2.0, update=update, step_size=0.05, damping=damping,
                        steps=4)
        phi = sa.edges("f", lat, obs, sa.priors.Uniform())
        sa.potential(phi, sa.potentials.Bilinear(W, W, temperature=1.0))
        return sa.infer(lat)

    def F(z):  # −log p(x, z) written out: Gaussian prior N(0, 2²), uniform edges
        psi = (z @ W.T) @ (x @ W.T).transpose(-1, -2)
        return (0.5 * (z / 2) ** 2).sum() - (torch.logsumexp(psi, -1) - math.log(5)).sum()

    for update, damping in (("gradient", 0.0), ("gradient", 0.3), ("cccp", 0.5)):
        z = z0.clone()
        for _ in range(4):
            zz = z.detach().requires_grad_()
            (g,) = torch.autograd.grad(F(zz), zz)
            new = z - 0.05 * g if update == "gradient" else z - g * 4.0  # CCCP: μ − ∇F/(1/σ²)
            z = (1 - damping) * new + damping * z
        out = sa.compile(program)(x, z0, update, damping)
        assert (out - z).abs().max() < 1e-10, (update, damping)


def test_tolerance_stops_early_and_says_so():
    m = sa.models.hopfield(4, 4, beta=0.2, iteration=sa.IterationOptions(steps=500, tol=1e-9),
                           dtype=f64)
    r, Y = torch.randn(1, 2, 4, dtype=f64), torch.randn(1, 5, 4, dtype=f64)
    _, trace = sa.compile(m)(r, Y, return_trace=True)
    assert trace.converged is True and trace.steps < 500
    assert trace.free_energy.shape[0] == trace.steps + 1
    s = trace.states["state"]
    assert (s[-1] - s[-2]).abs().max() <= 1e-9


def test_trace_posteriors_per_step_and_last_posterior():
    m = sa.models.hopfield(4, 4, heads=2, d_k=2, iteration=sa.IterationOptions(steps=3), dtype=f64)
    r, Y = torch.randn(2, 3, 4, dtype=f64), torch.randn(2, 5, 4, dtype=f64)
    out, post, trace = sa.compile(m)(r, Y, return_posterior=True, return_trace=True,
                                     trace_posteriors=True)
    assert trace.posteriors["retrieve"].shape == (4, 2, 2, 3, 5)
    assert (trace.posteriors["retrieve"][-1] - post).abs().max() < 1e-14
    truth = sa.inference.exact(m, r, Y, latents={"state": trace.states["state"][-1]})
    assert (post - truth.marginals["retrieve"]).abs().max() < 1e-12


def _gradcheck_params(layer, inputs):
    names = [n for n, _ in layer.named_parameters()]
    params = tuple(p.detach().clone().requires_grad_() for p in layer.parameters())

    def f(*args):
        ins = args[:len(inputs)]
        return torch.func.functional_call(layer, dict(zip(names, args[len(inputs):], strict=True)),
                                          ins)

    ins = tuple(x.detach().clone().requires_grad_() for x in inputs)
    return torch.autograd.gradcheck(f, ins + params)


@pytest.mark.parametrize("T", [1, 3])
def test_gradcheck_one_step_and_unrolled_loop(T):
    m = sa.models.hopfield(4, 3, heads=2, d_k=2, iteration=sa.IterationOptions(steps=T), dtype=f64)
    assert _gradcheck_params(sa.compile(m), (torch.randn(2, 3, 4, dtype=f64),
                                             torch.randn(2, 4, 3, dtype=f64)))
    c = sa.models.slot_attention(2, 3, iters=T, recipe="collapsed", dtype=f64)
    assert _gradcheck_params(sa.compile(c), (torch.randn(1, 5, 3, dtype=f64),
                                             torch.randn(1, 2, 3, dtype=f64)))


def test_cccp_without_a_closed_form_is_refused():
    def mapped(x, z):
        lat = sa.latent("z", z)
        phi = sa.edges("f", sa.nodes("x", x), lat, sa.priors.Uniform())
        sa.potential(phi, sa.potentials.Mapped(sa.potentials.DotProduct(), parents=torch.tanh))
        return sa.infer(lat)

    def flat(x, z):
        lat = sa.latent("z", z, scale=None)
        phi = sa.edges("f", lat, sa.nodes("x", x), sa.priors.Uniform())
        sa.potential(phi, sa.potentials.DotProduct())
        return sa.infer(lat)

    x, z = torch.randn(1, 4, 3), torch.randn(1, 2, 3)
    with pytest.raises(ValueError, match="update='cccp' needs potentials"):
        sa.compile(mapped)(x, z)
    with pytest.raises(ValueError, match="flat prior"):
        sa.compile(flat)(x, z)


def test_gradient_rule_through_a_mapped_potential_uses_autograd():
    """No closed form: the engine differentiates the log-partition; F still descends."""
    W = torch.randn(3, 3, dtype=f64)

    def program(x, z):
        lat = sa.latent("z", z, update="gradient", step_size=0.05, steps=30)
        phi = sa.edges("f", sa.nodes("x", x), lat, sa.priors.Uniform())
        sa.potential(phi, sa.potentials.Mapped(sa.potentials.DotProduct(),
                                               parents=lambda s: torch.tanh(s @ W)))
        return sa.infer(lat)

    x, z = torch.randn(2, 6, 3, dtype=f64), torch.randn(2, 2, 3, dtype=f64)
    _, trace = sa.compile(program)(x, z, return_trace=True)
    assert (trace.free_energy[1:] - trace.free_energy[:-1]).max() < 0
    report = sa.inference.compare(program, x, z)
    assert report.max_abs_diff < 1e-9, str(report)


def test_state_dict_round_trip_and_float32(tmp_path):
    m = sa.models.slot_attention(3, 8, iters=2, hidden_dim=8, recipe="collapsed")
    path = tmp_path / "slots.pt"
    torch.save(m.state_dict(), path)
    m2 = sa.models.slot_attention(3, 8, iters=2, hidden_dim=8, recipe="collapsed")
    m2.load_state_dict(torch.load(path, weights_only=True))
    x, z = torch.randn(2, 10, 8), torch.randn(2, 3, 8)
    assert torch.equal(sa.compile(m)(x, z), sa.compile(m2)(x, z))
    h = sa.models.hopfield(8, iteration=sa.IterationOptions(steps=2)).to(torch.bfloat16)
    y = sa.compile(h)(torch.randn(2, 3, 8, dtype=torch.bfloat16),
                      torch.randn(2, 5, 8, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()


def test_torch_compile_traces_the_loop_in_one_graph():
    import torch._dynamo

    cases = [(sa.models.hopfield(8, heads=2, iteration=sa.IterationOptions(steps=3)),
              (torch.randn(2, 3, 8), torch.randn(2, 5, 8))),
             (sa.models.slot_attention(3, 8, iters=2, hidden_dim=8), (torch.randn(2, 6, 8),
                                                                     torch.randn(2, 3, 8)))]
    for m, inputs in cases:
        layer = sa.compile(m)
        torch._dynamo.reset()
        explained = torch._dynamo.explain(layer)(*inputs)
        assert explained.graph_break_count == 0, explained.break_reasons
        torch.testing.assert_close(torch.compile(layer)(*inputs), layer(*inputs))


def test_ddp_single_process_iterative(tmp_path):
    import os

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)

    def check():  # its locals (the DDP reducer) die before the process group
        layer = sa.compile(sa.models.slot_attention(3, 8, iters=2, hidden_dim=8))
        x = torch.randn(2, 6, 8)
        torch.manual_seed(3)  # the initial slots μ + σ·ε are drawn: μ and σ get gradients
        out = DDP(layer)(x)
        torch.manual_seed(3)
        torch.testing.assert_close(out, layer(x))
        out.square().mean().backward()
        assert all(p.grad is not None for p in layer.parameters())

    try:
        check()
    finally:
        release_process_group()


@pytest.mark.parametrize("side", ["children", "parents"])
@pytest.mark.parametrize("heads", [1, 2])
def test_cccp_for_a_gaussian_potential_is_em_against_its_definition(side, heads):
    """A SquaredDistance potential on a latent with a learned prior N(loc, scale²): the
    update is computed as EM's weighted mean (loc/scale² + Σ b)/H, and equals μ − ∇F/H with
    ∇F by autograd of F written out and H = 1/scale² + E[−∂²ψ/∂μ²] — latent as children
    (H = 1/s² + 1/τ) or as parents (H = 1/s² + m_j/τ), one or two heads (τ per head); the
    prior's 1/scale² is computed once per forward, not once per step."""
    torch.manual_seed(heads)
    d = 4
    x, z0 = torch.randn(2, 6, d, dtype=f64), torch.randn(2, 3, d, dtype=f64)
    loc = torch.randn(1, 1, d, dtype=f64, requires_grad=True)
    scale = torch.tensor(0.7, dtype=f64, requires_grad=True)
    tau = torch.tensor([1.3, 0.6][:heads], dtype=f64)

    def program(x, z):
        obs = sa.nodes("x", x)
        lat = sa.latent("z", z, loc=loc, scale=scale, update="cccp", steps=3)
        ends = (lat, obs) if side == "children" else (obs, lat)
        phi = sa.edges("f", *ends, sa.priors.Uniform(), heads=heads)
        sa.potential(phi, sa.potentials.SquaredDistance(temperature=tau, heads=heads))
        return sa.infer(lat)

    def split(t):  # (b, n, H·d/H) → (b, H, n, d/H)
        return t.reshape(*t.shape[:-1], heads, d // heads).transpose(-2, -3)

    t = tau.reshape(heads, 1, 1)

    def F(z):
        c, p = (split(z), split(x)) if side == "children" else (split(x), split(z))
        psi = -0.5 * ((c[..., :, None, :] - p[..., None, :, :]) ** 2).sum(-1) / t
        return (0.5 * ((z - loc) / scale) ** 2).sum() - torch.logsumexp(psi, -1).sum()

    z = z0.clone()
    for _ in range(3):
        zz = z.detach().requires_grad_()
        (g,) = torch.autograd.grad(F(zz), zz)
        c, p = (split(zz), split(x)) if side == "children" else (split(x), split(zz))
        psi = -0.5 * ((c[..., :, None, :] - p[..., None, :, :]) ** 2).sum(-1) / t
        per_node = 1 / t if side == "children" else psi.softmax(-1).sum(-2)[..., None] / t
        curv = per_node.expand(2, heads, 3, d // heads)  # m_j/τ for parents: posterior mass
        H = scale.detach() ** -2 + curv.transpose(-2, -3).reshape(2, 3, d)
        z = (z - g / H).detach()
    layer = sa.compile(program)
    out = layer(x, z0)
    assert (out - z).abs().max() < 1e-10
    out.sum().backward()  # the prior's parameters receive gradients through every step
    assert loc.grad is not None and bool(loc.grad.ne(0).any()) and scale.grad.ne(0)
    layer(x, z0)
    layer(x, z0)  # recorded: 1/scale² once per forward, whatever the step count
    (plan,) = layer.plans.values()
    pows = [n for n in plan.graph.graph.nodes if "pow" in str(n.target)]
    assert plan.graph is not None and len(pows) == 1
