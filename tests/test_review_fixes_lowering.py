"""Review fix: support kinds are objects with one lowering rule each, chosen from the prior."""

import pytest
import torch

import structattn as sa
from structattn import lowering

from .reference import heads_of, softmax_attention

TOL = 1e-6
F64 = torch.float64


@pytest.mark.parametrize("prior, kind", [
    (sa.priors.Uniform(), lowering.DenseSupport),
    (sa.priors.Uniform(causal=True), lowering.DenseSupport),
    (sa.priors.Uniform(support=torch.ones(3, 3, dtype=torch.bool)), lowering.DenseSupport),
    (sa.priors.Categorical(torch.zeros(3, 3)), lowering.DenseSupport),
    (sa.priors.ALiBi(2), lowering.DenseSupport),
    (sa.priors.Uniform(edge_index=torch.zeros(2, 1, dtype=torch.long)), lowering.EdgeListSupport),
    (sa.priors.Uniform(edge_index=torch.zeros(2, 1, dtype=torch.long), causal=True),
     lowering.EdgeListSupport),
])
def test_each_prior_has_one_support_kind(prior, kind):
    assert type(lowering.support_kind(prior)) is kind


class Band(sa.priors.Prior):
    """|i − j| ≤ width, as a new support kind would state it (no dense mask of its own)."""

    def __init__(self, width):
        self.width = width


class BandSupport(lowering.SupportKind):
    """A new kind is one class: here, the band lowered through a masked SDPA call."""

    name = "band"
    lowered = 0

    def matches(self, prior):
        return isinstance(prior, Band)

    def lower(self, family, want_posterior):
        type(self).lowered += 1
        C, P = family.children.size, family.parents.size
        i, j = torch.arange(C)[:, None], torch.arange(P)[None, :]
        mask = (i - j).abs() <= family.prior.width
        a, b, scale = lowering.score_factors(family)

        def attend(u):
            return torch.nn.functional.scaled_dot_product_attention(a, b, u, attn_mask=mask, scale=scale)
        return attend, None


def test_a_new_support_kind_is_one_class(monkeypatch):
    monkeypatch.setattr(lowering, "SUPPORT_KINDS", list(lowering.SUPPORT_KINDS))
    lowering.register_support_kind(BandSupport())
    g = torch.Generator().manual_seed(0)
    W = [torch.randn(6, 4, generator=g, dtype=F64) for _ in range(3)]

    def program(x):
        n = sa.nodes("x", x)
        phi = sa.edges("band", n, n, Band(1), heads=2)
        sa.potential(phi, sa.potentials.Bilinear(W[0], W[1], heads=2))
        return sa.value(phi, sa.values.Linear(W[2], heads=2))

    x = torch.randn(2, 5, 4, generator=g, dtype=F64)
    out = sa.compile(program)(x)
    assert BandSupport.lowered == 1
    i, j = torch.arange(5)[:, None], torch.arange(5)[None, :]
    ref, _ = softmax_attention(W[0], W[1], W[2], None, x, x, 2, mask=(i - j).abs() <= 1)
    torch.testing.assert_close(out, heads_of(ref, 2), atol=TOL, rtol=0)
    with pytest.raises(ValueError, match="SupportKind instance"):
        lowering.register_support_kind(BandSupport)


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
