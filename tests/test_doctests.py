"""The examples in the public docstrings run (``doctest``): every module below holds at least
one, and each passes."""

import doctest
import importlib

import pytest

MODULES = ["structattn.family", "structattn.nodes", "structattn.compiler", "structattn.kinds.base",
           "structattn.kinds.window", "structattn.potentials.positional"]


@pytest.mark.parametrize("name", MODULES)
def test_the_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{name}: no docstring example"
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed"
