"""The readings of a declaration besides plain Pyro's (``structattn.reading``): the compiled
one (``Marginalise``) and the structure's (``TraceStructure``), each entered with ``with``."""

from .marginalise import Marginalise as Marginalise
from .structure import Structure as Structure
from .structure import SubstituteExpectations as SubstituteExpectations
from .structure import TraceStructure as TraceStructure
from .structure import trace_structure as trace_structure
