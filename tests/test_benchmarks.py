"""The benchmark scripts run (tiny sizes). No timing is asserted here: speed is measured
by the scripts themselves, never in unit tests."""

import pathlib
import subprocess
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.parametrize("script", sorted(p.name for p in BENCHMARKS.glob("bench_*.py")))
def test_benchmark_runs_quick(script, tmp_path):
    out = subprocess.run([sys.executable, str(BENCHMARKS / script), "--quick", "--json",
                          str(tmp_path / "r.json")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert (tmp_path / "r.json").exists()


def test_block_sparse_synthetic_runs_quick(tmp_path):
    """``bench_block_sparse.py --synthetic``: every prior and input kind, against the oracle."""
    import json

    out = subprocess.run([sys.executable, str(BENCHMARKS / "bench_block_sparse.py"),
                          "--synthetic", "--quick", "--rounds", "1", "--json",
                          str(tmp_path / "r.json")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rows = json.loads((tmp_path / "r.json").read_text())["results"]["rows"]
    assert {(r["prior"], r["inputs"]) for r in rows} == {
        (p, k) for p in ("alibi", "forget", "uniform") for k in ("iid", "drifting")}
    assert all(r["largest_skipped_mass"] <= 1e-4 for r in rows)


def test_results_carry_their_provenance(tmp_path, monkeypatch):
    """A benchmark's JSON says what produced it; a quick smoke run without a path writes
    nothing (the committed results are full runs only)."""
    import json
    import sys

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    sys.modules.pop("_results", None)
    import _results

    path = _results.save("toy", {"ratio": 1.0}, str(tmp_path / "toy.json"))
    data = json.loads(pathlib.Path(path).read_text())
    assert data["results"] == {"ratio": 1.0}
    assert {"date", "commit", "torch", "python", "machine", "cores", "threads", "device"} \
        <= set(data["provenance"])
    monkeypatch.setattr(_results, "RESULTS", str(tmp_path / "results"))
    assert _results.save("toy", {}, quick=True) is None
    assert not (tmp_path / "results").exists()
    assert _results.save("toy", {}) == str(tmp_path / "results" / "toy.json")


def test_the_results_render_as_the_docs_pictures(tmp_path, monkeypatch):
    """``render_results.py`` draws the committed results as the docs' pictures: each one it
    can draw from ``benchmarks/results/`` is a PNG, and the docs' copies exist."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import render_results

    written = render_results.main(["--out", str(tmp_path)])
    names = {pathlib.Path(w).name for w in written}
    assert names == {"distance_priors.png", "gpu_kernels.png", "expanding.png"}
    for w in written:
        assert pathlib.Path(w).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (BENCHMARKS.parent / "docs" / "benchmarks" / "img" / pathlib.Path(w).name).exists()
