"""Graph attention: dense masks and edge lists agree with each other, a reference and Pyro."""


import hypothesis.strategies as st
import networkx as nx
import pytest
import torch
from hypothesis import given, settings

import structattn as sa

from ..conftest import PRIMES
from ..reference import random_graph, softmax_attention

TOL = 1e-6


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


def test_duplicate_edges_are_refused():
    ei = torch.tensor([[0, 1, 2, 3, 4, 0, 1], [0, 1, 2, 3, 4, 1, 1]])
    m = sa.models.graph_attention(4, d_k=2)
    with pytest.raises(ValueError, match=r"edge_index lists the edge 1 → 1 \(parent → child\) 2 "
                                         r"times.*torch.unique"):
        sa.compile(m)(torch.randn(1, 5, 4), ei)


def _x(*shape):
    return torch.randn(*shape, dtype=torch.float64)


def test_edge_list_posterior_comes_from_the_same_pass():
    m = sa.models.graph_attention(4, d_k=2, heads=2, dtype=torch.float64)
    ring = torch.arange(5)
    ei = torch.cat([torch.stack([ring, ring]), torch.stack([(ring + 1) % 5, ring])], dim=1)
    x = _x(2, 5, 4)
    y, post = sa.compile(m)(x, ei, return_posterior=True)
    torch.testing.assert_close(y, sa.compile(m)(x, ei), atol=1e-12, rtol=0)
    torch.testing.assert_close(post.sum(-1), torch.full((2, 2), 5.0, dtype=torch.float64))


def test_empty_edge_list_and_empty_batch():
    m = sa.models.graph_attention(4, d_k=2, empty="zero", dtype=torch.float64)
    x = _x(1, 3, 4)
    no_edges = torch.zeros(2, 0, dtype=torch.long)
    assert sa.compile(m)(x, no_edges).abs().max() == 0
    assert sa.inference.compare(m, x, no_edges).max_abs_diff == 0
    with pytest.raises(ValueError, match=r"edge family 'attn': the batch is empty"):
        sa.inference.exact(sa.models.self_attention(4, d_k=2, dtype=torch.float64), _x(0, 3, 4))


def test_networkx_graph_as_graph_attention_support():
    m = sa.models.graph_attention(6, d_k=3, heads=2, dtype=torch.float64)
    x = torch.randn(2, 5, 6, dtype=torch.float64)
    ring = nx.cycle_graph(5)  # undirected: both directions
    ring.add_edges_from((i, i) for i in range(5))  # self-loops
    edge_index = torch.tensor([[j for i in range(5) for j in (i, (i + 1) % 5, (i - 1) % 5)],
                               [i for i in range(5) for _ in range(3)]])
    y_nx, p_nx = sa.compile(m)(x, ring, return_posterior=True)
    y_ei, p_ei = sa.compile(m)(x, edge_index, return_posterior=True)
    torch.testing.assert_close(y_nx, y_ei)
    assert sa.inference.compare(m, x, ring).passed
    with pytest.raises(ValueError, match=r"networkx adjacency must have nodes 0..4"):
        sa.compile(m)(x, nx.path_graph(["a", "b"]))
