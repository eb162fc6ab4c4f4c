"""What a prior states about itself for the test suite, next to its class: ``PriorEntry``.

Each ``structattn/priors/NAME.py`` that defines a public prior ends with ``ENTRY =
PriorEntry(...)``; ``structattn/priors/__init__.py`` names the file once in its list, and
``REGISTRY`` (class name → entry) follows. The generic tests (tests/priors/test_registry.py)
run over every entry: Pyro's reading equals the compiled tables, both equal the entry's
formula written in numpy, bad parameters are refused by name, gradients reach the prior's
parameters, and a ``DistancePrior``'s certificate is sound. A public prior without an entry
fails the suite. Imports nothing from the package's ``__init__``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class PriorEntry:
    """What one prior states about itself for the generic tests (module docstring).

    A record: ``structattn/priors/NAME.py`` ends with ``ENTRY = PriorEntry(...)``, and
    ``structattn.priors.REGISTRY`` maps the class name (``name``) to it.

    Attributes:
        prior (type): the class, exported as ``structattn.priors.<Class>``.
        cases (Callable): ``(C, P, generator) → [Prior, …]``, float64 instances at C children
            and P parents (the configurations every generic test reads; those that need
            C ≤ P only there).
        formula (Callable | None): ``(prior, C, P) → numpy array (heads or 1, C, P)``, the
            unnormalised log prior written from the prior's definition in plain numpy (−∞ off
            the support); None where the log prior is not a table of the prior's own
            (stick-breaking's reads its potential; its own tests compare it with Pyro).
        bad (dict): ``{message pattern: () → Prior}``, constructions with a bad parameter, each
            refused with a ValueError matching its pattern. Default empty.
        parameters (Callable | None): ``(generator) → (tensors, build)``, float64 parameters
            and ``build(*tensors) → Prior`` at C = P = 5, for the gradient check; None
            (default): no parameter has a gradient to check.
        certified (Callable | None): ``(generator) → Prior``, a causal instance with ``tol``
            (a prior that certifies truncation), read with 2 heads over N = 48 tokens (a
            prior with a parameter per token, a forget gate, has 48): the generic test holds
            its certificate to Pyro's whole past. None (default): the prior certifies nothing.
    """

    prior: type
    cases: Callable
    formula: Callable | None
    bad: dict = field(default_factory=dict)
    parameters: Callable | None = None
    certified: Callable | None = None

    @property
    def name(self) -> str:
        """The prior's class name, its key in ``REGISTRY``."""
        return self.prior.__name__


def load_entry(package: str, module: str) -> PriorEntry:
    """``structattn.priors.MODULE.ENTRY``, checked to be a ``PriorEntry``."""
    entry = getattr(importlib.import_module(f"{package}.{module}"), "ENTRY", None)
    if not isinstance(entry, PriorEntry):
        raise TypeError(f"structattn.priors.{module} must end with ENTRY = PriorEntry(...)")
    return entry
