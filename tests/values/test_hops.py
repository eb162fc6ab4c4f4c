"""Multihop values (Hops): the Pyro reading builds its later hops from the prior and the
declared potentials (``potential.at``), never from the compiler's score tables; a walk over
an edge list; empty="zero" refused."""

import pytest
import torch

import structattn as sa
import structattn.compiling.lowering
from structattn.kinds import DenseOperator as FamilyOperator
from structattn.potentials.base import Potential

from ..programs import one_family_program
from ..reference import heads_of, random_graph, softmax_attention

TOL = 1e-6


def _x(*shape, generator=None):
    return torch.randn(*shape, dtype=torch.float64, generator=generator)


class PairwiseOnly(Potential):
    """A potential with a dense table and no factorised form: ψ(x_j, x_i) = −|c_i − c_j|·w."""

    heads = 2

    def __init__(self, w):
        self.w = w  # (heads,)

    def pairwise(self, children, parents):
        c, p = children.sum(-1), parents.sum(-1)  # (*batch, C), (*batch, P)
        return -(c[..., None, :, None] - p[..., None, None, :]).abs() * self.w[:, None, None]


def _walk_reference(x, W, weights, log_prior, pairwise):
    """Σ_k w_k P^k V X per head, P = softmax(ψ + log prior), written from the maths."""
    H = 2
    heads = lambda t: t.unflatten(-1, (H, t.shape[-1] // H)).transpose(-3, -2)  # noqa: E731
    q, k, v = heads(x @ W[0].T), heads(x @ W[1].T), heads(x @ W[2].T)
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5 + log_prior
    if pairwise is not None:
        s = s + pairwise
    P = s.softmax(-1)
    out, u = weights[0] * v, v
    for w in weights[1:]:
        u = P @ u
        out = out + w * u
    return out


def _program(W, weights, prior, extra=None):
    def program(x):
        n = sa.nodes("x", x)
        phi = sa.edges("walk", n, n, prior, heads=2)
        sa.potential(phi, sa.potentials.Bilinear(W[0], W[1], heads=2))
        if extra is not None:
            sa.potential(phi, extra)
        return sa.value(phi, sa.values.Hops(W[2], weights, heads=2))
    return program


@pytest.mark.parametrize("prior_kind", ["uniform", "causal", "categorical"])
def test_pyro_hops_never_read_the_compiler_tables(monkeypatch, prior_kind):
    g = torch.Generator().manual_seed(3)
    n, d, weights = 5, 4, (0.3, 1.0, -0.5, 0.7)
    W = [_x(4, d, generator=g) for _ in range(3)]
    x = _x(2, n, d, generator=g)
    logits = _x(2, n, n, generator=g)
    prior = {"uniform": sa.priors.Uniform(), "causal": sa.priors.Uniform(causal=True),
             "categorical": sa.priors.Categorical(logits)}[prior_kind]
    log_prior = {"uniform": torch.zeros(n, n),
                 "causal": torch.zeros(n, n).masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(),
                                                         float("-inf")),
                 "categorical": logits}[prior_kind].to(torch.float64)
    ref = _walk_reference(x, W, weights, log_prior, None)

    def refuse(*args, **kwargs):
        raise AssertionError("the Pyro reading used the compiler's score tables")

    monkeypatch.setattr(FamilyOperator, "_table", refuse)  # the compiler's score table
    monkeypatch.setattr(Potential, "pairwise", refuse)
    for name in ("log_weights", "log_prob_table", "sdpa_inputs"):  # the compiled tables
        monkeypatch.setattr(structattn.priors.tables.PriorTables, name, refuse)
    for name in ("expectation", "posterior", "operator_for"):
        monkeypatch.setattr(structattn.compiling.lowering, name, refuse)
    truth = sa.inference.exact(_program(W, weights, prior), x)
    torch.testing.assert_close(truth.expectations["walk"], ref, atol=TOL, rtol=0)


def test_pyro_hops_with_a_pairwise_potential_and_bias_match_the_maths():
    """Two potentials (one without factors) and a per-head log prior: the later hops of the
    Pyro walk use both potentials and the prior, as the first hop's factor sites do."""
    g = torch.Generator().manual_seed(5)
    n, d, weights = 4, 4, (0.0, 1.0, 1.0, 0.5)
    W = [_x(4, d, generator=g) for _ in range(3)]
    x = _x(3, n, d, generator=g)
    logits = _x(2, n, n, generator=g)
    extra = PairwiseOnly(torch.tensor([0.7, 1.3], dtype=torch.float64))
    program = _program(W, weights, sa.priors.Categorical(logits), extra)
    pairwise = extra.pairwise(x, x)
    ref = _walk_reference(x, W, weights, logits, pairwise)
    truth = sa.inference.exact(program, x)
    torch.testing.assert_close(truth.expectations["walk"], ref, atol=TOL, rtol=0)
    torch.testing.assert_close(sa.compile(program)(x), ref, atol=TOL, rtol=0)


def test_multihop_walks_an_edge_list():
    """A user's declaration: multihop values over a sparse graph, K attention calls, no P^k."""
    g = torch.Generator().manual_seed(2)
    mask, edge_index = random_graph(7, g)
    W = [torch.randn(4, 5, generator=g, dtype=torch.float64) for _ in range(3)]

    def program(x, adjacency):
        n = sa.nodes("x", x)
        phi = sa.edges("walk", n, n, sa.priors.Uniform(edge_index=adjacency), heads=2)
        sa.potential(phi, sa.potentials.Bilinear(W[0], W[1], heads=2))
        return sa.value(phi, sa.values.Hops(W[2], (0.2, 1.0, -0.5, 0.3), heads=2))

    x = torch.randn(2, 7, 5, dtype=torch.float64)
    _, P = softmax_attention(W[0], W[1], W[2], None, x, x, 2, mask=mask)
    V = heads_of(x @ W[2].T, 2)
    ref = sum(w * torch.linalg.matrix_power(P, k) @ V
              for k, w in enumerate((0.2, 1.0, -0.5, 0.3)))
    torch.testing.assert_close(sa.compile(program)(x, edge_index), ref, atol=TOL, rtol=0)
    assert sa.inference.compare(program, x, edge_index).max_abs_diff < TOL


def test_hops_refuse_empty_zero():
    mask = torch.ones(5, 5, dtype=torch.bool)
    mask[2] = False
    program, _ = one_family_program(lambda m: sa.priors.Uniform(support=m, empty="zero"),
                                     value=lambda W, h: sa.values.Hops(W, (0, 1, 1), heads=h))
    with pytest.raises(ValueError, match=r"edge family 'attn': empty='zero' .* Hops value walks"):
        sa.compile(program)(_x(1, 5, 4), mask)
