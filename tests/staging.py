"""A copy of the repository's files outside it, for the tests whose tools write where they run
(``python -m build``: ``structattn-X.Y.Z/``, ``build/``, ``*.egg-info``; ``mkdocs build``: the
gallery's pages in ``docs/gallery/scripts/``). Run on a copy, they cannot race the rest of the
suite, nor leave anything in the clone."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: what git ignores (.gitignore), for a tree that is not a git checkout: names anywhere, and
#: paths from the root
IGNORED_NAMES = {".git", ".venv", "__pycache__", ".pytest_cache", ".hypothesis", ".ruff_cache",
                 "build", "site", "dist"}
IGNORED_PATHS = {"gallery/output", "docs/gallery/scripts"}


def _ignored(folder: str, names: list[str]) -> set[str]:
    here = pathlib.Path(folder).relative_to(ROOT)
    return {n for n in names if n in IGNORED_NAMES or n.endswith((".egg-info", ".pyc", ".so"))
            or (here / n).as_posix() in IGNORED_PATHS}


def _listed() -> list[str] | None:
    """The files git tracks or would track (new files not yet committed included), or None
    outside a git checkout."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             cwd=ROOT, capture_output=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [name for name in out.decode().split("\0") if name]


def stage(dest: pathlib.Path, *parts: str) -> pathlib.Path:
    """Copy the repository's files under ``parts`` (top-level names; all of them when none is
    given) into ``dest``, which must not exist; return ``dest``."""
    dest.mkdir(parents=True)
    listed = _listed()
    if listed is None:
        for name in parts or [p.name for p in ROOT.iterdir()]:
            source = ROOT / name
            if _ignored(str(ROOT), [name]):
                continue
            if source.is_dir():
                shutil.copytree(source, dest / name, ignore=_ignored, symlinks=True)
            elif source.exists():
                shutil.copy2(source, dest / name)
        return dest
    for name in listed:
        if parts and name.split("/", 1)[0] not in parts:
            continue
        source = ROOT / name
        if source.is_symlink():  # structattn/models -> ../models: the link, not a second copy
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            os.symlink(os.readlink(source), dest / name)
            continue
        if not source.is_file():  # deleted in the working tree, not yet committed
            continue
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, dest / name)
    return dest


def once(tmp_path_factory, name: str, make) -> pathlib.Path:
    """The folder ``make(folder)`` fills, made once per test session however many pytest-xdist
    workers ask for it (each waits for the first): ``xdist_group`` cannot be relied on to keep
    a module's tests in one worker (pytest 9.2 ignores the group xdist 3.8 writes into the
    node id), and a module fixture then ran once per worker, each build beside the other.
    ``make`` must not raise for what a test should report (keep its output in the folder)."""
    from filelock import FileLock  # torch's own dependency

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the workers' common folder
    folder, done = shared / name, shared / f"{name}.done"
    with FileLock(str(shared / f"{name}.lock")):
        if not done.exists():
            if folder.exists():
                shutil.rmtree(folder)
            folder.mkdir()
            make(folder)
            done.touch()
    return folder
