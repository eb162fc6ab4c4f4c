"""Readings of a declaration, each a Pyro effect handler (``Messenger``)."""

from .marginalise import Marginalise as Marginalise
from .marginalise import SubstituteExpectations as SubstituteExpectations
from .structure import Structure as Structure
from .structure import TraceStructure as TraceStructure
from .structure import trace_structure as trace_structure
