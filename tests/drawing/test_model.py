"""Every catalogue model drawn in plate notation (structattn/drawing/model.py)."""

import pytest

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
