"""gallery/lm_probes.py and gallery/lm_table.py at a tiny size: a certified width reported
for a trained model holds the posterior mass beyond it under tol (checked on the dense
posterior of the same parameters read without tol), the credible and passkey probes are in
range, and the table states each run's own figures, its seeds' range and the anchors."""

import importlib.util
import json
import pathlib
import shutil
import statistics
import sys

import pytest
import torch

GALLERY = pathlib.Path(__file__).resolve().parents[1] / "gallery"
TINY = ["--context", "24", "--d-model", "16", "--layers", "2", "--heads", "2", "--batch", "2",
        "--steps", "2", "--eval-every", "2", "--eval-windows", "2", "--max-files", "40",
        "--window", "8", "--eval-lengths", "24", "48", "--eval-bytes", "2000",
        "--any-corpus"]  # 40 files: not the table's corpus


def _load(name):
    sys.path.insert(0, str(GALLERY))
    spec = importlib.util.spec_from_file_location(name, GALLERY / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Tiny runs: fox with seeds 0 and 1, expanding_mf with seed 0; and their records as
    run_lm_table.sh keeps them (``keep/<variant>_seed<s>.json``)."""
    lm = _load("train_lm")
    root = tmp_path_factory.mktemp("lm")
    keep = root / "keep"
    keep.mkdir()
    for variant, seed in [("fox", 0), ("fox", 1), ("expanding_mf", 0)]:
        out = root / f"seed{seed}"
        lm.main([*TINY, "--attention", variant, "--seed", str(seed), "--out", str(out)])
        shutil.copy(out / f"{variant}_T24" / "result.json", keep / f"{variant}_seed{seed}.json")
    return root, keep


def test_a_certified_width_bounds_the_posterior_mass_beyond_it(runs):
    probes, lm = _load("lm_probes"), _load("train_lm")
    root, _ = runs
    exact, _ = probes.load(root / "seed0" / "fox_T24")
    cut, _ = probes.load(root / "seed0" / "fox_T24", tol=1e-3)
    for model in (exact, cut):  # forgetful gates, so that a window certifies short of the past
        for block in model.blocks:
            block.attn.declaration.b_f.data.fill_(-1.0)
    _, val, _ = lm.stdlib_corpus(max_files=40)
    length = 96
    rows = probes.certified_widths(cut, val, [length], count=1)
    assert [r["layer"] for r in rows] == [0, 1] and all(r["length"] == length for r in rows)
    window = probes.spaced_windows(val, length, 1)
    i = torch.arange(length)
    distance = i[:, None] - i[None, :]  # child i, parent j
    narrower = 0
    walk = probes.layer_inputs(exact, window, return_posterior=True)
    for (k, _, _, (post,)), row in zip(walk, rows, strict=True):  # post: (1, H, T, T)
        for h, width in enumerate(row["largest_width"]):
            assert row["median_width"][h] == width  # one window: its own width
            beyond = post[0, h].masked_fill(distance <= width, 0).sum(-1)
            assert float(beyond.max()) <= 1e-3 * (1 + 1e-4), (k, h, width)
            narrower += width < length - 1
    assert narrower > 0  # some head certified a window short of the whole past
    assert 0 < rows[0]["skipped"] < 1


@pytest.fixture(scope="module")
def probed(runs):
    """lm_probes' records of the tiny runs, kept beside them as run_lm_table.sh keeps them."""
    probes = _load("lm_probes")
    root, keep = runs
    common = ["--max-files", "40", "--lengths", "24", "48", "--windows", "2", "--distances",
              "16", "32", "--trials", "2"]
    return {(variant, seed): probes.main(
        [str(root / f"seed{seed}" / f"{variant}_T24"), *common, "--json",
         str(keep / f"{variant}_seed{seed}_probes.json")])
        for variant, seed in [("fox", 0), ("fox", 1), ("expanding_mf", 0)]}


def test_the_probes_read_a_corpus_file_as_the_library_and_refuse_another(runs, probed,
                                                                        tmp_path):
    """``--corpus FILE`` (the 40 files written by ``write_corpus``) gives the probes' records
    of the library read directly; a file of 41 files is refused naming the run, and
    ``--corpus`` with ``--max-files`` in one line naming both."""
    probes, corpus = _load("lm_probes"), _load("lm_corpus")
    root, _ = runs
    run = str(root / "seed0" / "fox_T24")
    for files in (40, 41):
        corpus.write_corpus(tmp_path / f"c{files}.gz", *corpus.stdlib_corpus(max_files=files))
    common = ["--lengths", "24", "48", "--windows", "2", "--distances", "16", "32",
              "--trials", "2"]
    out = probes.main([run, *common, "--corpus", str(tmp_path / "c40.gz"),
                       "--json", str(tmp_path / "probes.json")])
    expected = probed[("fox", 0)]
    assert out["passkey"] == expected["passkey"] and out["certified"] == expected["certified"]
    with pytest.raises(SystemExit, match=r"the corpus file .*c41\.gz .* is not the one .*"
                                         r"fox_T24 trained on"):
        probes.main([run, *common, "--corpus", str(tmp_path / "c41.gz")])
    with pytest.raises(SystemExit, match=r"lm_probes: --corpus .* --max-files"):
        probes.main([run, *common, "--corpus", str(tmp_path / "c40.gz"), "--max-files", "40"])


def test_the_probes_write_passkey_and_credible_windows(probed):
    for (variant, seed), out in probed.items():
        assert out["variant"] == variant and out["seed"] == seed
        assert [r["distance"] for r in out["passkey"]] == [16, 32]
        for r in out["passkey"]:
            assert 0 <= r["accuracy"] <= 1 and 0 <= r["planted_edge_mass"] <= 1 + 1e-9
        if variant == "fox":
            assert [(r["length"], r["layer"]) for r in out["certified"]] == [
                (24, 0), (24, 1), (48, 0), (48, 1)]
            for r in out["certified"]:
                assert all(1 <= w <= r["length"] - 1 for w in r["largest_width"])
                assert all(m <= w for m, w in zip(r["median_width"], r["largest_width"],
                                                  strict=True))
            assert "credible" not in out
        else:
            assert len(out["credible"]) == 4 and "certified" not in out
            for r in out["credible"]:
                assert all(1 <= m <= q for m, q in zip(r["median_length_high"],
                                                        r["p90_length_high"], strict=True))


def test_the_table_states_each_run_its_seeds_range_and_the_anchors(runs, probed, tmp_path):
    table = _load("lm_table")
    _, keep = runs
    fox = [json.loads((keep / f"fox_seed{s}.json").read_text()) for s in (0, 1)]
    anchors = {"manifest_sha256": fox[0]["manifest_sha256"],
               "compressors": {"xz -9": 1.25}, "kneser_ney": {"6": 1.5}}
    (tmp_path / "anchors.json").write_text(json.dumps(anchors))
    written = table.main(["--runs", str(keep), "--anchors", str(tmp_path / "anchors.json"),
                          "--out", str(tmp_path)])
    assert [pathlib.Path(p).name for p in written] == [
        "lm_table.md", "lm_table_extrapolation.png", "lm_table_curves.png",
        "lm_table_windows.png", "lm_table_passkey.png"]
    for p in written[1:]:
        assert pathlib.Path(p).read_bytes()[:4] == b"\x89PNG"
    text = (tmp_path / "lm_table.md").read_text()
    assert "| xz -9 (compressor, the whole set as one stream) | — | 1.250 | 1.250 |" in text
    assert "| Kneser–Ney 6-gram (5 bytes of context" in text
    row = next(line for line in text.splitlines() if line.startswith("| fox | 2 |"))
    at48 = [next(e["val_bpb"] for e in r["by_length"] if e["context"] == 48) for r in fox]
    mean = statistics.fmean(at48)
    assert f"{mean:.3f} ({min(at48):.3f}–{max(at48):.3f})" in row
    assert "| expanding_mf | 1 |" in text
    assert "Certified windows" in text and "Credible windows" in text and "Passkey" in text
    other = dict(anchors, manifest_sha256="0" * 64)
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="corpora"):
        table.main(["--runs", str(keep), "--anchors", str(tmp_path / "other.json"),
                    "--out", str(tmp_path)])


