"""The compiler's reading: every edge family is summed out in closed form."""

from __future__ import annotations

import contextlib

from pyro.poutine.messenger import Messenger

from .. import lowering
from .._direct import direct_readers
from ..family import EdgeFamily


class MarginalEdge:
    """Handle for an edge family under ``Marginalise``: nothing sampled, values expected."""

    def __init__(self, family: EdgeFamily, reader: Marginalise):
        self.family, self.reader = family, reader

    def add_potential(self, potential):
        self.family.add_potential(potential)

    def expect(self, value):
        self.family.set_value(value)
        return self.reader.expectation(self.family)


class Marginalise(Messenger):
    """Pyro effect handler: ``structattn_edges`` sites return ``MarginalEdge`` handles and
    ``structattn.value`` returns E_{p(φ|x)}[v] (SDPA fast path, or the dense twin when
    ``record_posterior``). Families seen are kept in ``self.families`` (the IR)."""

    def __init__(self, *, record_posterior: bool = False):
        super().__init__()
        self.record_posterior = record_posterior
        self.families: dict[str, EdgeFamily] = {}
        self.posteriors: dict = {}
        self.expectations: dict = {}

    def _pyro_structattn_edges(self, msg):
        msg["value"] = self.edge(msg["args"][0])
        msg["done"] = True

    def edge(self, family) -> MarginalEdge:
        if family.name in self.families:
            raise ValueError(f"edge family {family.name!r} is declared twice in one model")
        self.families[family.name] = family
        return MarginalEdge(family, self)

    @contextlib.contextmanager
    def direct(self):
        """Enter this reader without Pyro's handler stack: the primitives call it directly.
        Compiled modules use this — same reading, no Pyro ``Message`` per site, so
        ``torch.compile`` traces one graph."""
        stack = direct_readers()
        stack.append(self)
        try:
            yield self
        finally:
            stack.pop()

    def expectation(self, family: EdgeFamily):
        out, post = lowering.expectation(family, want_posterior=self.record_posterior)
        if post is not None:
            self.posteriors[family.name] = post
        self.expectations[family.name] = out
        return out


class SubstituteExpectations(Marginalise):
    """Every value site returns a given expectation (e.g. Pyro's exact one), so the rest of
    the program — head merging, output projections — runs on ground truth."""

    def __init__(self, expectations: dict):
        super().__init__()
        self.expectations = expectations

    def expectation(self, family):
        try:
            return self.expectations[family.name]
        except KeyError:
            raise ValueError(f"no expectation given for edge family {family.name!r}") from None
