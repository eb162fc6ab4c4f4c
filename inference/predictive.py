"""Prior and posterior predictive draws of a declaration's edges and outputs."""

from __future__ import annotations

import pyro
import torch
from pyro.infer import Predictive

from structattn.declaration import as_declaration
from structattn.readers import trace_structure

from .draws import Draws, draw_edges
from .svi import SVIResult


def predictive(model, *inputs, num_samples: int = 100, posterior=None, chains: int = 1,
               seed: int = 0, **kwargs) -> Draws:
    """Predictive draws (z_s, φ_s) of every latent node set and edge family, and the output.

    Without a posterior, the prior predictive: the declared model run forward by
    ``pyro.infer.Predictive``, latents and edges from their priors (potentials do not enter).
    With one, the posterior predictive on ``inputs``: latents from the fitted posterior
    (cycled through ``Draws``), edges from p(φ | x, z) at each (``infer_discrete``).

    Args:
        model (Declaration | Callable): a ``structattn`` declaration (e.g. a catalogue
            model) or a Pyro program built from ``structattn.nodes``/``edges``/``potential``/
            ``value``.
        *inputs (Any): the program's inputs.
        num_samples (int): the number of draws, a positive int, a multiple of ``chains``;
            default 100.
        posterior (SVIResult | Draws | None): a fit from ``svi`` or draws from ``mcmc``;
            None, the default: the prior predictive.
        chains (int): the groups the draws are dealt into; default 1.
        seed (int): the RNG seed of the prior predictive; default 0.
        **kwargs (Any): the program's keyword inputs.

    Returns:
        Draws: leading (chain, draw) dims; ``to_arviz(group="prior")`` files a prior
            predictive in the ``prior`` group.

    Raises:
        ValueError: ``num_samples`` out of range, a posterior of another type or whose
            draws hold no latent node set, or (prior predictive) a latent node set with a
            flat prior.
    """
    if not isinstance(num_samples, int) or num_samples < 1 or num_samples % chains:
        raise ValueError(f"num_samples must be a positive int, a multiple of chains={chains}; "
                         f"got {num_samples!r}")
    program = as_declaration(model).model
    structure = trace_structure(program, *inputs, **kwargs)
    if posterior is not None:
        if isinstance(posterior, SVIResult):
            return posterior.sample(num_samples, chains)
        if isinstance(posterior, Draws):
            flat = {k: v.reshape(-1, *v.shape[2:]) for k, v in posterior.latents.items()}
            if not flat:
                raise ValueError("the posterior draws hold no latent node set; for a model "
                                 "without latents the posterior predictive is "
                                 "structattn.inference.sample")
            S = next(iter(flat.values())).shape[0]
            idx = torch.arange(num_samples) % S
            return draw_edges(program, *inputs, latents={k: v[idx] for k, v in flat.items()},
                              chains=chains, **kwargs)
        raise ValueError(f"posterior must be an SVIResult (structattn.inference.svi) or Draws "
                         f"(structattn.inference.mcmc); got {type(posterior).__name__}")
    flat_prior = [n for n, ns in structure.latents.items() if ns.scale is None]
    if flat_prior:
        raise ValueError(f"latent node sets {flat_prior} have a flat (improper) prior: there is "
                         f"no prior predictive to draw. Give them a Gaussian prior (scale=…)")
    names = [*structure.latents, *structure.families, "_RETURN"]
    pyro.set_rng_seed(seed)
    with torch.no_grad():
        out = Predictive(program, num_samples=num_samples, return_sites=names,
                         parallel=False)(*inputs, **kwargs)

    def chained(t):
        return t.reshape(chains, num_samples // chains, *t.shape[1:])

    def aligned(v, shape):  # Pyro leaves size-1 plate dims out of a draw: put them back
        v = v.reshape(num_samples, *([1] * (len(shape) + 1 - v.dim())), *v.shape[1:])
        return v.expand(num_samples, *shape)

    edges = {n: chained(aligned(out[n], (*f.batch_shape, f.heads, f.children.size)))
             for n, f in structure.families.items()}
    latents = {n: chained(out[n].squeeze(-3)) for n in structure.latents}
    batch_dims = {n: len(f.batch_shape) for n, f in structure.families.items()}
    batch_dims.update({n: len(ns.batch_shape) for n, ns in structure.latents.items()})
    return Draws(latents, edges, chained(out["_RETURN"]), batch_dims=batch_dims)
