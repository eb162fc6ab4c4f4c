"""graphviz output is safe: formats, escaping, a missing dot binary, latent nodes, head grids,
big graphs (pruned or refused), inline display."""

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


def test_render_refuses_big_graphs_before_quadratic_work():
    import time

    m = sa.models.self_attention(8, d_k=2)
    t = time.perf_counter()
    with pytest.raises(ValueError, match=r"family 'attn' has 3000 nodes to draw \(1500 parents \+ "
                                         r"1500 children\), more than max_nodes=64"):
        sa.render(m, torch.randn(1, 1500, 8))
    assert time.perf_counter() - t < 20  # was ~50 s of edge building before the check
