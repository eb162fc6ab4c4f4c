"""Arguments that earlier releases took and this one does not: each is refused in one line
that names its replacement, instead of Python's bare ``unexpected keyword argument``.

``RENAMED[owner][argument]`` is the replacement, as the user writes it. A class whose
constructor lost arguments is decorated with ``@refuses_renamed``; its ``__init__`` then
raises ``TypeError`` (what Python raises for an unknown keyword) before anything runs.
"""

from __future__ import annotations

import functools

_SCHEME = "inference=sa.MeanFieldWindows({}=…)"
_FAMILY_SCHEME = "sa.edges(..., inference=sa.MeanFieldWindows({}=…)) (the family's scheme, not the prior's)"

#: owner (the class's name) → {removed argument: its replacement}
RENAMED: dict[str, dict[str, str]] = {
    "Hopfield": {
        "update_steps": "iteration=sa.IterationOptions(steps=T)",
        "tol": "iteration=sa.IterationOptions(tol=…)",
        "grad": "iteration=sa.IterationOptions(grad=…)",
    },
    "ExpandingAttention": {
        "variant": "inference=None for variant='exact', inference=sa.MeanFieldWindows(…) "
                   "for variant='mean_field'",
        **{name: _SCHEME.format(name) for name in (
            "max_iters", "converge_tol", "expectation", "update", "grad", "window_rule",
            "initial_window")},
    },
    "BetaGeometric": {
        "inference": "sa.edges(..., inference=sa.MeanFieldWindows(…)) for inference='mean_field' "
                     "(the family's scheme; without one the prior is read exactly)",
        **{name: _FAMILY_SCHEME.format(name) for name in (
            "max_iters", "converge_tol", "expectation", "update", "grad", "window_rule",
            "initial_window")},
    },
}


def check_renamed(owner: str, kwargs: dict) -> None:
    """Raise ``TypeError`` naming the replacement of the first removed argument in
    ``kwargs``, if any."""
    table = RENAMED.get(owner, {})
    for name in kwargs:
        if name in table:
            raise TypeError(f"{owner}: {name}= is no longer an argument; use {table[name]}")


def refuses_renamed(cls):
    """Class decorator: ``cls.__init__`` refuses the arguments ``RENAMED[cls.__name__]``
    lists, each naming its replacement."""
    if cls.__name__ not in RENAMED:
        raise KeyError(f"refuses_renamed: {cls.__name__} has no entry in RENAMED")
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        check_renamed(cls.__name__, kwargs)
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls
