"""Readings of a declaration, each a Pyro effect handler (``Messenger``)."""

from .marginalise import Marginalise as Marginalise
from .structure import Structure as Structure
from .structure import SubstituteExpectations as SubstituteExpectations
from .structure import TraceStructure as TraceStructure
from .structure import trace_structure as trace_structure
