"""The iterative engine: latent node sets, collapsed free energies, update rules, ground truth.

Oracles: hand-written float64 loops of the published equations (Hopfield, slot attention),
the `slot-attention` package itself, Pyro's TraceEnum_ELBO loss (the free energy at a
state) and Pyro's MAP with a point-mass guide (the fixed point), autograd (the
closed-form expected gradients).
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import structattn as sa
from structattn.iterate import Step
from structattn.kinds import DenseOperator as FamilyOperator

f64 = torch.float64


def split(t, heads):  # (B, n, H·d) -> (B, H, n, d), written out independently of the library
    B, n, hd = t.shape
    return t.reshape(B, n, heads, hd // heads).permute(0, 2, 1, 3)


def merge(t):
    B, H, n, d = t.shape
    return t.permute(0, 2, 1, 3).reshape(B, n, H * d)


def hopfield_loop(m, r, Y, T):
    """Ramsauer et al.'s retrieval, per head: ξ₀ = W_q r; ξ ← Kᵀ softmax(βKξ) T times;
    output W_o concat_h(Vᵀ softmax(βKξ_T))."""
    K, V = split(Y @ m.W_k.T, m.heads), split(Y @ m.W_v.T, m.heads)
    xi = split(r @ m.W_q.T, m.heads)
    for _ in range(T):
        xi = torch.softmax(m.beta * xi @ K.transpose(-1, -2), -1) @ K
    out = merge(torch.softmax(m.beta * xi @ K.transpose(-1, -2), -1) @ V)
    return out @ m.W_o.T, xi


# -- Hopfield -------------------------------------------------------------------------------
@pytest.mark.parametrize("T", [0, 1, 2, 3])
@pytest.mark.parametrize("heads", [1, 4])
def test_hopfield_equals_hand_written_loop(T, heads):
    m = sa.models.hopfield(7, 5, heads=heads, d_k=3, d_v=2, update_steps=T, dtype=f64)
    r, Y = torch.randn(2, 3, 7, dtype=f64), torch.randn(2, 11, 5, dtype=f64)
    ref, xi = hopfield_loop(m, r, Y, T)
    out, trace = sa.compile(m)(r, Y, return_trace=True)
    assert (out - ref).abs().max() < 1e-10
    assert trace.steps == T and trace.states["state"].shape == (T + 1, 2, 3, heads * 3)
    assert (trace.states["state"][-1] - merge(xi)).abs().max() < 1e-10


@settings(max_examples=25, deadline=None, derandomize=True)
@given(B=st.integers(1, 3), M=st.integers(1, 5), N=st.integers(1, 7), heads=st.integers(1, 3),
       d_k=st.integers(1, 4), T=st.integers(0, 4), beta=st.floats(0.05, 3.0))
def test_hopfield_random_sizes(B, M, N, heads, d_k, T, beta):
    m = sa.models.hopfield(5, 3, heads=heads, d_k=d_k, d_v=2, beta=beta, update_steps=T,
                           dtype=f64)
    r, Y = torch.randn(B, M, 5, dtype=f64), torch.randn(B, N, 3, dtype=f64)
    ref, _ = hopfield_loop(m, r, Y, T)
    assert (sa.compile(m)(r, Y) - ref).abs().max() < 1e-10


def test_hopfield_free_energy_is_ramsauers_energy_and_never_increases():
    m = sa.models.hopfield(6, 6, heads=2, d_k=3, beta=2.0, update_steps=20, dtype=f64)
    r, Y = torch.randn(3, 4, 6, dtype=f64), 2 * torch.randn(3, 9, 6, dtype=f64)
    _, trace = sa.compile(m)(r, Y, return_trace=True)
    F = trace.free_energy  # (21, 3)
    assert F.shape == (21, 3)
    assert (F[1:] - F[:-1]).max() <= 1e-12
    # F = β·E + const with E Ramsauer et al.'s energy: the constant is the same at every step
    E = torch.stack([m.energy(s, Y) for s in trace.states["state"]])
    const = F - m.beta * E
    assert (const - const[0]).abs().max() < 1e-10
    n, d = 4 * 2, 3  # queries·heads, d_k
    expected = n * (0.5 * d * math.log(2 * math.pi / m.beta) + math.log(9))
    assert (const - expected).abs().max() < 1e-10


def test_free_energy_equals_pyros_loss_at_every_step():
    m = sa.models.hopfield(5, 4, heads=2, d_k=2, beta=1.5, update_steps=4, dtype=f64)
    r, Y = torch.randn(2, 3, 5, dtype=f64), torch.randn(2, 6, 4, dtype=f64)
    with torch.no_grad():
        _, trace = sa.compile(m)(r, Y, return_trace=True)
    for t in range(5):
        truth = sa.inference.exact(m, r, Y, latents={"state": trace.states["state"][t]})
        assert abs(float(trace.free_energy[t].sum()) - truth.free_energy) < 1e-9


def test_hopfield_fixed_point_is_pyro_map():
    # β·max‖k‖² < 1: the energy is strictly convex, so the fixed point is the unique MAP
    m = sa.models.hopfield(6, 5, heads=2, d_k=3, d_v=2, beta=0.3, dtype=f64)
    r, Y = torch.randn(2, 3, 6, dtype=f64), 0.5 * torch.randn(2, 7, 5, dtype=f64)
    with sa.iteration(steps=2000, tol=1e-13):
        report = sa.inference.compare(m, r, Y)
    assert report.max_abs_diff < 1e-9, str(report)
    assert report.fixed_point["state"] < 1e-4, str(report)
    assert abs(report.fixed_point_free_energy) < 1e-8


def test_hopfield_update_steps_zero_is_cross_attention():
    m = sa.models.hopfield(6, 5, heads=2, d_k=3, d_v=4, dtype=f64)
    c = sa.models.cross_attention(6, 5, heads=2, d_k=3, d_v=4, temperature=math.sqrt(3),
                                  dtype=f64)
    c.load_state_dict(m.state_dict())
    r, Y = torch.randn(2, 3, 6, dtype=f64), torch.randn(2, 7, 5, dtype=f64)
    assert (sa.compile(m)(r, Y) - sa.compile(c)(r, Y)).abs().max() < 1e-12


# -- slot attention -------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (f64, 1e-10)])
def test_slot_attention_matches_the_slot_attention_package(dtype, tol):
    from slot_attention import SlotAttention as Peer

    peer = Peer(4, 16, iters=3, hidden_dim=32).to(dtype)
    m = sa.models.slot_attention(4, 16, iters=3, hidden_dim=32, dtype=dtype)
    m.load_state_dict(peer.state_dict())  # same parameter names
    x = torch.randn(3, 20, 16, dtype=dtype)
    torch.manual_seed(7)
    ref = peer(x)
    torch.manual_seed(7)  # the same noise for the initial slots
    init = peer.slots_mu + peer.slots_logsigma.exp() * torch.randn(3, 4, 16, dtype=dtype)
    layer = sa.compile(m)
    assert (layer(x, init) - ref).abs().max() < tol
    torch.manual_seed(7)  # drawn by the layer itself, as the package does
    assert (layer(x) - ref).abs().max() < tol
    ref.sum().backward()
    layer(x, init.detach()).sum().backward()


def slot_em_loop(m, x, z, T):
    """The Gaussian-mixture EM of the collapsed recipe, written out: softmax over slots of
    −‖z_s − k_j‖²/2τ, then z_s = (μ/σ² + Σ_j p_js k_j/τ) / (1/σ² + Σ_j p_js/τ)."""
    k = m.to_k(m.norm_input(x))
    mu, prec, tau = m.slots_mu, m.slots_logsigma.exp() ** -2, m.temperature
    for _ in range(T):
        d2 = ((k[:, :, None, :] - z[:, None, :, :]) ** 2).sum(-1)  # (B, N, S)
        p = torch.softmax(-d2 / (2 * tau), -1)
        z = (mu * prec + p.transpose(1, 2) @ k / tau) / (prec + p.sum(1)[..., None] / tau)
    return z


def test_collapsed_slots_are_em_and_descend():
    m = sa.models.slot_attention(4, 6, iters=25, recipe="collapsed", dtype=f64)
    x, z0 = torch.randn(2, 30, 6, dtype=f64), torch.randn(2, 4, 6, dtype=f64)
    out, trace = sa.compile(m)(x, z0, return_trace=True)
    assert (out - slot_em_loop(m, x, z0, 25)).abs().max() < 1e-10
    F = trace.free_energy
    assert F.shape == (26, 2) and (F[1:] - F[:-1]).max() <= 1e-10


def test_collapsed_slots_fixed_point_is_pyro_map():
    m = sa.models.slot_attention(3, 4, recipe="collapsed", dtype=f64)
    x, z0 = torch.randn(2, 9, 4, dtype=f64), torch.randn(2, 3, 4, dtype=f64)
    with sa.iteration(steps=3000, tol=1e-13):
        report = sa.inference.compare(m, x, z0)
    assert report.max_abs_diff < 1e-9, str(report)
    assert max(report.fixed_point.values()) < 1e-4, str(report)


def test_slot_count_can_change_per_call():
    m = sa.models.slot_attention(4, 8, iters=2, hidden_dim=8)
    x = torch.randn(2, 10, 8)
    assert sa.compile(m)(x, num_slots=6).shape == (2, 6, 8)
    post = sa.compile(m)(x, num_slots=2, return_posterior=True)[1]
    assert post.shape == (2, 1, 10, 2)  # (batch, head, inputs, slots): a softmax over slots
    assert torch.allclose(post.sum(-1), torch.ones(2, 1, 10))


# -- the engine's pieces against their definitions ------------------------------------------
def _family(potential_side, potential):
    """A latent on ``potential_side`` of one family, and an observed other side."""
    z = torch.randn(2, 3, 4, dtype=f64)
    x = torch.randn(2, 5, 4, dtype=f64)

    def program(z, x):
        obs = sa.nodes("x", x)
        lat = sa.latent("z", z)
        c, p = (lat, obs) if potential_side == "children" else (obs, lat)
        phi = sa.edges("f", c, p, sa.priors.Uniform(), heads=potential.heads)
        sa.potential(phi, potential)
        return sa.infer(lat)

    return program, z, x


@pytest.mark.parametrize("side", ["children", "parents"])
@pytest.mark.parametrize("make", [
    lambda: sa.potentials.Bilinear(torch.randn(6, 4, dtype=f64), torch.randn(6, 4, dtype=f64),
                                   heads=2, temperature=1.3),
    lambda: sa.potentials.Bilinear(None, torch.randn(4, 4, dtype=f64), heads=2, temperature=0.7),
    lambda: sa.potentials.DotProduct(heads=2, temperature=0.9),
    lambda: sa.potentials.SquaredDistance(temperature=1.7),
    lambda: sa.potentials.SquaredDistance(temperature=0.6, heads=2),
], ids=["bilinear", "bilinear-identity", "dot", "squared-distance", "squared-distance-heads"])
def test_closed_form_expected_gradient_is_the_log_partition_gradient(side, make):
    """Lemma 7.1: Σ_i ∇ log Σ_j exp ψ_ij = E_post[∇ψ] — the closed form against autograd."""
    psi = make()
    if isinstance(psi, sa.potentials.Bilinear) and psi.W_q is None and side == "parents":
        psi = sa.potentials.Bilinear(torch.randn(4, 4, dtype=f64), None, heads=2)
    program, z, x = _family(side, psi)
    reader = sa.readers.Marginalise(latent_values={"z": z.clone().requires_grad_()})
    with reader:
        program(z, x)
    fam, lat = reader.families["f"], reader.latents["z"]
    step = Step(sa.iterate.Engine([lat], dict(reader.families), {}), lat)
    closed = psi.expected_gradient(side, step.operator("f"))
    (auto,) = torch.autograd.grad(FamilyOperator(fam).log_partition().sum(), lat.states)
    assert closed is not None and (closed - auto).abs().max() < 1e-12


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
    m = sa.models.hopfield(4, 4, beta=0.2, update_steps=500, tol=1e-9, dtype=f64)
    r, Y = torch.randn(1, 2, 4, dtype=f64), torch.randn(1, 5, 4, dtype=f64)
    _, trace = sa.compile(m)(r, Y, return_trace=True)
    assert trace.converged is True and trace.steps < 500
    assert trace.free_energy.shape[0] == trace.steps + 1
    s = trace.states["state"]
    assert (s[-1] - s[-2]).abs().max() <= 1e-9


def test_trace_posteriors_per_step_and_last_posterior():
    m = sa.models.hopfield(4, 4, heads=2, d_k=2, update_steps=3, dtype=f64)
    r, Y = torch.randn(2, 3, 4, dtype=f64), torch.randn(2, 5, 4, dtype=f64)
    out, post, trace = sa.compile(m)(r, Y, return_posterior=True, return_trace=True,
                                     trace_posteriors=True)
    assert trace.posteriors["retrieve"].shape == (4, 2, 2, 3, 5)
    assert (trace.posteriors["retrieve"][-1] - post).abs().max() < 1e-14
    truth = sa.inference.exact(m, r, Y, latents={"state": trace.states["state"][-1]})
    assert (post - truth.marginals["retrieve"]).abs().max() < 1e-12


# -- gradients --------------------------------------------------------------------------------
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
    m = sa.models.hopfield(4, 3, heads=2, d_k=2, update_steps=T, dtype=f64)
    assert _gradcheck_params(sa.compile(m), (torch.randn(2, 3, 4, dtype=f64),
                                             torch.randn(2, 4, 3, dtype=f64)))
    c = sa.models.slot_attention(2, 3, iters=T, recipe="collapsed", dtype=f64)
    assert _gradcheck_params(sa.compile(c), (torch.randn(1, 5, 3, dtype=f64),
                                             torch.randn(1, 2, 3, dtype=f64)))


def test_last_step_only_gradient_is_one_step_from_the_detached_state():
    m = sa.models.hopfield(5, 4, heads=2, d_k=3, update_steps=4, grad="last", dtype=f64)
    r, Y = torch.randn(2, 3, 5, dtype=f64), torch.randn(2, 6, 4, dtype=f64)
    sa.compile(m)(r, Y).pow(2).sum().backward()
    got = {n: None if p.grad is None else p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad(set_to_none=True)
    # the definition: T − 1 steps without gradients, then one step that sees the parameters
    with torch.no_grad():
        _, xi = hopfield_loop(m, r, Y, 3)
    K, V = split(Y @ m.W_k.T, m.heads), split(Y @ m.W_v.T, m.heads)
    xi = torch.softmax(m.beta * xi @ K.transpose(-1, -2), -1) @ K
    out = merge(torch.softmax(m.beta * xi @ K.transpose(-1, -2), -1) @ V) @ m.W_o.T
    out.pow(2).sum().backward()
    assert got["W_q"] is None and m.W_q.grad is None  # the initial state is not differentiated
    for n in ("W_k", "W_v", "W_o"):
        assert (got[n] - getattr(m, n).grad).abs().max() < 1e-10, n


# -- bad input ------------------------------------------------------------------------------
@pytest.mark.parametrize("build,match", [
    (lambda: sa.models.hopfield(4, update_steps=-1), "update_steps"),
    (lambda: sa.models.hopfield(4, beta=0.0), "beta"),
    (lambda: sa.models.hopfield(4, beta=-1.0), "beta"),
    (lambda: sa.models.hopfield(4, update_steps=3, tol=0.0), "tol"),
    (lambda: sa.models.hopfield(4, update_steps=3, tol=-1e-3), "tol"),
    (lambda: sa.models.slot_attention(0, 8), "num_slots"),
    (lambda: sa.models.slot_attention(3, 8, recipe="nope"), "recipe"),
    (lambda: sa.models.slot_attention(3, 8, iters=-2), "steps"),
    (lambda: sa.latent("z", torch.randn(2, 3), scale=0.0), "scale"),
    (lambda: sa.latent("z", torch.randn(2, 3), damping=1.0), "damping"),
    (lambda: sa.latent("z", torch.randn(2, 3), update="newton"), "update"),
    (lambda: sa.latent("z", torch.randn(2, 3), grad="sometimes"), "grad"),
    (lambda: sa.latent("z", torch.randn(3)), "at least 2 dims"),
])
def test_bad_options_are_refused(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_bad_slots_and_slot_counts_are_refused():
    m = sa.models.slot_attention(3, 8, iters=1, hidden_dim=8)
    layer, x = sa.compile(m), torch.randn(2, 10, 8)
    with pytest.raises(ValueError, match=r"slots must have shape \(batch=2, num_slots, dim=8\)"):
        layer(x, torch.randn(2, 3, 7))
    with pytest.raises(ValueError, match="slots must have shape"):
        layer(x, torch.randn(3, 3, 8))
    with pytest.raises(ValueError, match="num_slots=4"):
        layer(x, torch.randn(2, 3, 8), num_slots=4)
    with pytest.raises(ValueError, match="num_slots must be a positive int"):
        layer(x, num_slots=0)
    with pytest.raises(ValueError, match=r"inputs must have shape \(batch, n, 8\)"):
        layer(torch.randn(2, 10, 5))
    with pytest.raises(ValueError, match="non-finite"):
        layer(x, torch.full((2, 3, 8), float("nan")))


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


def test_exact_on_a_latent_model_asks_for_latent_states():
    m = sa.models.hopfield(4, update_steps=2, dtype=f64)
    r, Y = torch.randn(1, 2, 4, dtype=f64), torch.randn(1, 3, 4, dtype=f64)
    with pytest.raises(ValueError, match="pass latents="):
        sa.inference.exact(m, r, Y)
    with pytest.raises(ValueError, match="not latent node sets"):
        sa.inference.exact(m, r, Y, latents={"nope": r})


def test_a_latent_in_no_family_is_refused():
    def program(x, z):
        lat = sa.latent("z", z)
        return sa.infer(lat)

    with pytest.raises(ValueError, match="in no edge family"):
        sa.compile(program)(torch.randn(1, 3, 2), torch.randn(1, 2, 2))


def test_state_dict_round_trip_and_float32(tmp_path):
    m = sa.models.slot_attention(3, 8, iters=2, hidden_dim=8, recipe="collapsed")
    path = tmp_path / "slots.pt"
    torch.save(m.state_dict(), path)
    m2 = sa.models.slot_attention(3, 8, iters=2, hidden_dim=8, recipe="collapsed")
    m2.load_state_dict(torch.load(path, weights_only=True))
    x, z = torch.randn(2, 10, 8), torch.randn(2, 3, 8)
    assert torch.equal(sa.compile(m)(x, z), sa.compile(m2)(x, z))
    h = sa.models.hopfield(8, update_steps=2).to(torch.bfloat16)
    y = sa.compile(h)(torch.randn(2, 3, 8, dtype=torch.bfloat16),
                      torch.randn(2, 5, 8, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()


# -- an ordinary module -------------------------------------------------------------------------
def test_torch_compile_traces_the_loop_in_one_graph():
    import torch._dynamo

    cases = [(sa.models.hopfield(8, heads=2, update_steps=3), (torch.randn(2, 3, 8),
                                                              torch.randn(2, 5, 8))),
             (sa.models.slot_attention(3, 8, iters=2, hidden_dim=8), (torch.randn(2, 6, 8),
                                                                     torch.randn(2, 3, 8)))]
    for m, inputs in cases:
        layer = sa.compile(m)
        torch._dynamo.reset()
        explained = torch._dynamo.explain(layer)(*inputs)
        assert explained.graph_break_count == 0, explained.break_reasons
        torch.testing.assert_close(torch.compile(layer)(*inputs), layer(*inputs))


def release_process_group():
    """Destroy the default process group once nothing else holds it. A DDP reducer that
    outlives ``destroy_process_group`` frees the gloo group in its own destructor, holding the
    GIL while joining gloo's threads, one of which may wait for the GIL: a deadlock (seen
    about once in a dozen runs with torch 2.13). So: drop the reducer first, then the group."""
    import gc

    import torch.distributed as dist

    gc.collect()
    dist.destroy_process_group()


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


def test_hopfield_without_projections_is_the_classical_network():
    m = sa.models.hopfield(6, heads=2, projections=False, beta=0.9, update_steps=3, dtype=f64)
    assert not list(m.parameters())
    r, Y = torch.randn(2, 3, 6, dtype=f64), torch.randn(2, 8, 6, dtype=f64)
    out, trace = sa.compile(m)(r, Y, return_trace=True)
    xi = split(r, 2)
    K = split(Y, 2)
    for _ in range(4):  # T updates, then the output's read: ξ_{T+1}
        xi = torch.softmax(0.9 * xi @ K.transpose(-1, -2), -1) @ K
    assert (out - merge(xi)).abs().max() < 1e-12
    per_query = m.energy(trace.states["state"][-1], Y, per_query=True)
    assert per_query.shape == (2, 3)
    assert torch.allclose(per_query.sum(-1), m.energy(trace.states["state"][-1], Y))
    with pytest.raises(ValueError, match="projections=False"):
        sa.models.hopfield(6, 4, projections=False)
