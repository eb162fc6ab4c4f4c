"""``compile``: a declaration → a plain ``torch.nn.Module`` with the edges summed out."""

from __future__ import annotations

from torch import nn

from .declaration import Declaration, as_declaration
from .readers.marginalise import Marginalise


class CompiledModule(nn.Module):
    """The marginalised layer of a declaration; shares its parameters.

    ``forward(*inputs)`` runs the declaration under the ``Marginalise`` reading:
    each ``structattn.value`` returns E_{p(φ_i|x)}[v_i] in closed form (SDPA),
    and the rest of the program (head merging, output projections) runs as
    ordinary torch code. With ``return_posterior=True`` it also returns the
    edge posteriors p(φ_i = j | x): a tensor ``(*batch, heads, children,
    parents)`` when the model has one edge family, else a dict by family name.
    The output is E[program output] whenever the program is affine in its
    values (true of every catalogue model); ``structattn.inference.compare``
    checks it against Pyro.
    """

    def __init__(self, declaration: Declaration):
        super().__init__()
        self.declaration = declaration

    def forward(self, *inputs, return_posterior: bool = False, **kwargs):
        with Marginalise(record_posterior=return_posterior).direct() as reader:
            out = self.declaration.model(*inputs, **kwargs)
        if not return_posterior:
            return out
        posts = reader.posteriors
        return out, (next(iter(posts.values())) if len(posts) == 1 else dict(posts))

    def extra_repr(self) -> str:
        return f"compiled from {type(self.declaration).__name__}"


def compile(model) -> CompiledModule:  # noqa: A001 - the public name DESIGN.md asks for
    """Compile a declaration (or a plain Pyro program using structattn primitives)."""
    return CompiledModule(as_declaration(model))
