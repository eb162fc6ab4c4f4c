"""``structattn render MODEL`` / ``structattn list`` (structattn/cli.py)."""

import pytest

import structattn as sa


def test_command_line_renders_catalogue_models(tmp_path, capsys):
    from structattn.cli import main

    out = tmp_path / "sa.svg"
    assert main(["render", "self_attention", "--out", str(out)]) == 0
    assert out.read_text().lstrip().startswith(("<?xml", "<svg"))
    out = tmp_path / "hop.dot"
    assert main(["render", "hopfield", "--inputs", "4", "--heads", "1", "--labels",
                 "--out", str(out)]) == 0
    assert "inferred" in out.read_text()
    assert main(["list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in sa.models.REGISTRY)
    with pytest.raises(SystemExit, match="unknown model 'nope'"):
        main(["render", "nope", "--out", str(out)])
    assert main(["render", "self_attention", "--inputs", "100", "--out", str(out)]) == 2
    assert "max_nodes" in capsys.readouterr().err
