"""Defects found in review, each pinned by a test that failed before its fix."""

import pytest
import torch

import structattn as sa

from .reference import softmax_attention

TOL = 1e-6


def _x(*shape):
    return torch.randn(*shape, dtype=torch.float64)


def _program(prior_fn, heads=1, d=4, value=None):
    g = torch.Generator().manual_seed(7)
    W = [torch.randn(heads * 2, d, generator=g, dtype=torch.float64) for _ in range(3)]

    def program(x, *extra):
        n = sa.nodes("x", x)
        phi = sa.edges("attn", n, n, prior_fn(*extra), heads=heads)
        sa.potential(phi, sa.potentials.Bilinear(W[0], W[1], heads=heads))
        v = sa.values.Linear(W[2], heads=heads) if value is None else value(W[2], heads)
        return sa.value(phi, v)
    return program, W


def test_neg_inf_logits_exclude_parents_under_torch_compile():
    logits = torch.randn(6, 6, dtype=torch.float64)
    logits[:, 0] = float("-inf")
    logits[0, 0] = 0.0  # child 0 keeps parent 0
    program, W = _program(lambda: sa.priors.Categorical(logits))
    layer = sa.compile(program)
    x = _x(2, 6, 4)
    allowed = ~logits.isneginf()
    ref, _ = softmax_attention(W[0], W[1], W[2], None, x, x, 1,
                               bias=logits.masked_fill(~allowed, 0), mask=allowed)
    torch.testing.assert_close(layer(x)[:, 0], ref, atol=TOL, rtol=0)
    compiled = torch.compile(layer, fullgraph=True)
    torch.testing.assert_close(compiled(x)[:, 0], ref, atol=TOL, rtol=0)


def test_duplicate_edges_are_refused():
    ei = torch.tensor([[0, 1, 2, 3, 4, 0, 1], [0, 1, 2, 3, 4, 1, 1]])
    m = sa.models.graph_attention(4, d_k=2)
    with pytest.raises(ValueError, match=r"edge_index lists the edge 1 → 1 \(parent → child\) 2 "
                                         r"times.*torch.unique"):
        sa.compile(m)(torch.randn(1, 5, 4), ei)


def test_hops_refuse_empty_zero():
    mask = torch.ones(5, 5, dtype=torch.bool)
    mask[2] = False
    program, _ = _program(lambda m: sa.priors.Uniform(support=m, empty="zero"),
                          value=lambda W, h: sa.values.Hops(W, (0, 1, 1), heads=h))
    with pytest.raises(ValueError, match=r"edge family 'attn': empty='zero' .* Hops value walks"):
        sa.compile(program)(_x(1, 5, 4), mask)


@pytest.mark.parametrize("prior", [
    lambda: sa.priors.RelativePosition(torch.tensor([0.0, 0.0, float("-inf"), 0.0, 0.0],
                                                    dtype=torch.float64), causal=True),
    lambda: sa.priors.RelativePosition(torch.tensor([0.0, float("nan"), 0.0], dtype=torch.float64)),
    lambda: sa.priors.ALiBi(1, slopes=torch.tensor([float("inf")])),
])
def test_relative_priors_refuse_empty_supports_and_nan(prior):
    program, _ = _program(prior)
    with pytest.raises(ValueError, match=r"(edge family 'attn': (child 0 .*empty support|prior log "
                                         r"weights .*non-finite)|ALiBi prior: slopes .* finite)"):
        sa.compile(program)(_x(1, 5, 4))


def test_relative_prior_neg_inf_excludes_offsets_like_a_mask():
    lg = torch.tensor([0.3, float("-inf"), 0.0, -0.2, 0.5], dtype=torch.float64)  # i − j = −1 out
    program, W = _program(lambda: sa.priors.RelativePosition(lg))
    x = _x(2, 5, 4)
    off = torch.arange(5)[:, None] - torch.arange(5)[None, :]
    bias = lg[off.clamp(-2, 2) + 2]
    ref, _ = softmax_attention(W[0], W[1], W[2], None, x, x, 1, bias=bias.masked_fill(
        bias.isneginf(), 0), mask=~bias.isneginf())
    torch.testing.assert_close(sa.compile(program)(x)[:, 0], ref, atol=TOL, rtol=0)
    assert sa.inference.compare(program, x).max_abs_diff < TOL


@pytest.mark.parametrize("case", ["mask3d-heads1", "alibi-heads", "relative-heads", "cat-batch"])
def test_prior_tables_must_broadcast_to_batch_heads(case):
    heads = 1 if case in ("mask3d-heads1", "relative-heads") else 2
    prior = {
        "mask3d-heads1": lambda: sa.priors.Uniform(support=torch.ones(3, 5, 5, dtype=torch.bool)),
        "alibi-heads": lambda: sa.priors.ALiBi(4),
        "relative-heads": lambda: sa.priors.RelativePosition(torch.randn(3, 5, dtype=torch.float64)),
        "cat-batch": lambda: sa.priors.Categorical(torch.randn(3, 5, 5, dtype=torch.float64)),
    }[case]
    program, _ = _program(prior, heads=heads)
    with pytest.raises(ValueError, match=r"edge family 'attn': prior (support mask|log weights) "
                                         r"must broadcast to \(\*batch, heads, children, parents\)"):
        sa.compile(program)(_x(2, 5, 4))


