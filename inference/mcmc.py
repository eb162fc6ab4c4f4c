"""Ground truth by MCMC: NUTS on the latent node sets with the edges enumerated, then the
edges drawn per posterior draw (``infer_discrete``), which Pyro's MCMC leaves out."""

from __future__ import annotations

import pyro
import torch
from pyro.infer import MCMC, NUTS
from pyro.infer.autoguide.initialization import init_to_value

from structattn.declaration import as_declaration
from structattn.readers import trace_structure

from .draws import Draws, draw_edges
from .exact import site_values


def mcmc(model, *inputs, num_samples: int = 200, warmup_steps: int = 200, num_chains: int = 1,
         progress: bool = True, seed: int = 0, max_tree_depth: int = 8, parallel: bool = False,
         **kwargs) -> Draws:
    """Draws z_s ~ p(z | x) by NUTS (edges summed out), then φ_s ~ p(φ | x, z_s) per draw.

    Each draw of the latent node sets comes with the edges drawn at it (``infer_discrete``)
    and the program's output. Chains start from the declared initial states.

    Args:
        model (Declaration | Callable): a ``structattn`` declaration (e.g. a catalogue
            model) or a Pyro program built from ``structattn.nodes``/``edges``/``potential``/
            ``value``.
        *inputs (Any): the program's inputs.
        num_samples (int): draws per chain, an int ≥ 1; default 200.
        warmup_steps (int): NUTS warm-up steps per chain, an int ≥ 0; default 200.
        num_chains (int): an int ≥ 1; default 1.
        progress (bool): show progress bars; default True.
        seed (int): chain c runs with seed ``seed + c`` (one after another); default 0.
        max_tree_depth (int): NUTS' maximum tree depth; default 8.
        parallel (bool): run the chains in processes through Pyro's multiprocessing (spawn:
            the model must be picklable, e.g. a catalogue model); default False.
        **kwargs (Any): the program's keyword inputs.

    Returns:
        Draws: ``latents`` / ``edges`` / ``outputs`` with leading (chain, draw) dims and
            ``stats["diverging"]`` per draw.

    Raises:
        ValueError: ``num_samples``, ``warmup_steps`` or ``num_chains`` out of range, or a
            model without latent node sets (use ``structattn.inference.sample``).
    """
    for what, v, least in (("num_samples", num_samples, 1), ("warmup_steps", warmup_steps, 0),
                           ("num_chains", num_chains, 1)):
        if not isinstance(v, int) or isinstance(v, bool) or v < least:
            raise ValueError(f"{what} must be an int ≥ {least}; got {v!r}")
    program = as_declaration(model).model
    structure = trace_structure(program, *inputs, **kwargs)
    if not structure.latents:
        raise ValueError("the model has no latent node set (structattn.latent): NUTS has nothing "
                         "continuous to sample. Use structattn.inference.sample(model, …) for "
                         "exact posterior draws of the edges")
    init = init_to_value(values=site_values({n: ns.states for n, ns in structure.latents.items()}))
    # one run with every chain (Pyro's multiprocessing), or one run per chain (seed + c)
    runs = [(seed, num_chains)] if parallel and num_chains > 1 else \
        [(seed + c, 1) for c in range(num_chains)]
    chains, diverging = {n: [] for n in structure.latents}, []
    for run_seed, k in runs:
        pyro.set_rng_seed(run_seed)
        kernel = NUTS(program, max_plate_nesting=structure.max_plate_nesting, init_strategy=init,
                      max_tree_depth=max_tree_depth)
        run = MCMC(kernel, num_samples=num_samples, warmup_steps=warmup_steps, num_chains=k,
                   mp_context="spawn" if k > 1 else None, disable_progbar=not progress)
        run.run(*inputs, **kwargs)
        samples = run.get_samples(group_by_chain=True)  # (k, draws, *batch, 1, n, d)
        for n in chains:
            chains[n].append(samples[n].detach().squeeze(-3))
        flags = torch.zeros(k, num_samples, dtype=torch.bool)  # Pyro reports divergent draws
        for c, idx in enumerate(run.diagnostics().get("divergences", {}).values()):  # by index
            for i in idx:
                flags[c, int(i)] = True
        diverging.append(flags)
    latents = {n: torch.cat(v).flatten(0, 1) for n, v in chains.items()}  # (chains·draws, …)
    draws = draw_edges(program, *inputs, latents=latents, chains=num_chains, progress=progress,
                       **kwargs)
    draws.stats = {"diverging": torch.cat(diverging)}
    return draws
