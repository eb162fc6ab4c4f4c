"""Graph attention: dense masks and edge lists agree with each other, a reference and Pyro."""

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

import structattn as sa

from .conftest import PRIMES
from .reference import heads_of, softmax_attention

TOL = 1e-6


def random_graph(n, g, density=0.4, self_loops=True):
    mask = torch.rand(n, n, generator=g) < density
    if self_loops:
        mask |= torch.eye(n, dtype=torch.bool)
    dst, src = mask.nonzero().T  # mask[i, j]: child i, parent j
    perm = torch.randperm(src.numel(), generator=g)  # edge order must not matter
    return mask, torch.stack([src[perm], dst[perm]])


@settings(max_examples=20, deadline=None)
@given(B=st.sampled_from(PRIMES[:3]), n=st.sampled_from(PRIMES[1:]), H=st.sampled_from([1, 2, 3]),
       seed=st.integers(0, 2**16))
def test_edge_list_equals_dense_mask_equals_reference_and_pyro(B, n, H, seed):
    g = torch.Generator().manual_seed(seed)
    mask, edge_index = random_graph(n, g)
    m = sa.models.graph_attention(6, d_k=3, heads=H, dtype=torch.float64)
    x = torch.randn(B, n, 6, generator=g, dtype=torch.float64)
    layer = sa.compile(m)
    ref, p_ref = softmax_attention(m.W_q, m.W_k, m.W_v, m.W_o, x, x, H, mask=mask)
    torch.testing.assert_close(layer(x, mask), ref, atol=TOL, rtol=0)
    torch.testing.assert_close(layer(x, edge_index), ref, atol=TOL, rtol=0)
    _, post = layer(x, edge_index, return_posterior=True)
    assert post.shape == (B, H, edge_index.shape[1])
    torch.testing.assert_close(post, p_ref[..., edge_index[1], edge_index[0]], atol=TOL, rtol=0)
    for adjacency in (mask, edge_index):
        report = sa.inference.compare(m, x, adjacency)
        assert report.max_abs_diff < TOL, str(report)


@pytest.mark.parametrize("layout", ["dense", "edges"])
def test_parentless_nodes_error_by_default(layout):
    mask, edge_index = random_graph(5, torch.Generator().manual_seed(0))
    mask[2] = False
    edge_index = edge_index[:, edge_index[1] != 2]
    m = sa.models.graph_attention(4, d_k=2, dtype=torch.float64)
    x = torch.randn(1, 5, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"edge family 'attn': child 2 .*empty support.*"
                                         r"empty='zero'"):
        sa.compile(m)(x, mask if layout == "dense" else edge_index)


@pytest.mark.parametrize("layout", ["dense", "edges"])
def test_parentless_nodes_output_zero_when_asked(layout):
    g = torch.Generator().manual_seed(1)
    mask, edge_index = random_graph(6, g)
    mask[[1, 4]] = False
    edge_index = edge_index[:, (edge_index[1] != 1) & (edge_index[1] != 4)]
    m = sa.models.graph_attention(4, d_k=2, heads=2, out_proj=False, empty="zero",
                                  dtype=torch.float64)
    x = torch.randn(2, 6, 4, dtype=torch.float64, requires_grad=True)
    adjacency = mask if layout == "dense" else edge_index
    y, post = sa.compile(m)(x, adjacency, return_posterior=True)
    assert torch.isfinite(y).all() and torch.isfinite(post).all()
    assert y[:, [1, 4]].abs().max() == 0
    full = mask.clone()
    full[[1, 4]] = True  # any support: those rows are replaced by zero below
    ref, p_ref = softmax_attention(m.W_q, m.W_k, m.W_v, None, x, x, 2, mask=full)
    ref[:, [1, 4]] = 0
    torch.testing.assert_close(y, ref, atol=TOL, rtol=0)
    if layout == "dense":
        assert post[..., [1, 4], :].abs().max() == 0
    assert sa.inference.compare(m, x, adjacency).max_abs_diff < TOL
    y.square().sum().backward()
    assert torch.isfinite(x.grad).all()


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


def test_large_sparse_graph_never_builds_n_by_n():
    """300k nodes: a dense n×n mask would need 90 GB; the edge-list path needs O(E)."""
    n, extra = 300_000, 300_000
    g = torch.Generator().manual_seed(3)
    nodes = torch.arange(n)
    edge_index = torch.cat([torch.stack([nodes, nodes]),
                            torch.randint(n, (2, extra), generator=g)], dim=1).unique(dim=1)
    m = sa.models.graph_attention(8, d_k=4, heads=2)
    x = torch.randn(1, n, 8, requires_grad=True)
    y = sa.compile(m)(x, edge_index)
    assert y.shape == (1, n, 8) and torch.isfinite(y).all()
    y.sum().backward()
    assert torch.isfinite(x.grad).all()


def test_graph_bad_input():
    m = sa.models.graph_attention(4, d_k=2)
    x = torch.randn(1, 5, 4)
    with pytest.raises(ValueError, match=r"adjacency must be a boolean \(n, n\) mask, an int64 "
                                         r"edge_index \(2, E\) or a networkx graph on nodes "
                                         r"0..n−1; got torch.float32"):
        sa.compile(m)(x, torch.ones(5, 5))
    with pytest.raises(ValueError, match=r"edge family 'attn': edge_index must have shape \(2, E\).*"
                                         r"got \(3, 4\)"):
        sa.compile(m)(x, torch.zeros(3, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"edge family 'attn': edge_index child \(row 1\) indices "
                                         r"must be in \[0, 5\); got 7"):
        sa.compile(m)(x, torch.tensor([[0, 1, 2, 3, 4, 0], [0, 1, 2, 3, 4, 7]]))
    with pytest.raises(ValueError, match=r"empty must be 'error' or 'zero'; got 'skip'"):
        sa.models.graph_attention(4, empty="skip")
    with pytest.raises(ValueError, match=r"dense mask or as an edge_index, not both"):
        sa.priors.Uniform(support=torch.ones(2, 2, dtype=torch.bool),
                          edge_index=torch.zeros(2, 1, dtype=torch.long))


def test_causal_graph_keeps_only_edges_to_the_past():
    g = torch.Generator().manual_seed(4)
    mask, edge_index = random_graph(6, g, density=0.6)
    m = sa.models.graph_attention(4, d_k=2, heads=2, causal=True, dtype=torch.float64)
    x = torch.randn(2, 6, 4, dtype=torch.float64)
    ref, _ = softmax_attention(m.W_q, m.W_k, m.W_v, m.W_o, x, x, 2, mask=mask, causal=True)
    for adjacency in (mask, edge_index):
        torch.testing.assert_close(sa.compile(m)(x, adjacency), ref, atol=TOL, rtol=0)
        assert sa.inference.compare(m, x, adjacency).max_abs_diff < TOL
