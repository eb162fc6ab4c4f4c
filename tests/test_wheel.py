"""The release as a user gets it: ``python -m build`` makes a wheel and an sdist (the sdist
first, the wheel from it), each holding every package of the source tree — the catalogue and
the ground truth, which a checkout holds as links to ``models/`` and ``inference/``, as plain
folders ``structattn/models`` and ``structattn/inference``; the wheel,
installed into an empty virtual environment that has torch alone (this environment's, lent
through a ``.pth``; pip installs the rest from the index), imports every subpackage, compiles
and runs every catalogue model, builds a C++ kernel from its own sources and renders from the
command line — all from a directory outside the repository, so nothing of the clone can be
imported by accident.

Needs the package index (the build's own environment, the wheel's dependencies): marked
``network``, deselected offline with ``-m "not slow and not network"``; ``.ci/run`` runs it.
"""

import os
import pathlib
import stat
import subprocess
import sys
import tarfile
import textwrap
import zipfile

import pytest

from .staging import once, stage
from .tree import files, packages

ROOT = pathlib.Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.network

#: what the fresh environment runs, from a directory outside the repository
PROBE = r"""
import importlib, os, pathlib, pkgutil, sys
import torch
import structattn as sa
here = pathlib.Path(sa.__file__).resolve().parent
assert "site-packages" in str(here), here  # the installed wheel, not a clone
imported = []
for info in pkgutil.walk_packages(sa.__path__, "structattn."):
    # the Triton kernels' modules import Triton, the ``gpu`` extra, which is not installed here
    if info.name.startswith("structattn.triton_kernels."):
        assert not sa.triton_kernels.available()
        continue
    # the transformers extra is not installed here either: its package refuses, naming it
    if info.name.startswith("structattn.integrations.transformers"):
        try:
            importlib.import_module(info.name)
        except ImportError as err:
            assert "structattn[transformers]" in str(err), err
        continue
    importlib.import_module(info.name)
    imported.append(info.name)
packages = sorted(n for n in imported if n.count(".") == 1 and
                  (here / n.split(".")[1] / "__init__.py").exists())
print("PACKAGES", " ".join(packages))
# every catalogue model, compiled and run on its own small case (read, record, replay), on
# the Python readings (each kernel's build takes about a minute; one is built below)
torch.manual_seed(0)
with sa.kernels.disabled():
    for name, entry in sorted(sa.models.CATALOGUE.items()):
        model, inputs = entry.case()
        layer = sa.compile(model)
        for _ in range(3):
            out = layer(*inputs)
        out = out[0] if isinstance(out, tuple) else out
        assert torch.isfinite(out).all(), name
print("MODELS", len(sa.models.CATALOGUE))
# a C++ kernel built from the wheel's own source, in an empty extensions directory
source = here / "csrc" / "stick_breaking.cpp"
assert source.exists(), source
print("KERNEL", sa.kernels.stick_breaking() is not None, sa.kernels.build_error())
"""


#: the environment of every command: nothing of this session's Python paths (a clone on
#: PYTHONPATH, or its egg-info, would satisfy pip and shadow the wheel)
CLEAN = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}


def _run(cmd, **kw):
    kw.setdefault("env", CLEAN)
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def _source_packages() -> set:
    """Every folder with an ``__init__.py`` under structattn/, its links followed."""
    return packages(ROOT)


def _same_packages(names, where: str) -> None:
    """The packages among ``names`` (paths in a wheel or an sdist) are the source tree's; a
    package folder missing from ``where`` is named."""
    found = {n.removesuffix("/__init__.py").replace("/", ".") for n in names
             if n.startswith("structattn/") and n.endswith("/__init__.py")}
    source = _source_packages()
    assert found == source, (f"{where} lacks {sorted(source - found)} "
                             f"and holds {sorted(found - source)} beyond the source tree")


def _build(out: pathlib.Path) -> None:
    # built from a copy: the build writes structattn-X.Y.Z/, build/ and structattn.egg-info
    # where it runs, which in the clone raced the rest of the suite (the sdist's staging tree
    # lost files it had just made)
    source = stage(out / "source")
    _run([sys.executable, "-m", "build", "--outdir", str(out / "dist"), str(source)], timeout=900)


