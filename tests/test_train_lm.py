"""gallery/train_lm.py at a tiny size: the corpus is split by file with a manifest, written to
a file and read back by its hash, and refused when it is not the LM table's; every attention
variant trains without NaN (float32, and bfloat16 under autocast), a run stopped and resumed
from its checkpoint equals an uninterrupted one, a time budget reports its last step, the
report is written, and the sliding window declared there is what Pyro enumerates."""

import importlib.util
import json
import math
import pathlib
import sys

import pytest
import torch

import structattn as sa

GALLERY = pathlib.Path(__file__).resolve().parents[1] / "gallery"


@pytest.fixture(scope="module")
def lm():
    spec = importlib.util.spec_from_file_location("train_lm", GALLERY / "train_lm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TINY = ["--context", "24", "--d-model", "16", "--layers", "1", "--heads", "2", "--batch", "2",
        "--eval-every", "2", "--eval-windows", "2", "--max-files", "40", "--window", "8",
        "--final-eval", "windows", "--any-corpus"]  # 40 files: not the LM table's corpus


def test_the_corpus_is_split_by_file_with_a_manifest(lm):
    train, val, manifest = lm.stdlib_corpus(max_files=40)
    again = lm.stdlib_corpus(max_files=40)[2]
    assert manifest["sha256"] == again["sha256"] and manifest["files"] == 40
    splits = [e["split"] for e in manifest["entries"]]
    assert splits[::20] == ["validation"] * 2 and splits.count("validation") == 2
    assert len(train) == manifest["train_bytes"] and len(val) == manifest["validation_bytes"]
    paths = [e["path"] for e in manifest["entries"]]
    assert paths == sorted(paths) and all(p.endswith(".py") for p in paths)
    assert train.dtype == torch.uint8 and int(train.max()) < 256