def test_a_spread_prints_a_range_only_where_the_seeds_differ_at_its_digits():
    spread = _load("lm_table").spread
    assert spread([]) == "—"
    assert spread([1.25]) == "1.250" and spread([36104.0], 0) == "36104"
    assert spread([30.0001, 29.9999], 1) == "30.0"
    assert spread([1.0, 1.5]) == "1.250 (1.000–1.500)"


ROOT = GALLERY.parent


def test_the_committed_table_is_its_records_and_the_readmes_hold_it(tmp_path):
    """gallery/results/lm_table.md is what lm_table.py makes of the committed records, and
    the README, the gallery's README and the gallery page show its main table."""
    table = _load("lm_table")
    table.main(["--out", str(tmp_path)])
    committed = (GALLERY / "results" / "lm_table.md").read_text()
    assert (tmp_path / "lm_table.md").read_text() == committed
    lines = committed.splitlines()
    start = next(k for k, line in enumerate(lines) if line.startswith("| variant | seeds |"))
    end = next((k for k in range(start, len(lines)) if not lines[k].startswith("|")),
               len(lines))
    rows = lines[start:end]
    assert len(rows) >= 3 + 5  # header, rule, the anchors and at least one variant
    for doc in ("README.md", "gallery/README.md", "docs/gallery/language-model.md"):
        text = (ROOT / doc).read_text()
        missing = [r for r in rows if r not in text]
        assert not missing, f"{doc} lacks the table's rows {missing[:2]} (run gallery/lm_table.py)"


