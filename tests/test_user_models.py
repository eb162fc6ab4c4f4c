"""Models a user writes themselves — not from the catalogue — compile and check the same way."""

import torch
from torch import nn

import structattn as sa

from .reference import softmax_attention

TOL = 1e-6


class RecencyMemoryReader(sa.Declaration):
    """Queries read a memory with a learned categorical prior over slots, plus a residual.

    φ_i ~ Categorical(b_i·), ψ = q_iᵀW_QᵀW_K m_j / τ (τ = 2), v = W_V m_j, y_i = q_i + E[v_i].
    """

    def __init__(self, d, slots, queries, heads=2):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.heads = heads
        self.log_prior = nn.Parameter(torch.randn(heads, queries, slots, generator=g,
                                                  dtype=torch.float64))
        self.W_q = nn.Parameter(torch.randn(heads * 3, d, generator=g, dtype=torch.float64))
        self.W_k = nn.Parameter(torch.randn(heads * 3, d, generator=g, dtype=torch.float64))
        self.W_v = nn.Parameter(torch.randn(d, d, generator=g, dtype=torch.float64))

    def model(self, queries, memory):
        q = sa.nodes("queries", queries)
        m = sa.nodes("memory", memory)
        phi = sa.edges("read", q, m, sa.priors.Categorical(self.log_prior), heads=self.heads)
        sa.potential(phi, sa.potentials.Bilinear(self.W_q, self.W_k, heads=self.heads,
                                                 temperature=2.0))
        return queries + sa.merge_heads(sa.value(phi, sa.values.Linear(self.W_v,
                                                                      heads=self.heads)))


def test_user_declaration_against_reference_and_pyro():
    d, slots, nq = 6, 7, 5
    model = RecencyMemoryReader(d, slots, nq)
    q = torch.randn(3, nq, d, dtype=torch.float64)
    mem = torch.randn(3, slots, d, dtype=torch.float64)
    y, post = sa.compile(model)(q, mem, return_posterior=True)
    ref, p_ref = softmax_attention(model.W_q, model.W_k, model.W_v, None, q, mem, 2,
                                   bias=model.log_prior, temperature=2.0)
    torch.testing.assert_close(y, q + ref, atol=TOL, rtol=0)
    torch.testing.assert_close(post, p_ref, atol=TOL, rtol=0)
    torch.testing.assert_close(sa.compile(model)(q, mem), q + ref, atol=TOL, rtol=0)
    report = sa.inference.compare(model, q, mem)
    assert report.max_abs_diff < TOL, str(report)


def test_user_declaration_gradcheck_including_prior_logits():
    model = RecencyMemoryReader(4, 3, 2)
    layer = sa.compile(model)
    q = torch.randn(2, 2, 4, dtype=torch.float64, requires_grad=True)
    mem = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    names = [n for n, _ in layer.named_parameters()]

    def f(q, mem, *params):
        return torch.func.functional_call(layer, dict(zip(names, params, strict=True)),
                                          (q, mem))

    params = [p.detach().clone().requires_grad_() for p in layer.parameters()]
    assert torch.autograd.gradcheck(f, (q, mem, *params))


def test_plain_function_program_with_two_families():
    """Two edge families in one program (a causal one and a cross one), declared in a function."""
    g = torch.Generator().manual_seed(5)
    W = {k: torch.randn(4, 5, generator=g, dtype=torch.float64) for k in
         ("q1", "k1", "v1", "q2", "k2")}
    W["v2"] = torch.randn(4, 5, generator=g, dtype=torch.float64)

    def program(x, context):
        tokens = sa.nodes("tokens", x)
        ctx = sa.nodes("context", context)
        past = sa.edges("past", tokens, tokens, sa.priors.Uniform(causal=True))
        sa.potential(past, sa.potentials.Bilinear(W["q1"], W["k1"]))
        h = sa.value(past, sa.values.Linear(W["v1"]))[..., 0, :, :]  # (B, n, 4)
        look = sa.edges("look", tokens, ctx, sa.priors.Uniform())
        sa.potential(look, sa.potentials.Bilinear(W["q2"], W["k2"]))
        return h @ W["v2"] + sa.value(look, sa.values.Linear(W["v1"]))[..., 0, :, :] @ W["v2"]

    x = torch.randn(2, 5, 5, dtype=torch.float64)
    c = torch.randn(2, 3, 5, dtype=torch.float64)
    y, posts = sa.compile(program)(x, c, return_posterior=True)
    assert set(posts) == {"past", "look"}
    h_ref, p_past = softmax_attention(W["q1"], W["k1"], W["v1"], None, x, x, 1, causal=True)
    l_ref, p_look = softmax_attention(W["q2"], W["k2"], W["v1"], None, x, c, 1)
    torch.testing.assert_close(y, (h_ref + l_ref) @ W["v2"], atol=TOL, rtol=0)
    torch.testing.assert_close(posts["past"], p_past, atol=TOL, rtol=0)
    report = sa.inference.compare(program, x, c)
    assert report.max_abs_diff < TOL, str(report)
    assert set(report.posteriors) == {"past", "look"}


def test_pyro_reading_samples_edges_inside_the_support():
    """Run as plain Pyro, the declaration samples φ from its prior: never outside the support."""
    import pyro
    from pyro import poutine

    m = sa.models.self_attention(4, d_k=2, heads=3, causal=True, dtype=torch.float64)
    x = torch.randn(2, 6, 4, dtype=torch.float64)
    pyro.set_rng_seed(0)
    tr = poutine.trace(m.model).get_trace(x)
    phi = tr.nodes["attn"]["value"]
    assert phi.shape == (2, 3, 6)
    assert bool((phi <= torch.arange(6)).all())
    assert tr.nodes["attn.potential0"]["fn"].log_factor.shape == (2, 3, 6)
    assert m(x).shape == (2, 6, 4)  # calling the declaration runs the Pyro program
