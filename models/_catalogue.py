"""What a catalogue model states about itself, next to its factory: ``Entry``.

Each ``models/NAME.py`` ends with ``ENTRY = Entry(...)``: its factory, the declaration class,
a small readable configuration (``example``) and a small float64 test case (``case``).
``models/__init__.py`` names the file once in its list; ``REGISTRY``, ``EXAMPLES``, the public
names ``structattn.models.NAME`` and the test suite's generic cases (tests/registry.py) are
derived from that list. Imports nothing from the package's ``__init__``, so a model file can
import it before the package is initialised.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Entry:
    """One catalogue model.

    - ``factory``: the public factory; its ``__name__`` is the model's catalogue name and the
      name of its file in ``models/``;
    - ``declaration``: the class the factory returns (exported as ``structattn.models.<Class>``);
    - ``example``: keyword arguments of a small, readable instance — what ``structattn render
      NAME`` and the gallery's catalogue draw (the factories' defaults are layer-sized);
    - ``case``: ``() -> (model, inputs)``, a small float64 instance in its default configuration
      and inputs for it (drawn from torch's global generator, which the tests seed) — what
      every generic test runs on;
    - ``exact``: whether the default configuration's compiled reading is Pyro's exact posterior
      (tests compare them to 1e-6); an approximation (a mean-field scheme) says ``False`` and
      names exact configurations in ``variants``;
    - ``variants``: ``{label: case}``, further configurations the generic tests also run, each
      read exactly (e.g. the exact variant of an approximation);
    - ``sizes``: the factory's size arguments (widths, heads, counts, step budgets) → the least
      value each allows (1, or 0 where none is meaningful: no memory, no steps); a list of sizes
      (``layer_sizes``) is checked entry by entry. The edge-case matrix gives each one zero,
      negative and non-int values and expects a ValueError naming it (``check_size``), and
      fails when a factory's int argument is not listed here.
    """

    factory: Callable
    declaration: type
    example: dict
    case: Callable[[], tuple]
    exact: bool = True
    variants: dict[str, Callable[[], tuple]] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.factory.__name__


#: the size arguments every multi-head attention model over one set of tokens takes
TOKEN_SIZES = {"d_model": 1, "heads": 1, "d_k": 1, "d_v": 1}


def randn64(*shape) -> torch.Tensor:
    """Standard-normal float64 inputs for a case."""
    return torch.randn(*shape, dtype=torch.float64)


def load_entry(package: str, name: str) -> Entry:
    """Import ``package.name`` and return its ``ENTRY``, checked."""
    module = importlib.import_module(f"{package}.{name}")
    entry = getattr(module, "ENTRY", None)
    if not isinstance(entry, Entry):
        raise TypeError(f"{package}.{name} must end with ENTRY = Entry(factory, declaration, "
                        f"example=..., case=...) (see {__name__})")
    if entry.name != name:
        raise ValueError(f"{package}.{name}: the factory of its ENTRY must be named {name!r} "
                         f"(the file's name); got {entry.name!r}")
    return entry
