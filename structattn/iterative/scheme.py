"""Inference schemes: how the compiled reader marginalises an edge family whose posterior
it does not take in closed form.

Without a scheme (``edges(..., inference=None)``, the default) a family is read exactly:
its prior's support kind names the operator (``structattn.kinds``). A scheme declared on
the family (``edges(..., inference=scheme)``) replaces that reading in the compiled module
only — Pyro's reading, and so ``structattn.inference``, stay exact, which is what the
scheme is measured against. A scheme states ``check(family)`` (refuse families it cannot
read, at declaration) and ``operator(family, record=…)``: an ``Operator`` whose
``history`` is what the scheme iterated (``Trace``'s field for that scheme), or None.

Built in: ``structattn.windows.MeanFieldWindows`` (expanding attention's per-token windows).
"""

from __future__ import annotations


class InferenceScheme:
    """Base class of an edge family's inference scheme (module docstring).

    A subclass is declared on a family with ``edges(..., inference=scheme)`` and overrides
    ``check`` (refuse, at declaration, a family it cannot read) and ``operator`` (the
    family's ``Operator`` under the scheme, whose ``history`` is what the scheme iterated,
    or None). The base class takes no constructor arguments.

    Attributes:
        trace_field: the ``Trace`` field the operators' histories go to, by family name
            (e.g. ``"mean_field"``); empty in the base class.
    """

    #: the ``Trace`` field its histories go to, by family name
    trace_field: str = ""

    def check(self, family) -> None:
        """Refuse, with a clear error, a family this scheme cannot read."""

    def operator(self, family, *, record: bool = False):
        """The family's ``Operator`` under this scheme at the current node states."""
        raise NotImplementedError

    def describe(self) -> str:
        return type(self).__name__
