"""gallery/hf_convert_lm.py: a tiny run (``--quick``) trains a stock Llama over bytes, converts
it to FoX and ALiBi, fine-tunes them, and writes its records and figure: bits per byte at every
evaluation length for each model, and the certified cache's generation. No timing is
asserted (the script reports its own)."""

import json
import os
import pathlib
import subprocess
import sys

from .hf import transformers  # noqa: F401 - skips without the transformers extra

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODELS = {"stock", "fox, converted", "fox, fine-tuned", "alibi, converted", "alibi, fine-tuned",
          "stock, trained on"}


def test_quick_run_writes_its_records_and_figure(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    out = subprocess.run([sys.executable, str(ROOT / "gallery" / "hf_convert_lm.py"), "--quick",
                          "--threads", "1", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert (tmp_path / "hf_convert_lm.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    record = json.loads((tmp_path / "hf_convert_lm.json").read_text())
    lengths = record["args"]["eval_lengths"]
    assert lengths == [32, 64, 128]  # the training length, 2× and 4×
    assert set(record["bpb"]) == MODELS
    for values in record["bpb"].values():
        assert set(values) == {str(n) for n in lengths}
        assert all(0 < v < 9 for v in values.values())
    # FoX's gates start almost open: the converted model reads as the stock one
    for n in lengths:
        assert abs(record["bpb"]["fox, converted"][str(n)] - record["bpb"]["stock"][str(n)]) < 0.05
    assert set(record["training"]) == {"stock", "fox", "alibi", "stock, trained on"}
    assert all(t["steps"] > 0 for t in record["training"].values())
    for variant in ("fox", "alibi"):
        g = record["generation"][variant]
        # the cache read the prompt and every byte generated but the last
        assert g["generated"] == 24 and g["read"] == len(g["prompt"].encode()) + 23
        assert len(g["held"]) == len(g["evicted"]) == 2  # one entry per layer
        assert all(h + e == g["read"] for h, e in zip(g["held"], g["evicted"], strict=True))
        assert g["certified"] is True and 0 <= g["bound"] <= g["tol"]
        assert isinstance(g["sample"], str) and g["sample"]
