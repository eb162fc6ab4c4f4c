"""Supports a user writes (the declaring guide's), shared by the tests of block reading."""

import structattn as sa


class Band(sa.kinds.Support):
    """|i − j| ≤ w."""

    def __init__(self, w):
        self.w = w

    def contains(self, child, parent):
        return (child - parent).abs() <= self.w


class Global(sa.kinds.Support):
    """The first g tokens, read by every child and reading every parent (Longformer's)."""

    def __init__(self, g):
        self.g = g

    def contains(self, child, parent):
        return (parent < self.g) | (child < self.g)


class Stride(sa.kinds.Support):
    """i − j a multiple of s (a strided pattern, Sparse Transformer's)."""

    def __init__(self, s):
        self.s = s

    def contains(self, child, parent):
        return (child - parent) % self.s == 0
