"""structattn: attention as inference over graph structure.

Declare a Pyro model whose edges are random variables with a prior; compile it
to an attention layer; check the layer against Pyro; draw the structure.
"""
import importlib as _importlib
from typing import TYPE_CHECKING as _TYPE_CHECKING

from . import _links as _links  # first: a clone without its links says so, in one line
from . import block_sparse as block_sparse
from . import checks as checks
from . import kernels as kernels
from . import kinds as kinds
from . import measures as measures
from . import potentials as potentials
from . import priors as priors
from . import reading as reading
from . import triton_kernels as triton_kernels
from . import values as values
from . import windows as windows
from .checking._validation import is_validating as is_validating
from .checking._validation import set_validation as set_validation
from .checking._validation import validation as validation
from .checking.verdicts import raise_pending as raise_pending
from .compiler import CompiledModule as CompiledModule
from .compiler import compile as compile
from .compiling.trace import Trace as Trace
from .declaration import Declaration as Declaration
from .energy import energy as energy
from .export import export as export
from .family import EdgeFamily as EdgeFamily
from .family import edges as edges
from .family import potential as potential
from .family import value as value
from .heads import merge_heads as merge_heads
from .heads import split_heads as split_heads
from .iterative.divergence import DivergenceWarning as DivergenceWarning
from .iterative.iterate import Step as Step
from .iterative.scheme import InferenceScheme as InferenceScheme
from .latent import IterationOptions as IterationOptions
from .latent import LatentNodeSet as LatentNodeSet
from .latent import infer as infer
from .latent import iteration as iteration
from .latent import latent as latent
from .nodes import DeterministicNodeSet as DeterministicNodeSet
from .nodes import NodeSet as NodeSet
from .nodes import deterministic as deterministic
from .nodes import nodes as nodes
from .readers import Structure as Structure
from .readers import trace_structure as trace_structure
from .windows import MeanFieldHistory as MeanFieldHistory
from .windows import MeanFieldWindows as MeanFieldWindows

if _TYPE_CHECKING:  # for type checkers and the API reference; loaded on first use (below)
    from . import drawing as drawing
    from .drawing import RenderError as RenderError
    from .drawing import model_graph as model_graph
    from .drawing import plot_attention as plot_attention
    from .drawing import render as render
    from .drawing import save as save
    from .drawing import to_networkx as to_networkx

#: names loaded on first use, with the module that defines them: the drawings need networkx
#: and graphviz, which a compiled module never touches
_LAZY = {"models": None, "inference": None, "drawing": None,
         **{name: "drawing" for name in ("RenderError", "model_graph", "plot_attention", "render",
                                         "save", "to_networkx")}}


def __getattr__(name):
    """``structattn.models``, ``structattn.inference`` and ``structattn.drawing`` (and the
    drawing functions named here) load on first use: the catalogue and the inference build on
    the core above, so importing them lazily leaves no import cycle; the drawings' libraries
    are imported only by those who draw."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    where = _LAZY[name]
    if where is None:
        return _importlib.import_module(f".{name}", __name__)
    value = getattr(_importlib.import_module(f".{where}", __name__), name)
    globals()[name] = value  # found here from now on, without this function
    return value


def __dir__():
    return sorted({*globals(), *_LAZY})
