"""Block-slot attention: two edge families on one latent node set (inputs → slots, slot
blocks → prototypes). Oracles: slot attention (the one-block, no-memory limit), a
hand-written EM loop, Pyro's loss and MAP."""

import pytest
import torch

import structattn as sa

f64 = torch.float64


def test_one_block_without_memory_is_slot_attention():
    sa_model = sa.models.slot_attention(3, 8, iters=3, hidden_dim=16, dtype=f64)
    bs = sa.models.block_slot_attention(3, 8, num_blocks=1, num_prototypes=0, iters=3,
                                        hidden_dim=16, dtype=f64)
    state = sa_model.state_dict()
    for k in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):  # GRUCell → one block
        state[f"gru.{k}"] = state[f"gru.{k}"].unsqueeze(0)
    for i in (0, 2):
        state[f"mlp.{i}.weight"] = state[f"mlp.{i}.weight"].unsqueeze(0)
        state[f"mlp.{i}.bias"] = state[f"mlp.{i}.bias"].unsqueeze(0)
    bs.load_state_dict(state)
    x, z = torch.randn(2, 10, 8, dtype=f64), torch.randn(2, 3, 8, dtype=f64)
    assert (sa.compile(bs)(x, z) - sa.compile(sa_model)(x, z)).abs().max() < 1e-12


def test_original_recipe_reads_the_memory_per_block():
    """The last operation of a step: each block becomes Σ_k p(ω = k) C_k with
    p(ω = k) = softmax_k(⟨z_block, C_k⟩/√d) at the state after the GRU and MLP."""
    m = sa.models.block_slot_attention(2, 6, num_blocks=3, num_prototypes=4, iters=1,
                                       hidden_dim=6, dtype=f64)
    x, z0 = torch.randn(2, 5, 6, dtype=f64), torch.randn(2, 2, 6, dtype=f64)
    out, post = sa.compile(m)(x, z0, return_posterior=True)
    assert set(post) == {"assign", "bind"} and post["bind"].shape == (2, 3, 2, 4)
    # by hand: the slot step, then the read
    xn = m.norm_input(x)
    k, v = m.to_k(xn), m.to_v(xn)
    q = m.to_q(m.norm_slots(z0))
    p = torch.softmax(k @ q.transpose(-1, -2) / m.temperature, -1) + m.eps  # (B, N, S)
    w = p / p.sum(-2, keepdim=True)
    z = m.gru(w.transpose(-1, -2) @ v, z0)
    z = z + m.mlp(m.norm_pre_ff(z))
    blocks = z.unflatten(-1, (3, 2))  # (B, S, M, d)
    C = m.prototypes  # (M, K, d)
    scores = torch.einsum("bsmd,mkd->bsmk", blocks, C) / m.memory_temperature
    read = torch.einsum("bsmk,mkd->bsmd", torch.softmax(scores, -1), C).flatten(-2)
    assert (out - read).abs().max() < 1e-12


def block_em_loop(m, x, z, T):
    """EM for the collapsed recipe, written out: both families Gaussian."""
    k = m.to_k(m.norm_input(x))
    mu, prec = m.slots_mu, m.slots_logsigma.exp() ** -2
    tau, tau_m, M, d = m.temperature, m.memory_temperature, m.num_blocks, m.block_size
    C = m.prototypes  # (M, K, d)
    for _ in range(T):
        p = torch.softmax(-((k[:, :, None] - z[:, None]) ** 2).sum(-1) / (2 * tau), -1)  # (B,N,S)
        zb = z.unflatten(-1, (M, d))  # (B, S, M, d)
        r = torch.softmax(-((zb[:, :, :, None] - C) ** 2).sum(-1) / (2 * tau_m), -1)  # (B,S,M,K)
        pull_m = torch.einsum("bsmk,mkd->bsmd", r, C).flatten(-2) / tau_m
        z = (mu * prec + p.transpose(1, 2) @ k / tau + pull_m) / (
            prec + p.sum(1)[..., None] / tau + 1 / tau_m)
    return z


def test_collapsed_recipe_is_em_descends_and_reaches_pyros_map():
    m = sa.models.block_slot_attention(3, 4, num_blocks=2, num_prototypes=3, iters=30,
                                       recipe="collapsed", dtype=f64)
    x, z0 = torch.randn(2, 8, 4, dtype=f64), torch.randn(2, 3, 4, dtype=f64)
    out, trace = sa.compile(m)(x, z0, return_trace=True)
    assert (out - block_em_loop(m, x, z0, 30)).abs().max() < 1e-10
    assert (trace.free_energy[1:] - trace.free_energy[:-1]).max() <= 1e-10
    with sa.iteration(steps=3000, tol=1e-13):
        report = sa.inference.compare(m, x, z0)
    assert report.max_abs_diff < 1e-9, str(report)
    assert report.fixed_point["slots"] < 1e-4, str(report)


def test_gradcheck_one_step():
    for recipe in ("original", "collapsed"):
        m = sa.models.block_slot_attention(2, 4, num_blocks=2, num_prototypes=2, iters=1,
                                           hidden_dim=4, recipe=recipe, dtype=f64)
        layer = sa.compile(m)
        names = [n for n, _ in layer.named_parameters()]
        x, z = torch.randn(1, 3, 4, dtype=f64), torch.randn(1, 2, 4, dtype=f64)

        def f(x, z, *ps, layer=layer, names=names):
            return torch.func.functional_call(layer, dict(zip(names, ps, strict=True)), (x, z))

        params = tuple(p.detach().clone().requires_grad_() for p in layer.parameters())
        assert torch.autograd.gradcheck(f, (x.requires_grad_(), z.requires_grad_(), *params))


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_blocks=0, num_prototypes=2), "num_blocks"),
    (dict(num_blocks=3, num_prototypes=2), "divisible"),
    (dict(num_blocks=2, num_prototypes=-1), "num_prototypes"),
    (dict(num_blocks=2, num_prototypes=0, recipe="collapsed"), "num_prototypes ≥ 1"),
    (dict(num_blocks=2, num_prototypes=2, memory_temperature=0.0), "temperature"),
])
def test_bad_configurations_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sa.models.block_slot_attention(3, 8, **kwargs)
