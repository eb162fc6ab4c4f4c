"""Positional potentials: the sinusoidal encodings."""

import math

import torch

import structattn as sa


def test_sinusoidal_encodings():
    e = sa.potentials.sinusoidal(4, 6, dtype=torch.float64)
    assert e[0, 0] == 0 and e[0, 1] == 1
    torch.testing.assert_close(e[3, 2], torch.tensor(math.sin(3 / 10000 ** (2 / 6)),
                                                     dtype=torch.float64))