def _lend_torch(env_dir: pathlib.Path, folder: pathlib.Path) -> tuple[str, str]:
    """Puts this environment's torch, and nothing else of it, on the path of the environment
    at ``env_dir``: links to torch's packages and its metadata in ``folder``, named by a
    ``.pth`` file. The wheel's environment then has the same torch (a local CPU build, not a
    CUDA one) that installing it there gave, without unpacking its 700 MB again; pip still
    installs the wheel's every other dependency, and torch's own, from the index. Returns
    the version and the file that ``import torch`` there must give."""
    import importlib.metadata

    import torch

    dist = importlib.metadata.distribution("torch")
    site = pathlib.Path(dist.locate_file(""))
    folder.mkdir()
    metadata = next(f for f in dist.files if f.name == "METADATA").parent  # its .dist-info
    for name in [*dist.read_text("top_level.txt").split(), str(metadata)]:
        (folder / name).symlink_to(site / name)  # torch, functorch, torchgen and the metadata
    (purelib,) = env_dir.glob("lib/python*/site-packages")
    (purelib / "suite_torch.pth").write_text(f"{folder}\n")
    return torch.__version__, str(folder / "torch" / "__init__.py")


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    """The wheel and the sdist, built once per session (whichever worker asks first)."""
    out = once(tmp_path_factory, "wheel", _build) / "dist"
    (wheel,) = out.glob("structattn-*.whl")
    (sdist,) = out.glob("structattn-*.tar.gz")
    return wheel, sdist


def test_the_wheel_and_the_sdist_hold_every_package_and_the_kernel_sources(dist):
    wheel, sdist = dist
    with zipfile.ZipFile(wheel) as archive:
        infos = archive.infolist()
    names = [i.filename for i in infos]
    _same_packages(names, "the wheel")
    # the linked folders as files: no link in the archive
    assert [i.filename for i in infos if stat.S_ISLNK(i.external_attr >> 16)] == []
    modules = {p.relative_to(ROOT).as_posix() for p in files(ROOT / "structattn")}
    assert modules - set(names) == set(), "modules missing from the wheel"
    sources = {p.name for p in (ROOT / "structattn" / "csrc").glob("*.cpp")}
    sources |= {p.name for p in (ROOT / "structattn" / "csrc").glob("*.h")}  # what they include
    assert sources and {n.split("/")[-1] for n in names if n.startswith("structattn/csrc/")} \
        == sources
    with tarfile.open(sdist) as tar:
        kinds = {m.name.split("/", 1)[1]: m for m in tar.getmembers() if "/" in m.name}
    members = set(kinds)
    _same_packages(members, "the sdist")
    assert [name for name, m in kinds.items() if not (m.isfile() or m.isdir())] == []
    assert modules - members == set(), "modules missing from the sdist"
    assert {f"structattn/csrc/{s}" for s in sources} <= members


def test_the_wheel_installs_imports_runs_and_renders_outside_the_repository(dist, tmp_path):
    wheel, _ = dist
    env_dir = tmp_path / "env"
    # no pip of its own (ensurepip: seconds): this environment's pip installs into it
    _run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], timeout=300)
    python = env_dir / "bin" / "python"
    # --no-compile: byte-compiling torch's thousands of modules at install is a minute of CPU
    # the probe does not need (Python compiles what it imports)
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet",
           "--disable-pip-version-check", "--no-compile"]
    lent = _lend_torch(env_dir, tmp_path / "torch")
    _run([*pip, str(wheel)], timeout=900)
    found = _run([str(python), "-c", "import torch; print(torch.__version__, torch.__file__)"],
                 cwd=tmp_path, timeout=300)
    assert tuple(found.split()) == lent, found
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {**CLEAN, "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions"), "MPLBACKEND": "Agg"}
    out = _run([str(python), "-c", textwrap.dedent(PROBE)], cwd=work, env=env, timeout=900)
    lines = dict(line.split(" ", 1) for line in out.splitlines() if " " in line)
    assert set(lines["PACKAGES"].split()) == {p for p in _source_packages() if p.count(".") == 1}
    import structattn as sa
    assert int(lines["MODELS"]) == len(sa.models.CATALOGUE)
    assert lines["KERNEL"].startswith("True"), lines["KERNEL"]
    # a second environment (this one: another directory, the same torch) finds the kernel that
    # the wheel's environment built, and does not build it again
    library = next((tmp_path / "extensions").rglob("structattn_stick_breaking.so"))
    built = library.stat().st_mtime_ns
    second = subprocess.run(
        [sys.executable, "-c", "import structattn.kernels as k; assert k.stick_breaking()"],
        cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "building" not in second.stderr and library.stat().st_mtime_ns == built
    # the command line: an SVG drawn from the installed catalogue
    svg = work / "sa.svg"
    _run([str(env_dir / "bin" / "structattn"), "render", "self_attention", "--out", str(svg)],
         cwd=work, env=env, timeout=300)
    assert svg.read_text().lstrip().startswith(("<?xml", "<svg"))
