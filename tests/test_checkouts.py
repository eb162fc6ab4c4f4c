"""The layout of a checkout: the catalogue and the ground truth are the folders ``models/`` and
``inference/`` at the repository's top, which the package reaches through links committed in
git (``structattn/models -> ../models``, ``structattn/inference -> ../inference``), so that
setuptools finds them as ``structattn.models`` and ``structattn.inference`` without a hand-kept
list or a folder mapping. What that must keep true: every walk over the package's files sees
them; a clone without its links says so on import, in one line; and of two checkouts, one
installed editable and one on ``PYTHONPATH``, each imports only its own files."""

import json
import os
import pathlib
import subprocess
import sys
import sysconfig
import textwrap

import pytest

from structattn import _links

from .staging import once, stage
from .tree import files, packages

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: what a checkout needs to be installed and imported
PARTS = ("structattn", *_links.LINKED, "pyproject.toml", "README.md")
#: the environment of every command: nothing of this session's Python paths
CLEAN = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}


def test_the_package_reaches_the_catalogue_and_the_inference_through_relative_links():
    for name in _links.LINKED:
        link = ROOT / "structattn" / name
        assert link.is_symlink() and os.readlink(link) == f"../{name}", link
        assert (ROOT / name / "__init__.py").is_file(), name
    walked = {p.relative_to(ROOT).as_posix() for p in files(ROOT / "structattn")}
    assert {"structattn/models/__init__.py", "structattn/inference/exact.py"} <= walked
    assert {"structattn.models", "structattn.inference"} <= packages(ROOT)


@pytest.mark.parametrize("broken", ["a text file", "a dangling link"])
def test_a_clone_without_its_links_says_so_in_one_line(broken, tmp_path):
    """``git clone`` with ``core.symlinks=false`` writes each link as a text file holding its
    target; a copy of ``structattn/`` alone keeps links to folders it left behind."""
    clone = stage(tmp_path / "clone", *PARTS)
    if broken == "a text file":
        (clone / "structattn" / "models").unlink()
        (clone / "structattn" / "models").write_text("../models")
    else:
        (clone / "structattn" / "models").resolve().rename(tmp_path / "elsewhere")
    proc = subprocess.run([sys.executable, "-c", "import structattn"], cwd=clone, env=CLEAN,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: structattn/models "), proc.stderr[-2000:]
    assert "core.symlinks=true" in last and "install the wheel" in last, last
    if broken == "a text file":
        assert "is a file" in last and "core.symlinks=false" in last, last
    else:
        assert "links to '../models', which is not a folder" in last, last


#: what each checkout's python imports, and where each module's file really is
PROBE = """
import importlib, json, pathlib
names = ["structattn", "structattn.models", "structattn.models.self_attention",
         "structattn.inference", "structattn.inference.exact"]
print(json.dumps({n: str(pathlib.Path(importlib.import_module(n).__file__).resolve())
                  for n in names}))
"""


def _checkouts(folder: pathlib.Path) -> None:
    """Two copies of the package, ``a`` and ``b``, and an environment ``env`` with ``a``
    installed editable; pip's output and exit status in ``install.log`` and
    ``install.returncode``."""
    for name in ("a", "b"):
        stage(folder / name, *PARTS)
    env = folder / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True,
                   env=CLEAN, capture_output=True, timeout=300)
    python = env / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, env=CLEAN, capture_output=True, text=True, timeout=300).stdout.strip()
    # this environment's libraries (torch, pyro, pip, setuptools) as plain path entries: the
    # new environment runs only its own path files, so an editable install of another
    # checkout into this environment (its finder) does not come along
    paths = sysconfig.get_paths()
    pathlib.Path(site, "outer.pth").write_text(f"{paths['purelib']}\n{paths['platlib']}\n")
    proc = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-build-isolation",
                           "--no-index", "--disable-pip-version-check", "-e", str(folder / "a")],
                          cwd=folder, env=CLEAN, capture_output=True, text=True, timeout=600)
    (folder / "install.log").write_text(proc.stdout + proc.stderr)
    (folder / "install.returncode").write_text(str(proc.returncode))


@pytest.fixture(scope="module")
def checkouts(tmp_path_factory):
    folder = once(tmp_path_factory, "checkouts", _checkouts)
    log = (folder / "install.log").read_text()
    assert (folder / "install.returncode").read_text() == "0", log[-3000:]
    return folder


@pytest.mark.parametrize("on_path", ["b", None], ids=["b on PYTHONPATH", "no PYTHONPATH"])
def test_each_checkout_imports_only_its_own_files(checkouts, on_path):
    """``a`` installed editable; with ``b`` on ``PYTHONPATH`` the package, the catalogue, the
    inference and a module of each are ``b``'s files; without it, ``a``'s."""
    env = dict(CLEAN)
    if on_path:
        env["PYTHONPATH"] = str(checkouts / on_path)
    proc = subprocess.run([str(checkouts / "env" / "bin" / "python"), "-c", textwrap.dedent(PROBE)],
                          cwd=checkouts, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.splitlines()[-1])
    own, other = ((checkouts / "b", checkouts / "a") if on_path else
                  (checkouts / "a", checkouts / "b"))
    for name, path in found.items():
        path = pathlib.Path(path)
        assert path.is_relative_to(own.resolve()) and not path.is_relative_to(other.resolve()), \
            (name, str(path))
    assert pathlib.Path(found["structattn.models"]).parent == (own / "models").resolve()
    assert pathlib.Path(found["structattn.inference.exact"]).parent == (own / "inference").resolve()
