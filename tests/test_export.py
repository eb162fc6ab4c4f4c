"""``structattn.export``: a compiled declaration as a ``torch.export.ExportedProgram`` that runs
where neither structattn nor Pyro is installed."""

import importlib
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

import structattn as sa

from .registry import CASES

#: the reading branches on tensor values: no single program (the error says so)
NOT_EXPORTED = {"expanding_attention"}

#: what ``import torch`` and ``torch.export.load`` need besides torch (linked when present)
TORCH_DEPS = ["torch", "torchgen", "typing_extensions.py", "numpy", "numpy.libs", "sympy",
              "mpmath", "filelock", "fsspec", "jinja2", "markupsafe", "networkx"]

LOAD_AND_RUN = textwrap.dedent("""
    import importlib.util, sys
    sys.path = [p for p in sys.path if "site-packages" not in p] + [sys.argv[1]]
    assert importlib.util.find_spec("structattn") is None, "structattn is importable"
    assert importlib.util.find_spec("pyro") is None, "pyro is importable"
    import pathlib, torch
    for path in sorted(pathlib.Path(sys.argv[2]).glob("*.pt2")):
        case = torch.load(path.with_suffix(".io"), weights_only=True)
        torch.manual_seed(3)  # a model drawing at random (slot init) draws as the reading did
        got = torch.export.load(path).module()(*case["inputs"])
        got = got if isinstance(got, (tuple, list)) else (got,)
        for g, want in zip(got, case["outputs"], strict=True):
            torch.testing.assert_close(g, want, rtol=1e-12, atol=1e-12)
        print("ran", path.stem)
    assert "structattn" not in sys.modules and "pyro" not in sys.modules
""")


def _clean_path(tmp_path) -> pathlib.Path:
    """A folder holding torch and what it imports — and nothing else from site-packages."""
    site = pathlib.Path(torch.__file__).parents[1]
    folder = tmp_path / "site"
    folder.mkdir()
    for name in TORCH_DEPS:
        if (site / name).exists():
            (folder / name).symlink_to(site / name)
    return folder


