"""Every catalogue model drawn in plate notation (structattn/drawing/model.py)."""

import pytest
import torch

import structattn as sa

from ..registry import CASES


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


def _layout(dot):
    """graphviz's own layout of ``dot`` (``-Tjson``): {name or label: object}, edges with their
    spline points and labels, and the boxes of every cluster label and plaintext label."""
    import json

    j = json.loads(dot.pipe(format="json"))
    objects = j["objects"]
    boxes = []
    for o in objects:
        if "bb" in o and o.get("label") and "lp" in o:  # a cluster's own label
            (x, y), w, h = map(float, o["lp"].split(",")), float(o["lwidth"]), float(o["lheight"])
        elif o.get("shape") == "plaintext" and "pos" in o:  # a label drawn as a node
            (x, y), w, h = map(float, o["pos"].split(",")), float(o["width"]), float(o["height"])
        else:
            continue
        boxes.append((o["label"], x - 36 * w, y - 36 * h, x + 36 * w, y + 36 * h))  # in points
    edges = []
    for e in j.get("edges", []):
        pts, ctrl = [], []
        for p in e.get("pos", "").split():
            if p[:2] in ("e,", "s,"):
                pts.append(tuple(map(float, p[2:].split(","))))
            else:
                ctrl.append(tuple(map(float, p.split(","))))
        for k in range(0, len(ctrl) - 3, 3):  # cubic Bézier pieces, sampled
            (x0, y0), (x1, y1), (x2, y2), (x3, y3) = ctrl[k:k + 4]
            for t in (i / 40 for i in range(41)):
                a, b, c, d = (1 - t) ** 3, 3 * (1 - t) ** 2 * t, 3 * (1 - t) * t * t, t ** 3
                pts.append((a * x0 + b * x1 + c * x2 + d * x3, a * y0 + b * y1 + c * y2 + d * y3))
        edges.append((objects[e["tail"]], objects[e["head"]], e.get("label", ""), pts))
    return objects, edges, boxes


@pytest.mark.parametrize("name", sorted(CASES))
def test_no_arrow_crosses_a_plate_label(name):
    """Plate labels ('x: i = 1..n', 'z unrolled: …') are nodes beside x_i, so graphviz routes
    every arrow around them (a cluster's own label is no obstacle to its router): no point of
    any arrow, arrowhead included, lies in a label's box."""
    model, inputs = CASES[name]()
    for unrolled in (False, True):
        _, edges, boxes = _layout(sa.model_graph(model, *inputs, unrolled=unrolled))
        assert any("i = 1.." in label for label, *_ in boxes)
        for tail, head, _, pts in edges:
            for label, x0, y0, x1, y1 in boxes:
                inside = [p for p in pts if x0 <= p[0] <= x1 and y0 <= p[1] <= y1]
                assert not inside, (f"{name}: the arrow {tail.get('label')!r} → "
                                    f"{head.get('label')!r} crosses the label {label!r}")


def test_layout_check_sees_a_crossing():
    """The check above can fail: with the plate label as the cluster's own label (graphviz's
    usual way), cross attention's family arrow runs through the keys' plate label."""
    import graphviz

    dot = graphviz.Digraph()
    with dot.subgraph(name="cluster_0") as c:
        c.attr(label="keys: i = 1..7", labeljust="r")
        c.node("k", "keys_i")
    with dot.subgraph(name="cluster_1") as c:
        c.attr(label="queries: i = 1..5", labeljust="r")
        c.node("q", "queries_i")
    dot.edge("k", "q", label="φ 'attn' ~ Uniform(all parents)\nψ: Bilinear(heads=2, d_k=4)")
    _, edges, boxes = _layout(dot)
    (_, _, _, pts), = edges
    assert any(x0 <= x <= x1 and y0 <= y <= y1 for x, y in pts
               for label, x0, y0, x1, y1 in boxes if label.startswith("queries"))


def test_hopfield_queries_feed_the_first_state():
    """state⁽⁰⁾ = W_Q·queries: the unrolled chain starts from the queries plate (found in
    autograd's graph); slot attention's slots start from their own argument (no such edge)."""
    m = sa.models.hopfield(8, 8, heads=2, iteration=sa.IterationOptions(steps=3))
    _, edges, _ = _layout(sa.model_graph(m, unrolled=True))
    starts = [(t["label"], h["label"]) for t, h, label, _ in edges if label == "initial state"]
    assert starts == [("queries_i\\nobserved", "state^(0)")]
    assert "starts from queries" in sa.model_graph(m).source
    s = sa.models.slot_attention(3, 8, hidden_dim=16)
    _, edges, _ = _layout(sa.model_graph(s, unrolled=True))
    assert not [e for e in edges if e[2] == "initial state"]


def test_hyper_prior_is_drawn_inside_its_plate():
    """q_i ~ Beta(a, b) is one per token i: its node lies in the tokens' plate, and feeds x_i."""
    m = sa.models.expanding_attention(8, heads=2)
    objects, edges, _ = _layout(sa.model_graph(m))
    (q,) = [k for k, o in enumerate(objects) if o.get("label", "").startswith("q_i ~ Beta")]
    (plate,) = [o for o in objects if o.get("name", "").startswith("cluster_")]
    assert q in plate["nodes"]
    x, y = map(float, objects[q]["pos"].split(","))
    bx0, by0, bx1, by1 = map(float, plate["bb"].split(","))
    assert bx0 < x < bx1 and by0 < y < by1
    assert [h["label"] for t, h, _, _ in edges if t is objects[q]] == ["x_i\\nobserved"]


class _SlotReader(torch.nn.Module):
    """Queries reading memory slots held as a parameter, a registered buffer, or the inputs."""

    def __init__(self, held):
        super().__init__()
        self.held = held
        slots = torch.randn(5, 4)
        if held == "learned":
            self.slots = torch.nn.Parameter(slots)
        else:
            self.register_buffer("slots", slots)
        self.W = torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, x, y):
        q = sa.nodes("queries", x)
        slots = y @ self.W if self.held == "inputs" else self.slots
        m = sa.nodes("slots", slots, memory=True)
        phi = sa.edges("read", q, m, sa.priors.Uniform())
        sa.potential(phi, sa.potentials.DotProduct())
        return x + sa.merge_heads(sa.value(phi, sa.values.Identity()))


@pytest.mark.parametrize("held", ["learned", "fixed", "inputs"])
def test_a_memory_is_labelled_by_where_its_states_come_from(held):
    """A parameter's slots are learned; a registered buffer's are fixed; slots computed from
    the inputs (through a learned projection, as Hopfield's stored patterns) are the inputs'."""
    reader = _SlotReader(held)
    source = sa.model_graph(reader.forward, torch.randn(3, 4), torch.randn(5, 4)).source
    assert f"slots_i\\nmemory ({held})" in source
    assert source.count("memory (") == 1
