"""graphviz output is safe: formats, escaping, a missing dot binary, latent nodes, head grids,
probability labels, the heads drawn, multihop's hops, big graphs (refused and plotted), inline
display."""

import re
import shutil

import pytest
import torch

import structattn as sa


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
    m = sa.models.hopfield(4, iteration=sa.IterationOptions(steps=2), dtype=torch.float64)
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


def test_heads_are_laid_out_as_a_grid_in_svg_and_png(tmp_path):
    import re

    m = sa.models.self_attention(8, heads=4, causal=True)
    x = torch.randn(1, 5, 8)
    dot = sa.render(m, x, labels=True, filename=tmp_path / "g.svg")
    titles = re.findall(r'label="attn · head (\d)".* pos="([-\d.]+),([-\d.]+)!"', dot.source)
    assert sorted(int(h) for h, *_ in titles) == [0, 1, 2, 3]
    assert len({x for _, x, _ in titles}) == 2 and len({y for *_, y in titles}) == 2  # 2 × 2
    svg = (tmp_path / "g.svg").read_text()
    assert all(f"attn · head {h}" in svg for h in range(4))
    sa.save(dot, tmp_path / "g.png")
    import struct

    w, h = struct.unpack(">II", (tmp_path / "g.png").read_bytes()[16:24])
    assert w < 3 * h  # a sheet, not a strip
    # one probability label per child, under it, on its MAP edge's probability
    labels = re.findall(r'\[label="?(\d\.\d\d)"? fontcolor="#1f77b4" fontsize=10', dot.source)
    assert len(labels) == 4 * 5
    _, post = sa.compile(m)(x, return_posterior=True)
    want = [f"{p:.2f}" for h in range(4) for p in post[0, h].max(-1).values.tolist()]
    assert sorted(labels) == sorted(want)


def test_two_thousand_nodes_are_plotted_not_drawn_as_a_graph(tmp_path):
    """2,000 tokens: networkx keeps the pruned graph, but render refuses to draw it (a graph
    that large shows no structure) and names plot_attention, which writes the plot."""
    m = sa.models.self_attention(8, heads=1, causal=True)
    x = torch.randn(1, 2000, 8)
    G = sa.to_networkx(m, x, top_k=1)
    assert G.number_of_edges() == 2000
    for kwargs in ({}, {"top_k": 1}):
        with pytest.raises(ValueError, match=r"has 4000 nodes to draw .*more than max_nodes=64: "
                                             r"a graph of that many nodes shows no structure\. "
                                             r"Plot what it says instead, structattn\."
                                             r"plot_attention\(model, \*inputs\)"):
            sa.render(m, x, **kwargs)
    fig = sa.plot_attention(m, x, filename=tmp_path / "big.png")
    assert (tmp_path / "big.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(fig.axes) == 4  # three panels and a colour bar: one head


def test_inline_display_in_jupyter():
    dot = sa.render(sa.models.self_attention(4, d_k=2, heads=2))
    bundle = dot._repr_mimebundle_()
    assert bundle["image/svg+xml"].lstrip().startswith(("<?xml", "<svg"))


def test_render_refuses_big_graphs_before_quadratic_work():
    import time

    m = sa.models.self_attention(8, d_k=2)
    t = time.perf_counter()
    with pytest.raises(ValueError, match=r"family 'attn' has 3000 nodes to draw \(1500 parents \+ "
                                         r"1500 children\), more than max_nodes=64"):
        sa.render(m, torch.randn(1, 1500, 8))
    assert time.perf_counter() - t < 20  # was ~50 s of edge building before the check


def test_title_says_which_heads_are_left_out(tmp_path):
    m = sa.models.self_attention(8, heads=4, causal=True)
    x = torch.randn(1, 5, 8)
    src = sa.render(m, x, heads=[0, 1]).source
    assert "heads=4, drawn: 0, 1 (2, 3 left out)" in src
    assert "left out" not in sa.render(m, x).source
    fig = sa.plot_attention(m, x, heads=[2])
    assert "heads=4, drawn: 2 (0, 1, 3 left out)" in fig._suptitle.get_text()


def test_probability_labels_are_legible_and_clear_of_arrows():
    """labels=True: one number per child in the nodes' font size (10), placed under the child,
    where graphviz's own layout puts no arrow (arrowheads end above, at the child)."""
    import json

    torch.manual_seed(0)
    m = sa.models.self_attention(8, heads=2, causal=True)
    dot = sa.render(m, torch.randn(1, 6, 8) * 3, labels=True)
    layout = json.loads(dot.pipe(format="json"))
    numbers = [o for o in layout["objects"] if re.fullmatch(r"\d\.\d\d", o.get("label", ""))]
    assert len(numbers) == 2 * 6 and {o["fontsize"] for o in numbers} == {"10"}
    boxes = []
    for o in numbers:
        x, y = map(float, o["pos"].split(","))
        w, h = float(o["width"]) * 36, float(o["height"]) * 36
        boxes.append((x - w, y - h, x + w, y + h))
    for e in layout["edges"]:
        for p in e["pos"].split():
            x, y = map(float, p.lstrip("e,").split(","))
            assert not any(x0 <= x <= x1 and y0 <= y <= y1 for x0, y0, x1, y1 in boxes)


def test_multihop_is_drawn_hop_by_hop():
    """Multihop's value walks two steps: the drawing has a panel per hop, P and P², and the
    second hop's edge weights are P² of the compiled posterior."""
    torch.manual_seed(1)
    m = sa.models.multihop_attention(8, heads=2, causal=True, dtype=torch.float64)
    x = torch.randn(1, 5, 8, dtype=torch.float64) * 3
    dot = sa.render(m, x)
    for h in range(2):
        assert f"attn · head {h} · hop 1: P" in dot.source
        assert f"attn · head {h} · hop 2: P²" in dot.source
    G = sa.to_networkx(m, x)
    _, P = sa.compile(m)(x, return_posterior=True)
    P2 = (P[0] @ P[0]).detach()
    hop2 = [(d["head"], G.nodes[v]["index"], G.nodes[u]["index"], d["posterior"])
            for u, v, d in G.edges(data=True) if d["family"] == "attn.hop2"]
    assert len(hop2) == 2 * 15  # the causal support of a two-step walk: j ≤ i
    assert max(abs(w - float(P2[h, i, j])) for h, i, j, w in hop2) < 1e-12


def test_a_batch_is_drawn_one_element_at_a_time_and_the_title_says_which():
    m = sa.models.self_attention(8, heads=2)
    x = torch.randn(3, 4, 8)
    for i in range(3):
        assert f"batch element {i} of 3 (batch_index={i})" in sa.render(m, x, batch_index=i).source
    assert "batch element" not in sa.render(m, x[:1]).source  # one element: nothing to say
    assert "batch element" not in sa.render(m).source  # the declared prior
    with pytest.raises(ValueError, match=r"batch_index must be in \[0, 3\); got 3"):
        sa.render(m, x, batch_index=3)
