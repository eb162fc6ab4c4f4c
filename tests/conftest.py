"""Test defaults (STYLE.md): validation on, seeded RNG, warnings are errors (pyproject).

The suite runs in one pytest-xdist worker per core (pyproject's addopts); each worker takes
its share of the cores as torch threads, so that the workers do not oversubscribe them."""

import os

import pytest
import torch

# Triton's interpreter runs its kernels on CPU tensors; it must be set before anything imports
# Triton — which a test module may do at collection (transformers' Llama imports it), before
# tests/triton/conftest.py is read
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import structattn as sa  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1)
                              // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))


@pytest.fixture(autouse=True)
def _seed_and_validate():
    torch.manual_seed(0)
    sa.set_validation(True)
    yield
    sa.set_validation(True)


@pytest.fixture(autouse=True)
def _certify_at_any_size(request, monkeypatch):
    """The tests check what a certified reading computes, at sizes where the CPU's cost rules
    (``structattn.kinds.certificate_costs``: a band or a table's certificate only where it is
    expected to cost well under the whole past) would read the whole past instead: the rules
    are set aside, and tested on their own (tests/kinds/test_certificate_costs.py)."""
    if request.module.__name__.rsplit(".", 1)[-1] != "test_certificate_costs":
        from structattn.kinds import certificate_costs, window

        monkeypatch.setattr(certificate_costs, "band_pays", lambda *args: True)
        monkeypatch.setattr(certificate_costs, "band_rejected", lambda *args: False)
        monkeypatch.setattr(window, "_table_pays", lambda *args: True)


#: the longest-running modules, started first: with one pytest-xdist worker per core, a long
#: test that starts last leaves the other cores idle while it runs (the wheel test installs
#: torch into a fresh environment and builds a C++ kernel)
FIRST = ("tests/test_wheel.py", "tests/triton/test_expanding_triton.py", "tests/test_docs.py",
         "tests/test_lm_table.py", "tests/triton/test_key_bias_triton.py",
         "tests/triton/test_stick_breaking_triton.py")


def pytest_collection_modifyitems(config, items):
    def rank(item):
        path = item.nodeid.split("::", 1)[0]
        return FIRST.index(path) if path in FIRST else len(FIRST)
    items.sort(key=rank)  # stable: the rest keep their order


PRIMES = [2, 3, 5, 7, 11, 13]
