"""Posterior samples of edges and outputs, through Pyro's ``infer_discrete``.

Edges are drawn jointly from the exact posterior p(φ | x) (``infer_discrete`` with
temperature 1 runs forward-filter backward-sample over the enumerated model) and
the program runs on them, so the mean of the sampled outputs estimates E[output]
without assuming the program is affine in its values — the check ``exact`` cannot
make (its ``output`` is the program at E[v]).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pyro import poutine
from pyro.infer import infer_discrete
from tqdm.auto import tqdm

from structattn.declaration import as_declaration
from structattn.readers import trace_structure


@dataclass
class PosteriorSamples:
    """edges[f]: ``(S, *batch, H, C)`` sampled parents; outputs: ``(S, *output shape)``."""

    edges: dict
    outputs: torch.Tensor

    def mean_output(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Monte-Carlo estimate of E[output] and its standard error."""
        S = self.outputs.shape[0]
        return self.outputs.mean(0), self.outputs.std(0) / S**0.5

    def to_arviz(self, chains: int = 4):
        """An ``arviz.InferenceData`` of the sampled edges and outputs. The draws are
        independent, so they are dealt into ``chains`` chains for ArviZ's diagnostics
        (``arviz.summary``); a remainder of fewer than ``chains`` draws is dropped."""
        import arviz as az

        S = self.outputs.shape[0] // chains * chains
        if S < chains:
            raise ValueError(f"need at least chains={chains} samples; have {self.outputs.shape[0]}")

        def chained(t):
            return t[:S].reshape(chains, S // chains, *t.shape[1:]).detach().cpu().numpy()

        posterior = {name: chained(e) for name, e in self.edges.items()}
        posterior["output"] = chained(self.outputs)
        return az.from_dict(posterior=posterior)


def sample(model, *inputs, num_samples: int = 200, progress: bool = False, **kwargs
           ) -> PosteriorSamples:
    """Draw ``num_samples`` joint edge configurations from p(φ | x) and the program's output on
    each. Cost: ``num_samples`` enumerated runs of the Pyro program (the oracle, small inputs)."""
    if not isinstance(num_samples, int) or num_samples < 2:
        raise ValueError(f"num_samples must be an int ≥ 2; got {num_samples!r}")
    program = as_declaration(model).model
    structure = trace_structure(program, *inputs, **kwargs)
    if not structure.families:
        raise ValueError("the model declares no edge family (structattn.edges); nothing to sample")
    sampler = infer_discrete(program, first_available_dim=-structure.max_plate_nesting - 1,
                             temperature=1)
    edges = {name: [] for name in structure.families}
    outputs = []
    with torch.no_grad():
        for _ in tqdm(range(num_samples), disable=not progress, desc="posterior samples"):
            trace = poutine.trace(sampler).get_trace(*inputs, **kwargs)
            outputs.append(trace.nodes["_RETURN"]["value"])
            for name, f in structure.families.items():
                shape = (*f.batch_shape, f.heads, f.children.size)
                edges[name].append(trace.nodes[name]["value"].expand(shape))
    return PosteriorSamples({k: torch.stack(v) for k, v in edges.items()}, torch.stack(outputs))
