"""Gallery scripts run in the test suite with tiny sizes (STYLE.md); each writes pictures."""

import importlib.util
import pathlib

import pytest

GALLERY = pathlib.Path(__file__).resolve().parents[1] / "gallery"
RUN_IN_TESTS = {"plot_quickstart.py": ["--quick"]}


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
        assert data[:8] == b"\x89PNG\r\n\x1a\n" or data.lstrip()[:5] in (b"<?xml", b"<svg ")
