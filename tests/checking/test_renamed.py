"""Every argument an earlier release took and this one does not is refused in one line naming
its replacement (``structattn.checking.renamed.RENAMED``), and the replacement it names works."""

import pytest
import torch

import structattn as sa
from structattn.checking.renamed import RENAMED

#: owner → how a user builds it (with the removed argument added as a keyword)
BUILD = {
    "Hopfield": lambda **kw: sa.models.hopfield(8, **kw),
    "ExpandingAttention": lambda **kw: sa.models.expanding_attention(8, **kw),
    "BetaGeometric": lambda **kw: sa.priors.BetaGeometric(**kw),
}

#: a value each removed argument used to take
OLD_VALUE = {"update_steps": 3, "tol": 1e-6, "grad": "last", "variant": "exact",
             "inference": "mean_field", "max_iters": 10, "converge_tol": 1e-3,
             "expectation": "plug_in", "update": "accumulate", "window_rule": "edge",
             "initial_window": 4}

CASES = [(owner, name, replacement) for owner, table in RENAMED.items()
         for name, replacement in table.items()]


def test_every_owner_in_the_table_is_built_here():
    assert set(RENAMED) == set(BUILD)


@pytest.mark.parametrize("owner,name,replacement", CASES, ids=[f"{o}.{n}" for o, n, _ in CASES])
def test_a_removed_argument_is_refused_in_one_line_naming_its_replacement(owner, name, replacement):
    with pytest.raises(TypeError) as info:
        BUILD[owner](**{name: OLD_VALUE[name]})
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{owner}: {name}=") and replacement in message
    assert "unexpected keyword" not in message


def test_the_replacements_named_work():
    """What the messages point to builds the model the old argument built."""
    m = sa.models.hopfield(8, iteration=sa.IterationOptions(steps=3, tol=1e-6, grad="last"))
    assert m.update_steps == 3
    exact = sa.models.expanding_attention(8, inference=None, dtype=torch.float64)
    mean_field = sa.models.expanding_attention(
        8, inference=sa.MeanFieldWindows(max_iters=10, converge_tol=1e-3, expectation="plug_in",
                                         update="accumulate", grad="last", window_rule="edge",
                                         initial_window=4), dtype=torch.float64)
    x = torch.randn(1, 6, 8, dtype=torch.float64)
    for model in (exact, mean_field):
        assert torch.isfinite(sa.compile(model)(x)).all()


def test_an_unknown_argument_is_still_pythons_own_error():
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_option'"):
        sa.models.hopfield(8, no_such_option=1)


def test_the_decorator_refuses_a_class_without_an_entry():
    from structattn.checking.renamed import refuses_renamed
    with pytest.raises(KeyError, match="no entry in RENAMED"):
        refuses_renamed(type("Unlisted", (), {}))
