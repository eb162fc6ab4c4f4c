"""Test defaults (STYLE.md): validation on, seeded RNG, warnings are errors (pyproject).

The suite runs in one pytest-xdist worker per core (pyproject's addopts); each worker takes
its share of the cores as torch threads, so that the workers do not oversubscribe them."""

import os

import pytest
import torch

import structattn as sa

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1)
                              // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))


@pytest.fixture(autouse=True)
def _seed_and_validate():
    torch.manual_seed(0)
    sa.set_validation(True)
    yield
    sa.set_validation(True)


PRIMES = [2, 3, 5, 7, 11, 13]
