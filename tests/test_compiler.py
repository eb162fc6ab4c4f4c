"""Compiled modules differentiate correctly: gradcheck of the dense path, with and without
the posterior, masked and with a log-prior bias."""

import pytest
import torch

import structattn as sa

from .reference import random_support


def _x(*shape):
    return torch.randn(*shape, dtype=torch.float64)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("return_posterior", [False, True])
def test_gradcheck(causal, return_posterior):
    m = sa.models.self_attention(5, d_k=2, d_v=3, heads=2, causal=causal, dtype=torch.float64)
    layer = sa.compile(m)
    x = _x(2, 3, 5).requires_grad_()

    def f(x, W_q, W_k, W_v, W_o):
        weights = {"declaration.W_q": W_q, "declaration.W_k": W_k, "declaration.W_v": W_v,
                   "declaration.W_o": W_o}
        out = torch.func.functional_call(layer, weights, (x,),
                                         {"return_posterior": return_posterior})
        return out if not return_posterior else out[0] + out[1].sum()

    params = [p.detach().clone().requires_grad_() for p in (m.W_q, m.W_k, m.W_v, m.W_o)]
    assert torch.autograd.gradcheck(f, (x, *params))


def test_gradcheck_masked_and_bias():
    logits = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    support = random_support(4, 4, generator=torch.Generator().manual_seed(1))
    W = [torch.randn(6, 5, dtype=torch.float64, requires_grad=True) for _ in range(3)]

    def program(x, logits, W_q, W_k, W_v):
        n = sa.nodes("x", x)
        phi = sa.edges("attn", n, n, sa.priors.Categorical(logits, support=support), heads=2)
        sa.potential(phi, sa.potentials.Bilinear(W_q, W_k, heads=2))
        return sa.value(phi, sa.values.Linear(W_v, heads=2))

    x = _x(2, 4, 5).requires_grad_()
    layer = sa.compile(program)
    assert torch.autograd.gradcheck(lambda *a: layer(*a), (x, logits, *W))
