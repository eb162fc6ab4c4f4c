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
