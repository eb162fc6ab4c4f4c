"""Gallery scripts run in the test suite with tiny sizes (STYLE.md); each writes pictures."""

import importlib.util
import pathlib

import pytest

GALLERY = pathlib.Path(__file__).resolve().parents[1] / "gallery"
RUN_IN_TESTS = {"plot_quickstart.py": ["--quick"], "plot_multihop.py": ["--quick"],
                "plot_catalogue.py": ["--quick"], "plot_hopfield.py": ["--quick"],
                "plot_slots.py": ["--quick"], "plot_predictive_coding.py": ["--quick"],
                "plot_block_slots.py": ["--quick"], "plot_ground_truth.py": ["--quick"],
                "plot_expfamily_dynamics.py": ["--quick"], "plot_expanding.py": ["--quick"],
                "plot_structures.py": ["--quick"], "plot_distance_priors.py": ["--quick"]}


def _load(path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_gallery_script_is_run_here():
    assert {p.name for p in GALLERY.glob("plot_*.py")} == set(RUN_IN_TESTS)


@pytest.mark.parametrize("script", sorted(RUN_IN_TESTS))
def test_gallery_script_writes_pictures(script, tmp_path):
    written = _load(GALLERY / script).main([*RUN_IN_TESTS[script], "--out", str(tmp_path)])
    assert written
    for path in written:
        data = pathlib.Path(path).read_bytes()
        if pathlib.Path(path).suffix in (".csv", ".txt"):  # a table beside the pictures
            assert data.strip()
            continue
        assert data[:8] == b"\x89PNG\r\n\x1a\n" or data.lstrip()[:5] in (b"<?xml", b"<svg ")


def test_multihop_toy_data_is_the_papers_chain():
    """y = W(2z₀ + z₁ + z₂) with z₂ the last token and (z₀, z₁) two of the shuffled others."""
    import itertools

    import torch

    mod = _load(GALLERY / "plot_multihop.py")
    problem = mod.ChainProblem(3, 6, generator=torch.Generator().manual_seed(0))
    X, y = problem.sample(32)
    assert X.shape == (32, 6, 3) and y.shape == (32, 1)
    positions_of_z0 = set()
    for b in range(32):
        z2 = X[b, -1]
        fits = [(i, j) for i, j in itertools.permutations(range(5), 2)
                if torch.allclose(problem.W @ (2 * X[b, i] + X[b, j] + z2), y[b], atol=1e-4)]
        assert len(fits) == 1, fits
        i, _ = fits[0]
        assert bool(((X[b, i] >= 0) & (X[b, i] < 10)).all())
        positions_of_z0.add(i)
    assert len(positions_of_z0) > 1  # shuffled


def test_predictive_coding_trains_only_the_networks_named(tmp_path, capsys):
    """``--networks choice`` (the recipe table's run) trains the authors' networks alone and
    draws only the pictures that need nothing else."""
    written = _load(GALLERY / "plot_predictive_coding.py").main(
        ["--quick", "--networks", "choice", "--recipe", "authors", "--out", str(tmp_path)])
    assert sorted(pathlib.Path(p).name for p in written) == [
        "pc_choice.png", "pc_learning_curves.png", "pc_test_inference.png"]
    table = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| ")]
    rows = [r for r in table if not r.startswith(("| model", "|---"))]
    assert len(rows) == 2 and all(r.startswith("| choice of 4 predictors") and
                                  "authors' recipe" in r for r in rows)