def test_every_catalogue_program_runs_without_structattn(tmp_path):
    programs = tmp_path / "programs"
    programs.mkdir()
    exported = []
    for case in sorted(CASES):
        if case in NOT_EXPORTED:
            continue
        model, inputs = CASES[case]()
        layer = sa.compile(model)
        program = sa.export(layer, *inputs)
        torch.manual_seed(3)
        want = layer(*inputs)
        name = case.replace(":", "-")
        torch.export.save(program, programs / f"{name}.pt2")
        torch.save({"inputs": inputs, "outputs": (want,)}, programs / f"{name}.io")
        exported.append(name)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    run = subprocess.run([sys.executable, "-S", "-c", LOAD_AND_RUN, str(_clean_path(tmp_path)),
                          str(programs)], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert sorted(run.stdout.split()[1::2]) == sorted(exported)


def test_a_value_reading_model_is_refused_with_the_reason():
    model, inputs = CASES["expanding_attention"]()
    # refused from its structure, in one line, before torch traces anything
    with pytest.raises(ValueError, match=r"^structattn.export: ExpandingAttention cannot be "
                                         r"exported: edge family 'attn' is read by "
                                         r"MeanFieldWindows, whose windows are sized from the "
                                         r"data .* export its exact reading"):
        sa.export(model, *inputs)


def test_posterior_and_dynamic_shapes():
    m = sa.models.self_attention(8, d_k=4, heads=2, causal=True, dtype=torch.float64)
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    program = sa.export(m, x, dynamic=True, return_posterior=True)
    layer = sa.compile(m)
    for n in (3, 5, 9):  # other lengths and batch sizes than the example's
        x = torch.randn(3, n, 8, dtype=torch.float64)
        y, post = program.module()(x)
        y_ref, post_ref = layer(x, return_posterior=True)
        torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(post, post_ref, rtol=1e-12, atol=1e-12)


def test_the_program_keeps_the_value_check():
    m = sa.models.self_attention(8, d_k=4, heads=2, dtype=torch.float64)
    x = torch.randn(1, 5, 8, dtype=torch.float64)
    run = sa.export(m, x).module()
    bad = x.clone()
    bad[0, 2, 3] = float("nan")
    with pytest.raises(RuntimeError, match="structattn value check failed"):
        run(bad)
    with sa.validation(False):
        unchecked = sa.export(m, x).module()
    assert torch.isnan(unchecked(bad)).any()  # no check, and the NaN stays a NaN


def test_export_refuses_a_trace():
    m = sa.models.hopfield(4, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="return_trace returns a structattn Trace"):
        sa.export(m, torch.randn(1, 2, 4, dtype=torch.float64),
                  torch.randn(1, 3, 4, dtype=torch.float64), return_trace=True)


REFUSED = {
    "FoX tol": (lambda: sa.models.forgetting_attention(8, heads=2, tol=1e-3), "certified window"),
    "ALiBi tol": (lambda: sa.models.alibi_attention(8, heads=2, tol=1e-3), "certified window"),
    "BAM tol": (lambda: sa.models.generalised_gaussian_attention(8, heads=2, tol=1e-3),
                "certified window"),
    "expanding exact tol": (lambda: sa.models.expanding_attention(8, heads=2, inference=None,
                                                                  tol=1e-3), "certified window"),
    "FoX blocks": (lambda: sa.models.forgetting_attention(8, heads=2, tol=1e-3,
                                                          certificate="blocks"),
                   "certified key blocks"),
    "expanding exact prior_tol": (lambda: sa.models.expanding_attention(
        8, heads=2, inference=None, prior_tol=0.05), "prior_tol=0.05"),
    "expanding mean field": (lambda: sa.models.expanding_attention(8, heads=2), "MeanFieldWindows"),
    "expanding grad=last": (lambda: sa.models.expanding_attention(
        8, heads=2, inference=sa.MeanFieldWindows(grad="last")), "MeanFieldWindows"),
}


@pytest.mark.parametrize("dynamic", [None, True])
@pytest.mark.parametrize("name", sorted(REFUSED))
def test_what_has_no_single_program_is_refused_in_one_line_and_prints_nothing(name, dynamic,
                                                                              capfd):
    build, reason = REFUSED[name]
    with pytest.raises(ValueError) as refused:
        sa.export(build(), torch.randn(1, 40, 8), dynamic=dynamic)
    message = str(refused.value)
    assert message.startswith("structattn.export: ") and "cannot be exported" in message
    assert reason in message and "\n" not in message
    assert "SymInt" not in message and "guard" not in message.lower()
    out, err = capfd.readouterr()
    assert out == "" and err == "", (out + err)[:2000]


def test_a_failed_export_prints_nothing_but_its_error(capfd, monkeypatch):
    """What torch prints while tracing (a data-dependent guard's graph dump) is held back
    when the export fails: the library's error alone comes out."""
    exporting = importlib.import_module("structattn.export")  # (sa.export is the function)
    monkeypatch.setattr(exporting, "_refuse_data_dependent", lambda *a: None)  # let torch try
    m = sa.models.expanding_attention(8, heads=2, inference=None, prior_tol=0.05)
    with pytest.raises(ValueError, match=r"^structattn.export: ExpandingAttention could not be "
                                         r"exported"):
        sa.export(m, torch.randn(1, 40, 8))
    out, err = capfd.readouterr()
    assert out == "" and err == "", (out + err)[:2000]


def test_graph_attention_exports_with_dynamic_nodes_and_edges():
    m = sa.models.graph_attention(8, heads=2, dtype=torch.float64)
    x, edge_index = m.example_inputs(n=6)
    program = sa.export(m, x, edge_index, dynamic=True).module()
    layer = sa.compile(m)
    for n in (4, 11):
        x, edge_index = m.example_inputs(n=n)
        torch.testing.assert_close(program(x, edge_index), layer(x, edge_index), rtol=0, atol=0)
    ring = torch.stack([torch.arange(9), (torch.arange(9) + 1) % 9])  # another edge count
    x = torch.randn(1, 9, 8, dtype=torch.float64)
    torch.testing.assert_close(program(x, ring), layer(x, ring), rtol=0, atol=0)
