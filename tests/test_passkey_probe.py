"""gallery/passkey_probe.py: the planted sequence is what it says, and a tiny run writes its
table, figure and records."""

import importlib.util
import json
import pathlib

import torch

GALLERY = pathlib.Path(__file__).resolve().parents[1] / "gallery"


def _load():
    spec = importlib.util.spec_from_file_location("passkey_probe", GALLERY / "passkey_probe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_passkey_is_planted_and_asked_for():
    probe = _load()
    text = torch.tensor(list(b"def f(x):\n    return x + 1\n" * 20), dtype=torch.uint8)
    tokens, keys, answers = probe.trial(text, 100, torch.Generator().manual_seed(0))
    seq = bytes(tokens.tolist())
    assert seq.startswith(b"pass key: ") and seq[keys[0] - 10:keys[0]] == b"pass key: "
    assert torch.equal(tokens[keys], tokens[answers])  # the answer is the key
    assert all(chr(c).isdigit() for c in tokens[keys].tolist())
    assert seq[answers[0] - 11:answers[0]] == b" pass key: "
    assert int(answers[0] - keys[-1]) > 100  # the filler lies between


def test_a_tiny_run_writes_its_table_and_figure(tmp_path):
    written = _load().main(["--quick", "--out", str(tmp_path)])
    assert [pathlib.Path(p).name for p in written] == ["passkey.md", "passkey.png",
                                                      "passkey.json"]
    assert (tmp_path / "passkey.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = json.loads((tmp_path / "passkey.json").read_text())["rows"]
    assert len(rows) == 2 * 2  # two variants, two distances
    for r in rows:
        assert 0 <= r["accuracy"] <= 1 and 0 <= r["planted_edge_mass"] <= 1 + 1e-9
        assert 0 < r["uniform_mass"] < 1
