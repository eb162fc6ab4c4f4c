"""The structure reading: the posterior is the gradient of the log-partition function."""

import torch

import structattn as sa


def _x(*shape):
    return torch.randn(*shape, dtype=torch.float64)


def test_posterior_is_gradient_of_log_partition():
    """p(φ_i = · | x) = ∂ log Z_i / ∂ψ_i — autograd as an oracle (torch-struct's reading)."""
    m = sa.models.self_attention(5, d_k=3, heads=1, causal=True, dtype=torch.float64)
    x = _x(1, 6, 5)
    s = sa.trace_structure(m.model, x)
    fam = s.families["attn"]
    psi = fam.potentials[0].pairwise(x, x).detach().requires_grad_()
    log_prior = s.log_prior("attn")
    logZ = torch.logsumexp(psi + log_prior, -1).sum()
    (grad,) = torch.autograd.grad(logZ, psi)
    torch.testing.assert_close(grad, s.posterior("attn"), atol=1e-12, rtol=0)
