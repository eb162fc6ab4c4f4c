"""``structattn render MODEL`` / ``structattn list`` (structattn/cli.py)."""

import re

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


@pytest.mark.parametrize("option, value, shown", [("--heads", "0", "0"), ("--inputs", "-3", "-3"),
                                                  ("--top-k", "two", "'two'"),
                                                  ("--max-nodes", "0", "0")])
def test_command_line_sizes_are_checked_by_argparse(tmp_path, capsys, option, value, shown):
    """A zero, negative or non-int size is a usage error naming the option (exit status 2, no
    traceback), before anything is built."""
    from structattn.cli import main

    argv = ["render", "multihop_attention", "--inputs", "6", "--out", str(tmp_path / "m.png")]
    with pytest.raises(SystemExit) as stop:
        main([*argv, option, value])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert re.search(rf"structattn render: error: argument {option}: must be a positive int; "
                     rf"got {re.escape(shown)}\n$", err), err
    assert "Traceback" not in err


def test_command_line_reports_a_model_that_refuses_its_sizes(tmp_path, capsys):
    """Sizes that are ints but that the model refuses (3 heads of an 8-wide model): the model's
    own message, exit status 2."""
    from structattn.cli import main

    assert main(["render", "multihop_attention", "--heads", "3", "--out",
                 str(tmp_path / "m.dot")]) == 2
    assert re.search(r"structattn render: MultihopAttention: d_model=8 is not divisible by "
                     r"heads=3", capsys.readouterr().err)


def test_command_line_plots_long_sequences_instead_of_drawing_a_graph(tmp_path, capsys):
    from structattn.cli import main

    out = tmp_path / "big.png"
    assert main(["render", "self_attention", "--inputs", "300", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "more than 64 nodes in a family; plotting the attention" in capsys.readouterr().err


@pytest.mark.parametrize("suffix", ["svg", "dot", "png"])
def test_a_path_under_a_file_is_refused_naming_it(tmp_path, capsys, suffix):
    """An impossible --out: the path and the part of it that is a file, exit status 2, no
    traceback and no intermediate file the user never named."""
    from structattn.cli import main

    blocker = tmp_path / "notes.txt"
    blocker.write_text("a file")
    out = blocker / f"a.{suffix}"
    assert main(["render", "self_attention", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == (f"structattn render: cannot write {str(out)!r}: {str(blocker)!r} is a file, "
                   f"not a directory\n")
    with pytest.raises(sa.RenderError, match=r"is a file, not a directory"):
        sa.save(sa.render(sa.models.self_attention(8, heads=2)), out)


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_an_unwritable_directory_is_refused_naming_the_path(capsys):
    from structattn.cli import main

    assert main(["render", "self_attention", "--out", "/proc/a.svg"]) == 2
    assert main(["render", "expanding_attention", "--inputs", "100", "--out", "/proc/a.png"]) == 2
    err = capsys.readouterr().err
    assert "structattn render: cannot write '/proc/a.svg': " in err
    assert "structattn render: cannot write '/proc/a.png': " in err
    assert "Traceback" not in err and ".gv" not in err


@pytest.mark.parametrize("option", ["--scale", "--threshold"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "big"])
def test_scale_and_threshold_must_be_finite_numbers(tmp_path, capsys, option, value):
    from structattn.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["render", "self_attention", "--inputs", "4", f"{option}={value}",
              "--out", str(tmp_path / "a.svg")])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert re.search(rf"argument {option}: must be a (finite )?number; got '{re.escape(value)}'",
                     err), err
    assert "sa." not in err and "Traceback" not in err
