"""A declaration: a Pyro program with explicit edge sites, owning its parameters."""

from __future__ import annotations

import torch
from torch import nn


class Declaration(nn.Module):
    """Base class of structattn declarations.

    Subclasses define ``model(*inputs)``: a Pyro program built from
    ``structattn.nodes``, ``structattn.edges``, ``structattn.potential`` and
    ``structattn.value``. Calling the declaration runs that program as Pyro
    (edges sampled); ``structattn.compile`` gives the marginalised layer;
    ``structattn.inference`` gives ground truth; ``structattn.render`` draws it.

    ``example_inputs`` (optional) returns small inputs for drawing the declared
    structure without data.
    """

    def model(self, *inputs, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} must define model(*inputs)")

    def forward(self, *inputs, **kwargs):
        return self.model(*inputs, **kwargs)

    def example_inputs(self, n: int = 5, batch: int = 1) -> tuple:
        raise NotImplementedError(
            f"{type(self).__name__} has no example_inputs(); pass inputs explicitly, e.g. "
            f"structattn.render(model, x)"
        )

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

    def model(self, *inputs, **kwargs):
        return self.fn(*inputs, **kwargs)


def as_declaration(model) -> Declaration:
    if isinstance(model, Declaration):
        return model
    if callable(model):
        return FunctionDeclaration(model)
    raise ValueError(
        f"expected a structattn Declaration or a callable Pyro program; got {type(model).__name__}"
    )
