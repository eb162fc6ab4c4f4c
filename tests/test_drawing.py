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
    with pytest.raises(ValueError, match=r"head must be an int in \[0, 2\)"):
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
    assert "dashed" in src and "latent nodes" in src
    # the stored patterns are a memory: boxes, apart from observed data
    assert {d["memory"] for n, d in G.nodes(data=True) if n.startswith("stored")} == {True}
    assert "shape=box" in src and "memories" in src
    assert G.graph["steps"] == {"state": 2}
    assert {d["step"] for *_, d in G.edges(data=True)} == {2}
    plain = sa.render(sa.models.self_attention(4, heads=1)).source
    assert "dashed" not in plain and "latent nodes" not in plain


# -- large graphs, MAP edges, grids, the command line ---------------------------------------
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


def test_heads_are_laid_out_as_a_grid_in_svg_and_png(tmp_path):
    import re

    m = sa.models.self_attention(8, heads=4, causal=True)
    dot = sa.render(m, torch.randn(1, 5, 8), labels=True, filename=tmp_path / "g.svg")
    titles = re.findall(r'label="attn · head (\d)".* pos="([-\d.]+),([-\d.]+)!"', dot.source)
    assert sorted(int(h) for h, *_ in titles) == [0, 1, 2, 3]
    assert len({x for _, x, _ in titles}) == 2 and len({y for *_, y in titles}) == 2  # 2 × 2
    svg = (tmp_path / "g.svg").read_text()
    assert all(f"attn · head {h}" in svg for h in range(4))
    sa.save(dot, tmp_path / "g.png")
    import struct

    w, h = struct.unpack(">II", (tmp_path / "g.png").read_bytes()[16:24])
    assert w < 3 * h  # a sheet, not a strip
    # one probability label per child, at the child's end, on its MAP edge
    assert dot.source.count("headlabel=") == 4 * 5


def test_two_thousand_nodes_with_top_k_are_drawn_as_a_circle(tmp_path):
    m = sa.models.self_attention(8, heads=1, causal=True)
    x = torch.randn(1, 2000, 8)
    G = sa.to_networkx(m, x, top_k=1)
    assert G.number_of_edges() == 2000
    dot = sa.render(m, x, top_k=1, filename=tmp_path / "big.svg")
    assert dot.source.count("shape=point") == 2000  # one circle: parents are the children
    assert (tmp_path / "big.svg").stat().st_size > 0
    with pytest.raises(ValueError, match=r"prune edges \(top_k=…, threshold=…\)"):
        sa.render(m, x)  # unpruned: refused with advice


def test_inline_display_in_jupyter():
    dot = sa.render(sa.models.self_attention(4, d_k=2, heads=2))
    bundle = dot._repr_mimebundle_()
    assert bundle["image/svg+xml"].lstrip().startswith(("<?xml", "<svg"))


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


def test_command_line_renders_catalogue_models(tmp_path, capsys):
    from structattn.cli import main

    out = tmp_path / "sa.svg"
    assert main(["render", "self_attention", "--out", str(out)]) == 0
    assert out.read_text().lstrip().startswith(("<?xml", "<svg"))
    out = tmp_path / "hop.dot"
    assert main(["render", "hopfield", "--inputs", "4", "--heads", "1", "--labels",
                 "--out", str(out)]) == 0
    assert "inferred" in out.read_text()
    assert main(["list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in sa.models.REGISTRY)
    with pytest.raises(SystemExit, match="unknown model 'nope'"):
        main(["render", "nope", "--out", str(out)])
    assert main(["render", "self_attention", "--inputs", "100", "--out", str(out)]) == 2
    assert "max_nodes" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(CASES))
def test_model_view_in_plate_notation(name, tmp_path):
    """Every model's declaration drawn as plates: one cluster per node set (latent ones
    dashed), one labelled edge per family with its prior, the unrolled iteration when it
    iterates."""
    model, inputs = CASES[name]()
    s = sa.trace_structure(model.model, *inputs)
    dot = sa.model_graph(model, *inputs, unrolled=True)
    src = dot.source
    assert src.count("subgraph cluster_") - src.count("cluster_unrolled_") == len(s.node_sets)
    for fam_name, fam in s.families.items():
        assert f"φ '{fam_name}' ~ {fam.prior.describe()}" in src.replace("\\n", "\n")
    assert src.count("penwidth=1.6 shape=ellipse style=dashed") == len(s.latents)
    for z, ns in s.latents.items():
        assert f"{z}^(0)" in src and f"{z}^({ns.options.steps})" in src
    if isinstance(model.prior() if hasattr(model, "prior") else None, sa.priors.BetaGeometric):
        assert "q_i ~ Beta(a, b)" in src
    sa.save(dot, tmp_path / f"{name}.svg")
    assert (tmp_path / f"{name}.svg").read_text().lstrip().startswith(("<?xml", "<svg"))