def test_every_variant_trains_without_nan(lm, tmp_path):
    results = lm.main([*TINY, "--steps", "2", "--attention", *lm.ATTENTIONS,
                       "--out", str(tmp_path)])
    assert [r["variant"] for r in results] == lm.ATTENTIONS
    for r in results:
        assert r["steps"] == 2 and all(torch.isfinite(torch.tensor(e["val_bpb"]))
                                       for e in r["history"]), r
        assert r["tokens_per_second"] > 0 and r["heads"][0]["mean_attention_distance"]
        assert r["device"] == "cpu" and r["peak_gpu_mib"] is None
    table = (tmp_path / "lm_results.md").read_text()
    assert all(f"| {v} |" in table for v in lm.ATTENTIONS)
    assert (tmp_path / "lm_val_bpb.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "lm_expanding_priors.png").exists()
    assert json.loads((tmp_path / "manifest.json").read_text())["files"] == 40


@pytest.mark.parametrize("variant", ["causal", "expanding_mf"])
def test_a_resumed_run_continues_as_an_uninterrupted_one(lm, tmp_path, variant):
    common = [*TINY, "--steps", "6", "--attention", variant]
    straight = lm.main([*common, "--out", str(tmp_path / "straight")])[0]
    stopped = lm.main([*common, "--stop-after", "3", "--out", str(tmp_path / "split")])[0]
    assert stopped["steps"] == 3
    resumed = lm.main([*common, "--resume", "--out", str(tmp_path / "split")])[0]
    assert resumed["steps"] == 6
    def numbers(r):  # all but the wall time
        return [(e["step"], e["train_loss"], e["val_bpb"]) for e in r["history"]]

    assert numbers(resumed) == numbers(straight)  # the same numbers, bit for bit
    saved = torch.load(tmp_path / "split" / f"{variant}_T24" / "checkpoint.pt",
                       weights_only=True)
    want = torch.load(tmp_path / "straight" / f"{variant}_T24" / "checkpoint.pt",
                      weights_only=True)
    for name, t in want["model"].items():
        assert torch.equal(saved["model"][name], t), name


def test_the_sliding_window_is_what_pyro_enumerates(lm):
    torch.manual_seed(0)
    m = lm.SlidingWindowAttention(6, window=3, heads=2, dtype=torch.float64)
    x = torch.randn(1, 7, 6, dtype=torch.float64)
    exact = sa.inference.exact(m, x)
    y, post = sa.compile(m)(x, return_posterior=True)
    torch.testing.assert_close(y, exact.output, rtol=0, atol=1e-10)
    torch.testing.assert_close(post, exact.marginals["attn"], rtol=0, atol=1e-10)
    i, j = torch.arange(7)[:, None], torch.arange(7)[None, :]
    assert (post[0, :, (i - j < 1) | (i - j > 3)] == 0).all()


def test_two_ranks_under_torchrun(tmp_path):
    """``torchrun`` (gloo, two processes): each rank trains on its half of the global batch,
    DDP averages; rank 0 writes the result and the report."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(GALLERY / "train_lm.py"), *TINY, "--steps", "2", "--attention", "stick_breaking",
         "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("world size 2") == 1  # rank 0 speaks
    result = json.loads((tmp_path / "stick_breaking_T24" / "result.json").read_text())
    assert result["world_size"] == 2 and result["steps"] == 2
    assert all(math.isfinite(e["val_bpb"]) for e in result["history"])


def test_the_final_figure_reads_every_validation_byte_beside_the_compressors(lm, tmp_path):
    """--final-eval whole (the default): every validation byte once, in consecutive windows of
    the context, each predicted from the bytes before it in its window; and zlib, bz2 and xz
    on the same bytes in the table."""
    import zlib

    args = [a for a in TINY if a not in ("--final-eval", "windows")]
    (r,) = lm.main([*args, "--steps", "2", "--attention", "rope", "--out", str(tmp_path)])
    _, val, _ = lm.stdlib_corpus(max_files=40)
    whole = r["whole_validation"]
    assert whole["bytes"] == (len(val) - 1) // 24 * 24
    assert 0 < whole["val_bpb"] < 9
    x, y = lm.whole_windows(val, 24)  # consecutive: each window's targets follow its inputs
    assert torch.equal(x[1:, 0], y[:-1, -1]) and torch.equal(y.flatten(), val[1:1 + y.numel()].long())
    raw = bytes(val.tolist())
    assert r["anchors"]["zlib -9"] == pytest.approx(8 * len(zlib.compress(raw, 9)) / len(raw))
    assert set(r["anchors"]) == {"zlib -9", "bz2 -9", "xz -9"}
    table = (tmp_path / "lm_results.md").read_text()
    assert "| zlib -9 (compressor) |" in table and f"| {whole['val_bpb']:.3f} |" in table


def test_a_trained_model_is_read_beyond_its_training_length(lm, tmp_path):
    """--eval-lengths: the final model read in windows longer than the training context, on
    the first --eval-bytes validation bytes, with a picture of bits/byte against length."""
    (r,) = lm.main([*TINY, "--steps", "2", "--attention", "fox", "--eval-lengths", "24", "96",
                    "--eval-bytes", "2000", "--out", str(tmp_path)])
    lengths = [e["context"] for e in r["by_length"]]
    assert lengths == [24, 96]
    assert [e["bytes"] for e in r["by_length"]] == [1999 // 24 * 24, 1999 // 96 * 96]
    assert all(0 < e["val_bpb"] < 9 for e in r["by_length"])
    assert (tmp_path / "lm_extrapolation.png").read_bytes()[:4] == b"\x89PNG"


def test_a_time_budget_warms_up_and_decays_over_its_minutes(lm):
    """With ``--minutes`` the schedule follows the fraction of the time trained where that is
    further along than the steps: 5% warm-up, then cosine to 0 at the budget's end; a step
    budget keeps its own schedule, value for value."""
    lr, steps = 3e-3, 10 ** 9  # a step count a time budget never reaches
    assert lm.learning_rate(10, steps, lr, progress=0.025) == pytest.approx(lr / 2)
    assert lm.learning_rate(10, steps, lr, progress=0.05) == pytest.approx(lr)
    assert lm.learning_rate(10, steps, lr, progress=0.525) == pytest.approx(lr / 2)
    assert lm.learning_rate(10, steps, lr, progress=1.0) == pytest.approx(0.0, abs=1e-18)
    warm = 250 // 20  # the step schedule, as written, at 250 steps
    for step in (0, 5, 12, 100, 249):
        want = lr * (step + 1) / warm if step < warm else 0.5 * lr * (
            1 + math.cos(math.pi * (step - warm) / (250 - warm)))
        assert lm.learning_rate(step, 250, lr) == want
        assert lm.learning_rate(step, 250, lr, progress=0.0) == want  # the steps further along


def test_a_device_without_cuda_is_refused_by_name(lm, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(SystemExit):
        lm.main(["--device", "cuda", "--steps", "1"])
    assert "--device cuda: no CUDA device here" in capsys.readouterr().err


def test_every_variant_trains_under_bfloat16_autocast(lm, tmp_path):
    """--dtype bfloat16: the forward runs under torch.autocast (bfloat16 logits), the
    parameters stay float32, and no variant's loss or validation figure is NaN."""
    results = lm.main([*TINY, "--steps", "1", "--eval-every", "1", "--dtype", "bfloat16",
                       "--attention", *lm.ATTENTIONS, "--out", str(tmp_path)])
    assert [r["variant"] for r in results] == lm.ATTENTIONS
    for r in results:
        assert r["dtype"] == "bfloat16" and math.isfinite(r["final_val_bpb"]), r
        assert math.isfinite(r["history"][-1]["train_loss"])
    model = lm.ByteLM(16, 1, 2, "fox", 8)
    x = torch.randint(0, 256, (2, 24))
    with lm.precision(torch.device("cpu"), "bfloat16"):
        assert model(x).dtype == torch.bfloat16
    assert model(x).dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_a_time_budget_that_ends_before_any_evaluation_reports_its_last_step(lm, tmp_path):
    """--minutes with --final-eval windows and no evaluation due during training: the sampled
    windows are read once at the last step, and that figure is the saved model's."""
    (r,) = lm.main([*TINY, "--steps", "100000", "--eval-every", "100000", "--minutes", "0.0005",
                    "--attention", "causal", "--out", str(tmp_path)])
    assert r["steps"] < 100000 and r["whole_validation"] is None
    assert [e["step"] for e in r["history"]] == [r["steps"]]
    model = lm.ByteLM(16, 1, 2, "causal", 8)
    state = torch.load(tmp_path / "causal_T24" / "checkpoint.pt", weights_only=True)
    assert state["step"] == r["steps"] and state["history"] == []
    model.load_state_dict(state["model"])
    _, val, _ = lm.stdlib_corpus(max_files=40)
    want = lm.bits_per_byte(model, lm.validation_windows(val, 2, 24))
    assert r["final_val_bpb"] == pytest.approx(want, rel=1e-6)


def test_the_corpus_travels_as_a_file_named_by_its_hash(lm, tmp_path):
    """--write-corpus writes the corpus built here (the same file twice); --corpus reads it
    back byte for byte, with its manifest and hash, and trains on it; a damaged file is
    refused."""
    import hashlib

    path = tmp_path / "c.gz"
    assert lm.main(["--write-corpus", str(path), "--max-files", "40",
                    "--out", str(tmp_path / "w")]) == str(path)
    first = path.read_bytes()
    lm.main(["--write-corpus", str(path), "--max-files", "40", "--out", str(tmp_path / "w")])
    assert path.read_bytes() == first
    train, val, manifest = lm.stdlib_corpus(max_files=40)
    train2, val2, manifest2 = lm.lm_corpus.read_corpus(path)
    assert torch.equal(train, train2) and torch.equal(val, val2)
    assert manifest2["sha256"] == manifest["sha256"] and manifest2["entries"] == manifest["entries"]
    want = hashlib.sha256(hashlib.sha256(bytes(train.tolist())).digest()
                          + hashlib.sha256(bytes(val.tolist())).digest()).hexdigest()
    assert manifest["corpus_sha256"] == manifest2["corpus_sha256"] == want
    args = [a for a in TINY if a not in ("--max-files", "40")]
    (r,) = lm.main([*args, "--corpus", str(path), "--steps", "2", "--attention", "causal",
                    "--out", str(tmp_path / "run")])
    assert r["corpus_sha256"] == want and r["manifest_sha256"] == manifest["sha256"]
    import gzip

    raw = gzip.decompress(first)
    bad = tmp_path / "bad.gz"
    bad.write_bytes(gzip.compress(raw[:-1] + bytes([raw[-1] ^ 1])))
    with pytest.raises(ValueError, match="a damaged file"):
        lm.lm_corpus.read_corpus(bad)


def test_the_scripts_that_read_a_model_read_the_corpus_it_trained_on(lm, tmp_path):
    """``corpus_of`` (what lm_probes, lm_anchors, passkey_probe and generate_lm read): the
    ``--corpus`` file byte for byte, else the library's first ``--max-files`` files, never both;
    ``corpus_arguments``: the train_lm arguments that train on the same corpus."""
    from argparse import Namespace

    corpus = lm.lm_corpus
    path = tmp_path / "c.gz"
    corpus.write_corpus(path, *lm.stdlib_corpus(max_files=40))
    train, val, manifest = corpus.corpus_of(Namespace(corpus=str(path), max_files=None), "x")
    train2, val2, manifest2 = corpus.corpus_of(Namespace(corpus=None, max_files=40), "x")
    assert torch.equal(train, train2) and torch.equal(val, val2)
    assert manifest["sha256"] == manifest2["sha256"]
    with pytest.raises(SystemExit, match=r"^x: --corpus reads a whole corpus file and "
                                         r"--max-files builds a smaller one"):
        corpus.corpus_of(Namespace(corpus=str(path), max_files=40), "x")
    assert corpus.corpus_arguments(Namespace(corpus=str(path), max_files=None)) == [
        "--corpus", str(path)]
    assert corpus.corpus_arguments(Namespace(corpus=None, max_files=40)) == [
        "--max-files", "40", "--any-corpus"]
    assert corpus.corpus_arguments(Namespace(corpus=None, max_files=None)) == []
    p = __import__("argparse").ArgumentParser()
    corpus.add_corpus_argument(p)
    assert p.parse_args(["--corpus"]).corpus == str(corpus.CORPUS_FILE)
    assert p.parse_args([]).corpus is None


def test_a_corpus_that_is_not_the_tables_is_refused_in_one_line(lm, tmp_path, capsys):
    """The LM table's corpus is named by its hash: another one (here 40 files of this
    library) trains only with --any-corpus; the refusal names both hashes and the way out."""
    args = [a for a in TINY if a != "--any-corpus"]
    with pytest.raises(SystemExit) as refused:
        lm.main([*args, "--steps", "1", "--out", str(tmp_path)])
    message = str(refused.value)
    assert "\n" not in message and "--any-corpus" in message and "--corpus PATH" in message
    assert lm.lm_corpus.CORPUS_SHA256[:16] in message
    assert lm.stdlib_corpus(max_files=40)[2]["corpus_sha256"][:16] in message
    assert not list(tmp_path.glob("*/result.json"))


@pytest.mark.skipif(sys.version_info[:3] != (3, 11, 7),
                    reason="the LM table's corpus is Python 3.11.7's standard library; this "
                           f"Python is {sys.version.split()[0]}")
def test_this_pythons_library_is_the_tables_corpus(lm):
    """Built here, the corpus has the hash the table names, and the manifest hash every
    record of the table carries (tests/test_lm_table.py checks the records); its validation
    bytes give the compressors' figures the records hold, to the last digit."""
    import bz2
    import zlib

    train, val, manifest = lm.stdlib_corpus()
    assert manifest["corpus_sha256"] == lm.lm_corpus.CORPUS_SHA256
    assert manifest["sha256"] == lm.lm_corpus.CORPUS_MANIFEST_SHA256
    assert (manifest["files"], len(train), len(val)) == (1790, 30012231, 1514783)
    record = json.loads((GALLERY / "results" / "lm_table" / "fox_seed0.json").read_text())
    raw = bytes(val.numpy())
    assert 8 * len(zlib.compress(raw, 9)) / len(raw) == record["anchors"]["zlib -9"]
    assert 8 * len(bz2.compress(raw, 9)) / len(raw) == record["anchors"]["bz2 -9"]
