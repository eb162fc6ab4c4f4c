"""A declaration: a Pyro program with explicit edge sites, owning its parameters."""

from __future__ import annotations

import torch
from torch import nn

from .checking._validation import check_finite, check_like


class Declaration(nn.Module):
    """Base class of structattn declarations.

    Subclasses define ``model(*inputs)``: a Pyro program built from
    ``structattn.nodes``, ``structattn.edges``, ``structattn.potential`` and
    ``structattn.value``. Calling the declaration runs that program as Pyro
    (edges sampled); ``structattn.compile`` gives the marginalised layer;
    ``structattn.inference`` gives ground truth; ``structattn.render`` draws it.

    ``example_inputs`` (optional) returns small inputs for drawing the declared
    structure without data.

    The constructor is ``torch.nn.Module``'s and takes no arguments: a subclass defines its
    own, calls ``super().__init__()`` and creates its parameters there.

    Attributes:
        structure_version: a counter that every attribute assignment and every move or cast
            (``.to()``, ``.float()``, …) increases; compiled modules read the declaration again
            when it changes.
    """

    #: bumped by every attribute assignment: compiled modules re-read the declaration then
    #: (their plans, ``structattn.compiling.replay``, are recorded at one structure)
    structure_version: int = 0

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        object.__setattr__(self, "structure_version", self.structure_version + 1)

    def _apply(self, fn, recurse=True):
        # .to(), .float(), .cuda() …: new dtypes or devices of the parameters, a new structure
        out = super()._apply(fn, recurse)
        object.__setattr__(self, "structure_version", self.structure_version + 1)
        return out

    def model(self, *inputs, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} must define model(*inputs)")

    def forward(self, *inputs, **kwargs):
        return self.model(*inputs, **kwargs)

    @property
    def display_name(self) -> str:
        """How drawings and messages name this declaration: its class's name."""
        return type(self).__name__

    def example_inputs(self, n: int = 5, batch: int = 1) -> tuple:
        raise NotImplementedError(
            f"{self.display_name} has no example_inputs(); pass inputs explicitly, e.g. "
            f"structattn.render(model, x) or structattn.model_graph(model, x)"
        )

    def check_inputs(self, **inputs) -> None:
        """Check the model's tensor inputs (``name=tensor``; None is skipped) against its
        parameters before anything is computed from them: each must be a floating-point tensor
        with the dtype of the declaration's first floating-point parameter, on its device — a
        ValueError otherwise, naming the argument, the parameter, the actual and the expected
        dtype (device), as the potentials and values check the node sets they meet. Free (no
        pass over the data); catalogue models call it first in ``model``."""
        owner = type(self).__name__
        reference = self._reference_parameter()
        for arg, x in inputs.items():
            if x is None:
                continue
            if not isinstance(x, torch.Tensor):
                raise ValueError(f"{owner}: {arg} must be a torch.Tensor; got {type(x).__name__}")
            if reference is not None:
                check_like(f"{owner}: {arg}", x, reference[1], f"parameter {reference[0]}")
            elif not x.is_floating_point():
                raise ValueError(f"{owner}: {arg} must be floating point (float32, float64, "
                                 f"bfloat16 or float16); got dtype {x.dtype}")

    def check_finite_inputs(self, **inputs) -> None:
        """With the checks on, a ValueError naming the argument (``name=tensor``; None is
        skipped) that holds NaN or ±inf, with the index of its first such entry in the
        argument's own shape: for models whose node sets are built from transformed arguments
        (a LayerNorm, a reshape into units), whose own check would name the node set and its
        indices instead. One finite sum per argument."""
        owner = type(self).__name__
        for arg, x in inputs.items():
            if x is not None:
                check_finite(f"{owner}: {arg}", x)

    def _reference_parameter(self) -> tuple[str, torch.Tensor] | None:
        """``(name, tensor)`` of the first floating-point parameter (else buffer), or None."""
        for named in (self.named_parameters(), self.named_buffers()):
            for name, t in named:
                if t.is_floating_point():
                    return name, t
        return None

    def _param_like(self) -> dict:
        p = next(self.parameters(), None)
        return {} if p is None else {"dtype": p.dtype, "device": p.device}

    def _randn(self, *shape) -> torch.Tensor:
        g = torch.Generator().manual_seed(0)
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(**self._param_like())


class FunctionDeclaration(Declaration):
    """Wraps a plain function ``fn(*inputs)`` (parameters captured elsewhere) as a declaration."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    @property
    def display_name(self) -> str:
        """The function's own name (``program``; ``<lambda>`` for a lambda)."""
        return getattr(self.fn, "__name__", type(self.fn).__name__)

    def model(self, *inputs, **kwargs):
        return self.fn(*inputs, **kwargs)


def has_example_inputs(decl: Declaration) -> bool:
    """Whether ``decl`` defines ``example_inputs()`` (small inputs to draw it without data)."""
    return type(decl).example_inputs is not Declaration.example_inputs


def require_example_inputs(decl: Declaration, caller: str) -> None:
    """Refuse to draw ``decl`` without inputs when it has no ``example_inputs()``, naming the
    function the user called (``structattn.{caller}``) and how to call it instead."""
    if has_example_inputs(decl):
        return
    name = decl.display_name
    what = f"function {name!r}" if isinstance(decl, FunctionDeclaration) else name
    arg = name if name.isidentifier() else "model"
    raise NotImplementedError(
        f"structattn.{caller}: {what} has no example_inputs(); pass inputs explicitly, e.g. "
        f"structattn.{caller}({arg}, x), or declare it as a structattn.Declaration that "
        f"defines example_inputs(self, n=5, batch=1)")


def example_inputs(decl: Declaration, caller: str) -> tuple:
    """``decl``'s example inputs, for ``structattn.{caller}`` called without inputs."""
    require_example_inputs(decl, caller)
    return tuple(decl.example_inputs())


def as_declaration(model) -> Declaration:
    if isinstance(model, Declaration):
        return model
    if callable(model):
        return FunctionDeclaration(model)
    raise ValueError(
        f"expected a structattn Declaration or a callable Pyro program; got {type(model).__name__}"
    )
