"""The catalogue: one small declaration per mechanism (SPEC.md, Table 1).

A model is one file and one line: ``models/NAME.py`` (in a checkout; the package reaches the
folder through its link ``structattn/models``) holds the declaration, its factory ``NAME`` and, at
its end, ``ENTRY = Entry(...)`` — the factory, the declaration class, a small readable
configuration and a small float64 test case (``models/_catalogue.py``); the line is
``"NAME",`` in the list below. From that list come ``CATALOGUE`` (name → Entry), ``REGISTRY``
(name → factory), ``EXAMPLES`` (name → small configuration), the public names
``structattn.models.NAME`` and ``structattn.models.<Class>``, and the test suite's cases
(tests/registry.py); the test suite fails when a module in this package is not listed.
"""

from ._catalogue import Entry as Entry
from ._catalogue import load_entry as _load_entry

#: name → ``Entry``: what each model states about itself
CATALOGUE: dict[str, Entry] = {}
#: name → factory
REGISTRY: dict = {}
#: small, readable configurations of every model (the factories' defaults are layer-sized):
#: what ``structattn render MODEL`` and the gallery's catalogue draw
EXAMPLES: dict[str, dict] = {}


def register(name: str) -> Entry:
    """Add the module ``structattn.models.NAME`` (a file in this package) to the catalogue: its
    ``ENTRY``'s factory and class become public names of this package and it joins
    ``CATALOGUE``, ``REGISTRY`` and ``EXAMPLES``."""
    entry = _load_entry(__name__, name)
    CATALOGUE[name] = entry
    REGISTRY[name] = entry.factory
    EXAMPLES[name] = dict(entry.example)
    globals()[name] = entry.factory  # replaces the submodule attribute the import set
    globals()[entry.declaration.__name__] = entry.declaration
    return entry


# the catalogue: one line per model file
for _name in (
    "absolute_position_attention",
    "alibi_attention",
    "block_slot_attention",
    "classification",
    "cross_attention",
    "expanding_attention",
    "forgetting_attention",
    "generalised_gaussian_attention",
    "graph_attention",
    "hopfield",
    "multihop_attention",
    "predictive_coding",
    "predictor_choice_coding",
    "relative_position_attention",
    "rope_attention",
    "self_attention",
    "slot_attention",
    "stick_breaking_attention",
):
    register(_name)
del _name
