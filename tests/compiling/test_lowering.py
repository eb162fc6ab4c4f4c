"""Review fix: each support kind has one operator, chosen from the prior's stated support."""

import pytest
import torch

import structattn as sa

from ..reference import heads_of, softmax_attention

TOL = 1e-6
F64 = torch.float64


@pytest.mark.parametrize("prior, kind", [
    (sa.priors.Uniform(), sa.kinds.DenseOperator),
    (sa.priors.Uniform(causal=True), sa.kinds.DenseOperator),
    (sa.priors.Uniform(support=torch.ones(3, 3, dtype=torch.bool)), sa.kinds.DenseOperator),
    (sa.priors.Categorical(torch.zeros(3, 3)), sa.kinds.DenseOperator),
    (sa.priors.ALiBi(2), sa.kinds.DenseOperator),
    (sa.priors.Uniform(edge_index=torch.zeros(2, 1, dtype=torch.long)), sa.kinds.EdgeListOperator),
    (sa.priors.Uniform(edge_index=torch.zeros(2, 1, dtype=torch.long), causal=True),
     sa.kinds.EdgeListOperator),
])
def test_each_prior_has_one_support_kind(prior, kind):
    assert prior.reading(prior.support(3, 3)) is kind


class Band(sa.kinds.Support):
    """|i − j| ≤ width, as a new support kind would state it."""

    def __init__(self, width):
        self.width = width

    def contains(self, child, parent):
        return (child - parent).abs() <= self.width


class BandOperator(sa.kinds.Operator):
    """A new kind's fast path is one class: here, the band lowered through a masked SDPA call."""

    lowered = 0

    def attend(self, u):
        type(self).lowered += 1
        C, P = self.family.children.size, self.family.parents.size
        i, j = torch.arange(C)[:, None], torch.arange(P)[None, :]
        a, b, scale = self.fused_factors()
        mask = (i - j).abs() <= self.family.support.width
        return torch.nn.functional.scaled_dot_product_attention(a, b, u, attn_mask=mask, scale=scale)


Band.operator = BandOperator


class BandPrior(sa.priors.Prior):
    def __init__(self, width):
        self.width = width

    def support(self, num_children, num_parents):
        return Band(self.width)


def test_a_new_support_kind_is_one_class():
    g = torch.Generator().manual_seed(0)
    W = [torch.randn(6, 4, generator=g, dtype=F64) for _ in range(3)]

    def program(x):
        n = sa.nodes("x", x)
        phi = sa.edges("band", n, n, BandPrior(1), heads=2)
        sa.potential(phi, sa.potentials.Bilinear(W[0], W[1], heads=2))
        return sa.value(phi, sa.values.Linear(W[2], heads=2))

    x = torch.randn(2, 5, 4, generator=g, dtype=F64)
    BandOperator.lowered = 0
    out = sa.compile(program)(x)
    assert BandOperator.lowered == 1
    i, j = torch.arange(5)[:, None], torch.arange(5)[None, :]
    ref, _ = softmax_attention(W[0], W[1], W[2], None, x, x, 2, mask=(i - j).abs() <= 1)
    torch.testing.assert_close(out, heads_of(ref, 2), atol=TOL, rtol=0)

    class NotAnOperator:
        pass

    class Wrong(Band):
        operator = NotAnOperator

    class WrongPrior(BandPrior):
        def support(self, num_children, num_parents):
            return Wrong(self.width)

    def wrong(x):
        n = sa.nodes("x", x)
        phi = sa.edges("band", n, n, WrongPrior(1), heads=2)
        sa.potential(phi, sa.potentials.Bilinear(W[0], W[1], heads=2))
        return sa.value(phi, sa.values.Linear(W[2], heads=2))

    with pytest.raises(ValueError, match="not a structattn.kinds.Operator subclass"):
        sa.compile(wrong)(x)


def test_edge_list_kind_refuses_unfactorised_potentials():
    class Table(sa.potentials.base.Potential):
        def pairwise(self, children, parents):
            return children.sum(-1)[..., None, :, None] * parents.sum(-1)[..., None, None, :]

    def program(x, edge_index):
        n = sa.nodes("x", x)
        phi = sa.edges("g", n, n, sa.priors.Uniform(edge_index=edge_index))
        sa.potential(phi, Table())
        return sa.value(phi, sa.values.Identity())

    ei = torch.stack([torch.arange(3), torch.arange(3)])
    with pytest.raises(NotImplementedError, match=r"edge family 'g': an edge-list support needs "
                                                  r"exactly one factorised potential"):
        sa.compile(program)(torch.randn(1, 3, 2, dtype=F64), ei)
