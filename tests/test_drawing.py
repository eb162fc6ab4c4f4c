"""Drawings: the networkx graph carries prior/support/posterior; graphviz output is safe."""

import shutil

import networkx as nx
import pytest
import torch

import structattn as sa

from .registry import CASES


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
    posts = sa.inference.exact(model, *inputs, latents=latents).marginals  # (…, H, C, P), Pyro
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


def test_png_output(tmp_path):
    out = tmp_path / "attn.png"
    sa.render(sa.models.self_attention(4, d_k=2, heads=2), filename=out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_names_are_escaped(tmp_path):
    W = torch.randn(2, 3)
    weird = 'a:b "c" <d> \\ {e}'

    def program(x):
        n = sa.nodes(weird, x)
        phi = sa.edges('φ:"x"', n, n, sa.priors.Uniform())
        sa.potential(phi, sa.potentials.Bilinear(W, W))
        return sa.value(phi, sa.values.Linear(W))

    out = tmp_path / "weird.svg"
    sa.render(program, torch.randn(1, 3, 3), filename=out)
    assert out.exists()


def test_missing_dot_binary_gives_clear_error_and_dot_source(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert shutil.which("dot") is None
    out = tmp_path / "attn.svg"
    with pytest.raises(sa.RenderError, match=r"'dot' program was not found.*apt-get install "
                                             r"graphviz.*attn\.dot"):
        sa.render(sa.models.self_attention(4, d_k=2), filename=out)
    assert (tmp_path / "attn.dot").read_text().startswith("digraph")


def test_bad_filename_and_head():
    m = sa.models.self_attention(4, d_k=2, heads=2)
    with pytest.raises(ValueError, match=r"must end in .svg, .png, .pdf or .dot"):
        sa.render(m, filename="x.jpeg")
    with pytest.raises(ValueError, match=r"head must be in \[0, 2\)"):
        sa.render(m, heads=5)


def test_declared_render_needs_example_inputs():
    with pytest.raises(NotImplementedError, match=r"no example_inputs\(\); pass inputs"):
        sa.render(lambda x: x)


def test_latent_nodes_are_drawn_open_observed_shaded():
    m = sa.models.hopfield(4, update_steps=2, dtype=torch.float64)
    G = sa.to_networkx(m, *m.example_inputs(n=3))
    latent = {n for n, d in G.nodes(data=True) if not d["observed"]}
    assert latent == {f"state[{i}]" for i in range(3)}
    src = sa.render(m, *m.example_inputs(n=3)).source
    assert "dashed" in src and "latent nodes" in src and "#d9d9d9" in src
    plain = sa.render(sa.models.self_attention(4, heads=1)).source
    assert "dashed" not in plain and "latent nodes" not in plain
