"""The catalogue under test, derived from ``structattn.models.CATALOGUE`` (no list is kept
here): case id → ``Case``. Every model's default configuration is a case (its ``ENTRY.case``,
id = the model's name); each of its ``variants`` is another (id ``NAME:LABEL``), read exactly.
A model whose default reading is an approximation (``exact=False``: expanding attention's
mean field) is checked against Pyro's exact enumeration through its exact variant.
"""

from collections.abc import Callable
from dataclasses import dataclass

import structattn as sa


@dataclass(frozen=True)
class Case:
    """``case()`` → ``(model, inputs)``: a small float64 instance of catalogue model ``model``
    and inputs for it; ``exact``: its compiled reading is Pyro's exact posterior (to 1e-6)."""

    model: str
    build: Callable[[], tuple]
    exact: bool = True

    def __call__(self):
        return self.build()


def cases(catalogue=None) -> dict:
    """Case id → ``Case`` for every entry of ``catalogue`` (default: the live
    ``structattn.models.CATALOGUE``) and every variant."""
    catalogue = sa.models.CATALOGUE if catalogue is None else catalogue
    out = {}
    for name, entry in catalogue.items():
        out[name] = Case(name, entry.case, entry.exact)
        for label, build in entry.variants.items():
            out[f"{name}:{label}"] = Case(name, build, True)
    return out


CASES = cases()
#: the ids of the cases whose compiled reading must equal Pyro's exact enumeration
EXACT = sorted(k for k, c in CASES.items() if c.exact)
