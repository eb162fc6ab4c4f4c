"""The benchmark scripts run (tiny sizes, ``--quick``), each as ``__main__`` in the test's own
process; the subprocesses a script starts itself (fresh processes for peak memory, the import
timings) still start. No timing is asserted here: speed is measured by the scripts
themselves, never in unit tests."""

import pathlib
import runpy
import subprocess
import sys

import pytest
import torch

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def in_this_process(monkeypatch):
    """Runs a benchmark script as ``__main__`` in this process (its torch, structattn and
    libraries already imported: a fresh interpreter's imports are most of a smoke run), with
    what a script may change put back after: the torch threads and float32 matmul precision,
    the garbage collector's switch, ``sys.argv``, ``sys.path`` (``monkeypatch``) and the
    modules of the script's own folder (``_results``, ``_memory``)."""
    import gc

    threads, precision = torch.get_num_threads(), torch.get_float32_matmul_precision()
    modules, collecting = set(sys.modules), gc.isenabled()

    def run(script: pathlib.Path, *argv: str) -> None:
        monkeypatch.setattr(sys, "argv", [str(script), *argv])
        monkeypatch.syspath_prepend(str(script.parent))  # as ``python script`` puts it
        try:
            runpy.run_path(str(script), run_name="__main__")
        except SystemExit as done:
            assert done.code in (None, 0), f"{script.name} exited with {done.code}"

    yield run
    torch.set_num_threads(threads)
    torch.set_float32_matmul_precision(precision)
    if collecting:
        gc.enable()
    for name in set(sys.modules) - modules:
        if getattr(sys.modules[name], "__file__", None) and \
                pathlib.Path(sys.modules[name].__file__).parent == BENCHMARKS:
            del sys.modules[name]


@pytest.mark.parametrize("script", sorted(p.name for p in BENCHMARKS.glob("bench_*.py")))
def test_benchmark_runs_quick(script, tmp_path, in_this_process):
    if script == "bench_transformers.py":  # against stock transformers: needs the extra
        pytest.importorskip("transformers", reason="the transformers extra is not installed")
    in_this_process(BENCHMARKS / script, "--quick", "--json", str(tmp_path / "r.json"))
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
    assert {"date", "commit", "torch", "python", "machine", "cores", "threads", "device",
            "cpu_model", "cpu_isa", "kernel_isa", "torch_cpu_capability"} <= set(
                data["provenance"])
    assert data["provenance"]["cpu_isa"] in ("AVX-512", "AVX2", "other")
    flags = pathlib.Path("/proc/cpuinfo").read_text() if pathlib.Path("/proc/cpuinfo").exists() else ""
    if " avx512f" in flags:
        assert data["provenance"]["cpu_isa"] == "AVX-512"
    elif " avx2" in flags:
        assert data["provenance"]["cpu_isa"] == "AVX2"
    monkeypatch.delenv("STRUCTATTN_KERNEL_ISA", raising=False)  # the kernels' own ISA
    assert _results.cpu()["kernel_isa"] == data["provenance"]["cpu_isa"]
    monkeypatch.setenv("STRUCTATTN_KERNEL_ISA", "avx2")
    assert _results.cpu()["kernel_isa"] == "AVX2"
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


