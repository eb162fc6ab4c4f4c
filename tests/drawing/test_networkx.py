"""The networkx graph carries prior, support and posterior (every catalogue model); causal
supports, top-k, thresholds and MAP edges; parentless children."""

import networkx as nx
import pytest
import torch

import structattn as sa

from ..registry import CASES


@pytest.mark.parametrize("name", sorted(CASES))
def test_declared_and_inferred_graphs(name, tmp_path):
    model, inputs = CASES[name]()
    declared = sa.to_networkx(model)
    assert isinstance(declared, nx.DiGraph) and not declared.graph["inferred"]
    G = sa.to_networkx(model, *inputs, batch_index=1)
    assert G.graph["inferred"]
    latents = None
    if sa.trace_structure(model.model, *inputs).latents:  # drawn at the inferred states
        _, trace = sa.compile(model)(*inputs, return_trace=True)
        latents = {k: s[-1] for k, s in trace.states.items()}
    if CASES[name].exact:
        posts = sa.inference.exact(model, *inputs, latents=latents).marginals  # (…, H, C, P), Pyro
    else:  # an approximate reading (mean field) is what is drawn: the compiled module's
        _, post = sa.compile(model)(*inputs, return_posterior=True)
        posts = post if isinstance(post, dict) else {next(iter(G.graph["families"])): post}
    for fam in G.graph["families"]:
        p = posts[fam].detach()
        info = G.graph["families"][fam]
        for u, v, d in G.edges(data=True):
            if d["family"] != fam:
                continue
            i, j = G.nodes[v]["index"], G.nodes[u]["index"]
            assert G.nodes[v]["node_set"] == info["children"]
            assert d["posterior"] == pytest.approx(float(p[1, d["head"], i, j]), abs=1e-12)
        # prior over each child's support sums to one
        for h in range(info["heads"]):
            for v in (n for n, a in G.nodes(data=True) if a["node_set"] == info["children"]):
                ins = [d["prior"] for _, _, d in G.in_edges(v, data=True)
                       if d["family"] == fam and d["head"] == h]
                if ins:  # a child without support (expanding attention's first token): none
                    assert sum(ins) == pytest.approx(1.0)
    for inputs_ in ((), inputs):
        out = tmp_path / f"{name}{len(inputs_)}.svg"
        dot = sa.render(model, *inputs_, filename=out)
        assert out.exists() and out.read_text().lstrip().startswith(("<?xml", "<svg"))
        assert "digraph" in dot.source


def test_causal_support_is_drawn_exactly():
    m = sa.models.self_attention(4, d_k=2, causal=True, dtype=torch.float64)
    G = sa.to_networkx(m, torch.randn(1, 4, 4, dtype=torch.float64))
    edges = {(G.nodes[u]["index"], G.nodes[v]["index"]) for u, v in G.edges()}
    assert edges == {(j, i) for i in range(4) for j in range(i + 1)}


def test_top_k_threshold_and_map_edges_follow_the_posterior():
    torch.manual_seed(3)
    m = sa.models.self_attention(6, d_k=3, heads=2, causal=True, dtype=torch.float64)
    x = torch.randn(1, 7, 6, dtype=torch.float64) * 3
    post = sa.inference.exact(m, x).marginals["attn"][0].detach()  # (H, C, P), Pyro
    G = sa.to_networkx(m, x, top_k=2)
    for h in range(2):
        for i in range(7):
            ins = [(G.nodes[u]["index"], d) for u, _, d in G.in_edges(f"x[{i}]", data=True)
                   if d["head"] == h]
            assert len(ins) == min(2, i + 1)
            kept = sorted(j for j, _ in ins)
            assert kept == sorted(post[h, i].topk(min(2, i + 1)).indices.tolist())
            maps = [j for j, d in ins if d["map"]]
            assert maps == [int(post[h, i].argmax())]
    light = sa.to_networkx(m, x, threshold=0.3)
    assert all(d["posterior"] >= 0.3 for *_, d in light.edges(data=True))
    assert light.number_of_edges() == int((post >= 0.3).sum())
    with pytest.raises(ValueError, match="top_k must be a positive int"):
        sa.to_networkx(m, x, top_k=0)
    with pytest.raises(ValueError, match=r"threshold must be a probability in \[0, 1\]"):
        sa.to_networkx(m, x, threshold=1.5)


def _x(*shape):
    return torch.randn(*shape, dtype=torch.float64)


def test_drawings_give_parentless_children_no_edges():
    m = sa.models.graph_attention(4, d_k=2, empty="zero", dtype=torch.float64)
    mask = torch.eye(4, dtype=torch.bool)
    mask[2] = False
    x = _x(1, 4, 4)
    for adjacency in (mask, torch.tensor([[0, 1, 3], [0, 1, 3]])):
        G = sa.to_networkx(m, x, adjacency)
        assert list(G.in_edges("x[2]")) == []
        assert len(list(G.in_edges("x[1]"))) == 1
