"""Slot attention. Oracles: the `slot-attention` package itself, a hand-written EM loop of the
collapsed recipe, Pyro's MAP."""

import pytest
import torch

import structattn as sa

f64 = torch.float64


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
