"""The catalogue and the ground truth are folders at the repository's top (``models/``,
``inference/``) that the package reaches through links committed in git
(``structattn/models -> ../models``); an installed wheel holds them as folders. A clone made
without symbolic links (git's ``core.symlinks=false``) holds a short text file where each link
belongs, and ``structattn.models`` would then fail on first use without saying why: importing
the package refuses at once, in one line that says how to fix it."""

import os

#: the package's folders that a clone holds as links to the repository's top
LINKED = ("models", "inference")

FIX = ("clone the repository with symbolic links enabled (git clone -c core.symlinks=true …) "
       "or install the wheel (pip install structattn)")


def check(package: str) -> None:
    """Raise ImportError unless every ``LINKED`` name under ``package`` is a folder."""
    for name in LINKED:
        path = os.path.join(package, name)
        if os.path.isdir(path):
            continue
        if os.path.islink(path):
            what = f"links to {os.readlink(path)!r}, which is not a folder"
        elif os.path.isfile(path):
            what = ("is a file, not a link to the folder ../" + name
                    + " (a clone made with git's core.symlinks=false)")
        else:
            what = "is missing"
        raise ImportError(f"structattn/{name} {what}: {FIX}")


check(os.path.dirname(os.path.abspath(__file__)))
