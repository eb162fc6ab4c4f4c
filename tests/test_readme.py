"""The README's Python examples run as written (examples no test runs rot)."""

import pathlib
import re

import torch

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_examples_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 2
    ns = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), ns)
    assert (tmp_path / "declared.svg").exists() and (tmp_path / "inferred.png").exists()
    sa = ns["sa"]
    assert ns["draws"].edges["attn"].shape == (1, 100, 2, 4, 10)  # the quickstart's comment
    reader = ns["MemoryReader"](8, 5, 3).double()
    q, m = torch.randn(2, 3, 8, dtype=torch.float64), torch.randn(2, 5, 8, dtype=torch.float64)
    assert sa.compile(reader)(q, m).shape == (2, 3, 8)
    assert sa.inference.compare(reader, q, m).max_abs_diff < 1e-6
    report = sa.inference.compare(ns["retrieve"], ns["q"], ns["Y"])  # the iterative example
    assert report.max_abs_diff < 1e-9 and report.fixed_point is not None


def test_the_readme_stays_short():
    """A newcomer's page: the details live in docs/ (the user guide, the gallery's pages)."""
    assert len(README.read_text().splitlines()) <= 350
