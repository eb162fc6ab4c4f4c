"""The package's files as Python imports them: every folder under ``structattn/``, the
catalogue and the ground truth included. Their folders sit at the repository's top
(``models/``, ``inference/``) and the package reaches them through links
(``structattn/models -> ../models``), which ``Path.rglob`` does not follow before Python 3.13;
this walk does, so a check over the package's files sees them."""

from __future__ import annotations

import os
import pathlib


def files(folder: pathlib.Path, suffix: str = ".py") -> list[pathlib.Path]:
    """Every file under ``folder`` whose name ends in ``suffix``, links followed, sorted; the
    paths run through the links (``structattn/models/x.py``), as the modules' ``__file__``."""
    found = []
    for here, folders, names in os.walk(folder, followlinks=True):
        folders[:] = [f for f in folders if f != "__pycache__"]
        found += [pathlib.Path(here, name) for name in names if name.endswith(suffix)]
    return sorted(found)


def packages(root: pathlib.Path) -> set[str]:
    """The dotted names of the packages under ``root / "structattn"``: every folder holding an
    ``__init__.py``, the linked ones included."""
    return {".".join(p.parent.relative_to(root).parts)
            for p in files(root / "structattn", "__init__.py")}