def test_potential_after_value_is_refused():
    W = torch.randn(2, 4, dtype=torch.float64)

    def program(x):
        n = sa.nodes("x", x)
        phi = sa.edges("attn", n, n, sa.priors.Uniform())
        sa.potential(phi, sa.potentials.Bilinear(W, W))
        y = sa.value(phi, sa.values.Linear(W))
        sa.potential(phi, sa.potentials.Bilinear(W, W))
        return y

    with pytest.raises(ValueError, match=r"edge family 'attn': potentials must be declared before"):
        sa.compile(program)(_x(1, 3, 4))


def test_multihop_with_a_single_token():
    m = sa.models.multihop_attention(5, d_k=2, heads=2, dtype=torch.float64)
    x = _x(2, 1, 5)
    assert sa.inference.compare(m, x).max_abs_diff < TOL


def test_drawings_give_parentless_children_no_edges():
    m = sa.models.graph_attention(4, d_k=2, empty="zero", dtype=torch.float64)
    mask = torch.eye(4, dtype=torch.bool)
    mask[2] = False
    x = _x(1, 4, 4)
    for adjacency in (mask, torch.tensor([[0, 1, 3], [0, 1, 3]])):
        G = sa.to_networkx(m, x, adjacency)
        assert list(G.in_edges("x[2]")) == []
        assert len(list(G.in_edges("x[1]"))) == 1


def test_render_refuses_big_graphs_before_quadratic_work():
    import time

    m = sa.models.self_attention(8, d_k=2)
    t = time.perf_counter()
    with pytest.raises(ValueError, match=r"family 'attn' has 3000 nodes to draw \(1500 parents \+ "
                                         r"1500 children\), more than max_nodes=64"):
        sa.render(m, torch.randn(1, 1500, 8))
    assert time.perf_counter() - t < 20  # was ~50 s of edge building before the check


def test_two_catalogue_layers_in_one_declaration_and_render_heads_per_family():
    class Stack(sa.Declaration):
        def __init__(self):
            super().__init__()
            self.local = sa.models.self_attention(6, d_k=2, heads=2, causal=True, name="local",
                                                  dtype=torch.float64)
            self.cross = sa.models.cross_attention(6, 4, d_k=3, heads=1, name="memory",
                                                   dtype=torch.float64)

        def model(self, x, mem):
            return self.local.model(x) + self.cross.model(x, mem)

    m = Stack()
    x, mem = _x(2, 5, 6), _x(2, 3, 4)
    _, posts = sa.compile(m)(x, mem, return_posterior=True)
    assert set(posts) == {"local", "memory"}
    assert sa.inference.compare(m, x, mem).max_abs_diff < TOL
    dot = sa.render(m, x, mem, heads=1)  # 'memory' has one head: drawn for 'local' only
    assert "local · head 1" in dot.source and "memory · head" not in dot.source


@pytest.mark.parametrize("kwargs, match", [
    ({"heads": True}, r"heads must be a positive int; got True"),
    ({"d_k": 0}, r"d_k must be a positive int; got 0"),
    ({"temperature": "hot"}, r"temperature must be a number > 0, a tensor, None"),
])
def test_catalogue_argument_checks(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sa.models.self_attention(6, **kwargs)


def test_classification_temperature_string():
    with pytest.raises(ValueError, match=r"Classification: temperature must be a finite number > 0 "
                                         r"or a tensor; got 'learn'"):
        sa.models.classification(6, 3, temperature="learn")


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


def test_prior_table_is_built_once_per_forward_and_fresh_each_forward():
    calls = []

    class CountingRelative(sa.priors.RelativePosition):
        def log_table(self, *args):
            calls.append(1)
            return super().log_table(*args)

    logits = torch.nn.Parameter(torch.randn(2, 5, dtype=torch.float64))
    prior = CountingRelative(logits, causal=True)  # one object reused across steps
    program, _ = _program(lambda: prior, heads=2)
    layer = sa.compile(program)
    opt = torch.optim.SGD([logits], lr=0.5)
    x = _x(2, 6, 4)
    outs = []
    for _ in range(2):
        calls.clear()
        out = layer(x)
        assert len(calls) == 1
        out.square().sum().backward()  # a second step must not reuse the freed graph
        opt.step()
        opt.zero_grad()
        outs.append(out.detach())
    assert not torch.allclose(outs[0], outs[1])  # the updated logits were used
