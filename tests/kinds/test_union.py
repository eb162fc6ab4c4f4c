"""Union of supports (``a | b``): lowered by the dense operator, it matches Pyro's enumeration,
its draws stay inside it, and it reads like its parts."""

import pytest
import torch

import structattn as sa
from structattn.kinds import Causal, Union, Window

F64 = torch.float64


class FirstTokens(sa.kinds.Support):
    """The first g tokens, read by every child (Longformer's global tokens)."""

    def __init__(self, g):
        self.g = g

    def contains(self, child, parent):
        return (parent < self.g) & (child >= 0)


class KindPrior(sa.priors.Prior):
    """A uniform prior over a given support kind."""

    def __init__(self, kind):
        self.kind = kind

    def support(self, num_children, num_parents):
        return self.kind


def _program(kind, W):
    def program(x):
        t = sa.nodes("x", x)
        phi = sa.edges("attn", t, t, KindPrior(kind), heads=2)
        sa.potential(phi, sa.potentials.Bilinear(W[0], W[1], heads=2))
        return sa.merge_heads(sa.value(phi, sa.values.Linear(W[2], heads=2)))
    return program


def _weights(seed, heads=2, d=4, k=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(heads * k, d, generator=g, dtype=F64) for _ in range(3)]


def _allowed(kind, n):
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    return kind.contains(i, j).expand(n, n)


LOCAL_GLOBAL = [Window(2, first=0) | FirstTokens(2), Window(1) | FirstTokens(1) | Causal(),
                (Window(3, first=0) & Causal()) | FirstTokens(3)]


@pytest.mark.parametrize("kind", LOCAL_GLOBAL, ids=lambda k: k.describe())
@pytest.mark.parametrize("n", [1, 4, 7])
def test_a_union_lowers_like_pyro_enumeration(kind, n):
    W = _weights(n)
    x = torch.randn(2, n, 4, dtype=F64)
    program = _program(kind, W)
    report = sa.inference.compare(program, x, atol=1e-10)
    assert report.passed and report.max_abs_diff < 1e-10, str(report)
    _, post = sa.compile(program)(x, return_posterior=True)
    truth = sa.inference.exact(program, x)
    torch.testing.assert_close(post, truth.marginals["attn"], atol=1e-10, rtol=0)
    outside = ~_allowed(kind, n)
    assert bool((post[..., outside] == 0).all())
    assert bool((post[..., ~outside] > 0).all())  # every allowed parent has mass


def test_a_union_draws_inside_its_support():
    kind = Window(1) | FirstTokens(2)
    n = 6
    x = torch.randn(1, n, 4, dtype=F64)
    draws = sa.inference.sample(_program(kind, _weights(0)), x, num_samples=50)
    idx = draws.flat(draws.edges)["attn"]  # (S, 1, H, C)
    allowed = _allowed(kind, n)  # (C, P)
    child = torch.arange(n).expand_as(idx)
    assert bool(allowed[child, idx.clamp(max=n - 1)].all()) and bool((idx < n).all())
    seen = torch.zeros(n, n, dtype=torch.bool)
    seen[child.flatten(), idx.flatten()] = True
    assert bool((seen & ~allowed).sum() == 0) and bool(seen[allowed].any())


def test_a_union_reads_like_its_parts():
    """A ∪ B = A when B ⊆ A; the union of disjoint parts is their masks' or; parts flatten."""
    n = 6
    x = torch.randn(2, n, 4, dtype=F64)
    W = _weights(1)
    wide = sa.compile(_program(Window(3, first=0), W))(x, return_posterior=True)[1]
    union = sa.compile(_program(Window(3, first=0) | Window(1, first=0), W))(
        x, return_posterior=True)[1]
    torch.testing.assert_close(union, wide, atol=1e-12, rtol=0)
    a, b = Window(1), FirstTokens(2)
    torch.testing.assert_close((a | b).dense(n, n, "cpu"), a.dense(n, n, "cpu") | b.dense(n, n, "cpu"))
    assert (a | b).dense(n, n, "cpu").equal(_allowed(a | b, n))
    assert isinstance(a | b, Union) and len((a | b | Causal()).parts) == 3
    assert (a | sa.kinds.AllParents()).dense(n, n, "cpu") is None  # every parent
    assert (a | b).operator is None  # the dense operator, whatever its parts name
    assert (a | b).describe() == "1 ≤ i − j ≤ 1 ∨ FirstTokens"


def test_a_union_is_drawn_with_its_edges_alone():
    """The drawing (``to_networkx``) has an edge per head for each allowed pair, no other."""
    kind = Window(1) | FirstTokens(2)
    n = 6
    G = sa.to_networkx(_program(kind, _weights(0)), torch.randn(1, n, 4, dtype=F64))
    drawn = {(G.nodes[child]["index"], G.nodes[parent]["index"], a["head"])
             for parent, child, a in G.edges(data=True) if a["family"] == "attn" and a["support"]}
    i, j = _allowed(kind, n).nonzero().T.tolist()
    assert drawn == {(c, p, h) for c, p in zip(i, j, strict=True) for h in (0, 1)}
