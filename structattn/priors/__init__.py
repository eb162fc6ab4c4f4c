"""Edge priors: p(φ_i = j). One class per file.

A prior is one file and one line: ``structattn/priors/NAME.py`` holds the class and, at its
end, ``ENTRY = PriorEntry(...)`` (``_registry.py``: its test cases, its formula in numpy, its
bad parameters); the line is ``"NAME",`` in the list below, from which ``REGISTRY`` (class
name → entry) comes. The generic tests (tests/priors/test_registry.py) run over every entry,
and the suite fails on a public prior without one. ``DistancePrior`` (``distance.py``) is the
base of priors over the distance i − j alone.
"""

from ._registry import PriorEntry as PriorEntry
from ._registry import load_entry as _load_entry
from .alibi import ALiBi as ALiBi
from .base import Prior as Prior
from .beta_geometric import BetaGeometric as BetaGeometric
from .categorical import Categorical as Categorical
from .distance import DistancePrior as DistancePrior
from .forgetting import ForgettingGate as ForgettingGate
from .generalised_gaussian import GeneralisedGaussian as GeneralisedGaussian
from .relative import RelativePosition as RelativePosition
from .stick_breaking import StickBreaking as StickBreaking
from .uniform import Uniform as Uniform

#: class name → ``PriorEntry``: what each prior states about itself for the tests
REGISTRY: dict[str, PriorEntry] = {}
for _module in ("alibi", "beta_geometric", "categorical", "forgetting", "generalised_gaussian",
                "relative", "stick_breaking", "uniform"):
    _entry = _load_entry(__name__, _module)
    REGISTRY[_entry.name] = _entry
del _module, _entry