def test_the_layer_benchmark_records_each_layer_against_sdpa_and_renders(tmp_path, monkeypatch):
    """``bench_gpu_layers.py`` on the CPU (the GPU run's code, tiny sizes, no FLA): a row per
    layer and N with its time and its paired ratio to causal SDPA; the compiled causal
    self-attention computes what SDPA around the same weights computes; FLA's absence is
    said; ``render_results.py`` draws the record and writes its markdown table."""
    import json

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_gpu_layers
    import render_results

    path = tmp_path / "results" / "gpu_layers.json"
    bench_gpu_layers.main(["--quick", "--models", "self-attention", "FoX", "standard normal",
                           "--json", str(path)])
    data = json.loads(path.read_text())
    res = data["results"]
    assert res["fla"] is False and "GPU" in res["fla_note"] and data["provenance"]["device"] == "cpu"
    want = {"causal SDPA", "causal self-attention", "FoX", "FoX, certified (tol 1e-4)",
            "expanding, grad='last' (standard normal)"}
    for n in (64, 128):
        rows = {r["method"]: r for r in res["rows"] if r["N"] == n}
        assert set(rows) == want, sorted(rows)
        assert all(r["seconds"] > 0 and r["note"] is None for r in rows.values())
        assert rows["causal SDPA"]["paired_vs_sdpa"] == 1.0
        assert rows["causal self-attention"]["max_difference"] < 1e-2
        assert rows["FoX"]["paired_vs_fla"] is None  # no FLA here
    # a layer slower than --slow is timed by one call, and says so
    rows = bench_gpu_layers.main(["--quick", "--sizes", "64", "--models", "self-attention",
                                  "--slow", "0"])
    by = {r["method"]: r for r in rows}
    assert by["causal self-attention"]["note"].startswith("one call timed")
    assert by["causal self-attention"]["seconds"] > 0 and by["causal SDPA"]["note"] is None
    monkeypatch.setattr(render_results, "RESULTS", str(tmp_path / "results"))
    picture = render_results.gpu_layers(str(tmp_path))
    assert pathlib.Path(picture).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = render_results.gpu_layers_table()
    assert lines[0].startswith("CPU") and "| method | N = 64 | N = 128 |" in lines
    assert any(line.startswith("| FoX | ") for line in lines) and lines[-1].startswith("\nFLA:")


def test_the_layer_table_puts_fla_beside_the_layers_that_have_its_kernel():
    import sys

    sys.path.insert(0, str(BENCHMARKS))
    from bench_gpu_layers import table

    row = {"N": 1024, "seconds": 2e-3, "paired_vs_sdpa": 1.0, "paired_vs_fla": None,
           "peak_bytes": 2 ** 21, "memory_vs_sdpa": 1.0}
    rows = [dict(row, method="causal SDPA"),
            dict(row, method="FoX", paired_vs_sdpa=2.5, paired_vs_fla=0.9, memory_vs_sdpa=1.2),
            dict(row, method="ALiBi", seconds=None, note="OutOfMemoryError")]
    assert table(rows) == ["| method | N = 1,024 |", "|---|---|",
                           "| causal SDPA | 2.00 ms, 2 MiB |",
                           "| FoX | 2.50× (0.90× FLA), memory 1.20× |",
                           "| ALiBi | fails |"]


def test_the_fla_baselines_compute_what_the_layers_compute():
    """The FLA columns of ``bench_gpu_layers.py`` put the layer's own projections (and FoX's
    forget gates) around FLA's kernels: with FLA's plain-torch references in place of its
    Triton kernels (``naive.py``, which runs on the CPU), they equal the compiled FoX and
    stick-breaking layers. Runs where ``fla-core`` is installed."""
    import sys

    fox_ref = pytest.importorskip("fla.ops.forgetting_attn.naive").naive_forgetting_attn
    sb_ref = pytest.importorskip("fla.ops.stickbreaking_attn.naive").naive_stickbreaking_attn
    sys.path.insert(0, str(BENCHMARKS))
    import bench_gpu_layers as bench
    import torch

    import structattn as sa

    torch.manual_seed(0)
    kw = dict(heads=2, d_k=8, d_v=8, dtype=torch.float64)
    x = torch.randn(2, 20, 16, dtype=torch.float64)
    fox = sa.models.forgetting_attention(16, **kw)
    with torch.no_grad():
        fox.b_f.fill_(0.5)  # gates that forget within the 20 tokens
    # FLA's reference computes in float32
    torch.testing.assert_close(bench.fox_fla(fox_ref, fox, x), sa.compile(fox)(x),
                               rtol=0, atol=1e-5)
    sb = sa.models.stick_breaking_attention(16, tol=0.0, **kw)
    torch.testing.assert_close(bench.stick_breaking_fla(sb_ref, sb, x), sa.compile(sb)(x),
                               rtol=0, atol=1e-10)
