"""Read a declaration's structure (node sets and edge families) by running it once."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import lowering
from ..family import EdgeFamily
from ..nodes import NodeSet
from .marginalise import Marginalise


@dataclass
class Structure:
    """The IR of a declaration run on concrete inputs (``output``: the program's output with
    placeholder zero values — for shapes only)."""

    node_sets: dict[str, NodeSet]
    families: dict[str, EdgeFamily]
    output: object
    energies: dict = None  # name → structattn.energy term
    @property
    def latents(self) -> dict:
        """The latent node sets (``structattn.latent``) by name, in declaration order."""
        return {k: ns for k, ns in self.node_sets.items() if not ns.observed}

    @property
    def max_plate_nesting(self) -> int:
        latents = [len(ns.batch_shape) + 2 for ns in self.latents.values()]  # (*batch, 1, n)
        return max([f.plate_nesting for f in self.families.values()] + latents, default=0)

    def support(self, name: str) -> torch.Tensor:
        """Boolean ``(*batch, H, C, P)`` support of family ``name``."""
        return torch.isfinite(self.log_prior(name))

    def log_prior(self, name: str) -> torch.Tensor:
        """Normalised log prior ``(*batch, H, C, P)`` of family ``name``."""
        f = self.families[name]
        xc = f.children.states
        t = f.tables.log_prob_table(xc.dtype)
        keep = f.keep()
        if keep is not None:  # parentless children (empty="zero") have no prior edge at all
            t = t.masked_fill(keep == 0, float("-inf"))
        return t.expand(*f.batch_shape, f.heads, *t.shape[-2:])

    def posterior(self, name: str) -> torch.Tensor:
        """Edge posterior ``(*batch, H, C, P)`` of family ``name`` (dense; all-zero rows for
        parentless children under empty="zero")."""
        return lowering.posterior(self.families[name])


class TraceStructure(Marginalise):
    """Records node sets (in declaration order) and edge families without computing any
    expectation: values are zeros of the right shape, so an oracle that traces the
    structure first never runs the compiled lowering."""

    def _pyro_sample(self, msg):
        """Every random variable of a declaration comes from a structattn primitive; a raw
        ``pyro.sample`` / ``pyro.factor`` has no compiled reading, so it is refused here, where
        every oracle starts."""
        from pyro.poutine.subsample_messenger import _Subsample

        if isinstance(msg["fn"], _Subsample):  # a plate's own bookkeeping site
            return
        kind = "pyro.factor" if msg["is_observed"] and msg["fn"].__class__.__name__ == "Unit" \
            else "pyro.sample"
        raise ValueError(
            f"site {msg['name']!r} is a raw {kind}, which structattn's readers do not support "
            f"(the compiled module would ignore it or draw it at random). Declare latent "
            f"variables with structattn.latent(...), edges with structattn.edges(...), edge "
            f"log-likelihoods with structattn.potential(...) and other terms of −log p with "
            f"structattn.energy(...)")

    def expectation(self, family):
        lowering.check_complete(family)
        v = family.value.parent_values(family.parents.states)  # (*batch, H, P, d_v)
        return v.new_zeros(*family.batch_shape, family.heads, family.children.size, v.shape[-1])

    def __init__(self, latent_values: dict | None = None):
        super().__init__(latent_values=latent_values)
        self.node_sets: dict[str, NodeSet] = {}

    def latent(self, node_set):
        node_set = super().latent(node_set)
        self.node_sets.setdefault(node_set.name, node_set)
        return node_set

    def infer(self):  # the structure only: latents stay at their initial (or given) state
        for z in self.latents.values():
            z.inferred = True

    def _pyro_post_structattn_nodes(self, msg):
        ns = msg["value"]
        self.node_sets.setdefault(ns.name, ns)

    def _pyro_structattn_edges(self, msg):
        super()._pyro_structattn_edges(msg)
        family = msg["args"][0]
        for ns in (family.parents, family.children):
            self.node_sets.setdefault(ns.name, ns)


def trace_structure(program, *inputs, latent_values: dict | None = None, **kwargs) -> Structure:
    """Run ``program(*inputs)`` under ``TraceStructure`` and return its ``Structure`` (latent
    node sets at their initial state, or at ``latent_values``)."""
    with torch.no_grad(), TraceStructure(latent_values) as reader:
        out = program(*inputs, **kwargs)
    return Structure(reader.node_sets, reader.families, out, dict(reader.energies))
