"""Joint posterior draws of edges (and outputs) given draws of the latent node sets.

Pyro's MCMC and ``Predictive`` drop enumerated sites (pyro issue 3368); here every edge
family is drawn per latent draw with ``infer_discrete(temperature=1)`` — forward-filter
backward-sample over the enumerated model conditioned on the latents — so each draw is
(z_s, φ_s) ~ q(z) p(φ | x, z).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from pyro import poutine
from pyro.infer import infer_discrete
from tqdm.auto import tqdm

from structattn.readers import trace_structure

from ._arviz import edge_dims, inference_data, latent_dims, output_dims
from .exact import condition_latents


@dataclass
class Draws:
    """Joint posterior (or prior) draws (z_s, φ_s) and the program's output on each.

    What every sampler returns (``sample``, ``mcmc``, ``predictive``, ``svi(...).sample()``),
    with ArviZ's leading ``(chain, draw)`` dims throughout. Independent draws (``sample``,
    ``predictive``, SVI's guide) are one chain unless asked; ``flat(...)`` merges the two
    dims and ``to_arviz()`` converts.

    Attributes:
        latents (dict): per latent node set, its draws ``(chains, draws, *batch, n, d)``
            (empty for a model without latents).
        edges (dict): per edge family, its parent indices ``(chains, draws, *batch, H, C)``
            (long; P for "no parent").
        outputs (torch.Tensor): the program's output per draw, ``(chains, draws, *output)``.
        stats (dict): per-draw diagnostics ``(chains, draws)`` (e.g. ``diverging``).
        batch_dims (dict): per latent or family name, its number of batch dims.
        num_chains (int): the number of chains.
        num_draws (int): the draws per chain.
    """

    latents: dict
    edges: dict
    outputs: torch.Tensor
    stats: dict = field(default_factory=dict)
    batch_dims: dict = field(default_factory=dict)

    @property
    def num_chains(self) -> int:
        return self.outputs.shape[0]

    @property
    def num_draws(self) -> int:
        """Draws per chain."""
        return self.outputs.shape[1]

    def flat(self, what: dict) -> dict:
        """``what`` (e.g. ``draws.edges``) with (chain, draw) merged: ``(chains·draws, …)``."""
        return {k: v.reshape(-1, *v.shape[2:]) for k, v in what.items()}

    def mean_output(self) -> tuple[torch.Tensor, torch.Tensor]:
        """E[output] over the draws and its Monte-Carlo standard error (independent draws)."""
        out = self.outputs.reshape(-1, *self.outputs.shape[2:])
        return out.mean(0), out.std(0) / out.shape[0] ** 0.5

    def to_arviz(self, group: str = "posterior", observed: dict | None = None):
        """ArviZ data (``structattn/inference/_arviz.py``'s convention): latents (dims ``<z>_batch_k``,
        ``_node``, ``_feature``), edges (``<family>_batch_k``, ``_head``, ``_child``) and the
        output (``output_dim_k``) in ``group``; ``stats`` as sample_stats; ``observed`` as
        observed_data."""
        variables = {**self.latents, **self.edges, "output": self.outputs}
        dims = {name: latent_dims(name, self.batch_dims.get(name, 0)) for name in self.latents}
        dims.update({name: edge_dims(name, self.batch_dims.get(name, 0)) for name in self.edges})
        dims["output"] = output_dims(self.outputs.dim() - 2)
        groups = {group: variables}
        if self.stats:
            groups["sample_stats" if group == "posterior" else f"sample_stats_{group}"] = self.stats
        if observed:
            groups["observed_data"] = observed
        return inference_data(groups, dims)


def draw_edges(model_program, *inputs, latents: dict | None, num_samples: int | None = None,
               chains: int = 1, progress: bool = False, structure=None, **kwargs) -> Draws:
    """Edges and outputs for each latent draw (``latents[name]``: ``(chains·draws, *shape)``),
    or ``num_samples`` draws of the edges alone for models without latents."""
    if structure is None:
        structure = trace_structure(model_program, *inputs, **kwargs)
    first = -structure.max_plate_nesting - 1
    S = num_samples if not latents else next(iter(latents.values())).shape[0]
    edges = {name: [] for name in structure.families}
    outputs = []
    with torch.no_grad():
        for s in tqdm(range(S), disable=not progress,
                      desc="edges per draw" if latents else "posterior samples"):
            program = (condition_latents(model_program, {k: v[s] for k, v in latents.items()})
                       if latents else model_program)
            sampler = infer_discrete(program, first_available_dim=first, temperature=1)
            trace = poutine.trace(sampler).get_trace(*inputs, **kwargs)
            outputs.append(trace.nodes["_RETURN"]["value"])
            for name, f in structure.families.items():
                edges[name].append(trace.nodes[name]["value"].expand(
                    (*f.batch_shape, f.heads, f.children.size)))

    def chained(t):
        return t.reshape(chains, t.shape[0] // chains, *t.shape[1:])

    batch_dims = {name: len(f.batch_shape) for name, f in structure.families.items()}
    batch_dims.update({name: len(ns.batch_shape) for name, ns in structure.latents.items()})
    return Draws({k: chained(v) for k, v in (latents or {}).items()},
                 {k: chained(torch.stack(v)) for k, v in edges.items()},
                 chained(torch.stack(outputs)), batch_dims=batch_dims)
