"""Test defaults (STYLE.md): validation on, seeded RNG, warnings are errors (pyproject)."""

import pytest
import torch

import structattn as sa


@pytest.fixture(autouse=True)
def _seed_and_validate():
    torch.manual_seed(0)
    sa.set_validation(True)
    yield
    sa.set_validation(True)


PRIMES = [2, 3, 5, 7, 11, 13]