def test_the_committed_records_were_trained_on_the_corpus_the_table_names():
    """Every record under gallery/results/lm_table/ carries the manifest of the corpus
    ``lm_corpus.CORPUS_SHA256`` names (Python 3.11.7's standard library; a record that states
    its corpus hash states that one), and the table says so."""
    table, corpus = _load("lm_table"), _load("lm_corpus")
    records = sorted((GALLERY / "results" / "lm_table").glob("*_seed?.json"))
    assert records
    for path in records:
        r = json.loads(path.read_text())
        assert r["manifest_sha256"] == corpus.CORPUS_MANIFEST_SHA256, path.name
        assert r.get("corpus_sha256", corpus.CORPUS_SHA256) == corpus.CORPUS_SHA256, path.name
        assert table.corpus_of(r) == corpus.CORPUS_SHA256
    first = (GALLERY / "results" / "lm_table.md").read_text().splitlines()[0]
    assert f"corpus sha256 {corpus.CORPUS_SHA256[:16]}" in first
    other = table.corpus_of({"manifest_sha256": "0" * 64})
    assert "not the LM table's" in table.corpus_line(other)


def test_the_table_names_a_bfloat16_runs_precision(runs, tmp_path):
    """Runs trained with --dtype bfloat16 (autocast) say so in the table's first line."""
    table = _load("lm_table")
    _, keep = runs
    folder = tmp_path / "bf16"
    folder.mkdir()
    for path in keep.glob("*_seed*.json"):
        record = json.loads(path.read_text())
        (folder / path.name).write_text(json.dumps(dict(record, dtype="bfloat16")))
    table.main(["--runs", str(folder), "--anchors", str(tmp_path / "none.json"),
                "--out", str(tmp_path)])
    first = (tmp_path / "lm_table.md").read_text().splitlines()[0]
    assert first.startswith("Device: cpu (bfloat16, autocast);"), first
