"""Ground truth for latent node sets: Pyro's MAP of the collapsed model.

The declaration runs as the Pyro program it is — each latent node set a ``pyro.sample``
site with its Gaussian (or flat) prior, each edge family a ``Categorical`` site
enumerated in parallel by ``TraceEnum_ELBO`` — and a point-mass guide (``AutoDelta``)
on the latents is fitted by minimising the ELBO's loss, which for a point mass is
−log p(x, z) with the edges summed out: the collapsed free energy. No code of the
compiled reading is used: not its operators, not its update rules.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyro
import torch
from pyro import poutine
from pyro.infer.autoguide import AutoDelta
from pyro.infer.autoguide.initialization import init_to_value
from tqdm.auto import tqdm

from structattn.declaration import as_declaration
from structattn.readers import trace_structure

from ._arviz import inference_data, latent_dims, point
from .exact import _no_guide, elbo_for, site_values


@dataclass
class MAPEstimate:
    """What ``map_estimate`` found: ẑ = argmax_z p(z | x), the edges summed out.

    Attributes:
        latents (dict): per latent node set, ẑ ``(*batch, n, d)``.
        free_energy (float): −log p(x, ẑ), the edges summed out (summed over the batch).
        losses (list): the loss per optimiser round.
        converged (bool): whether the gradient fell below ``gtol``.
        gradient (float): max |∂F/∂z| at the end.
    """

    latents: dict
    free_energy: float
    losses: list
    converged: bool
    gradient: float = float("nan")

    def to_arviz(self):
        """ArviZ data (``structattn/inference/_arviz.py``'s convention), a point result: one chain of one
        draw. Each latent ``z`` (dims ``z_batch_k``, ``z_node``, ``z_feature``) in the posterior
        group; ``free_energy`` in sample_stats."""
        variables = {name: point(z) for name, z in self.latents.items()}
        dims = {name: latent_dims(name, z.dim() - 2) for name, z in self.latents.items()}
        stats = {"free_energy": point(torch.as_tensor(float(self.free_energy),
                                                      dtype=torch.float64))}
        return inference_data({"posterior": variables, "sample_stats": stats}, dims)


def map_estimate(model, *inputs, init: dict | None = None, max_iter: int = 500,
                 gtol: float = 1e-10, progress: bool = False, **kwargs) -> MAPEstimate:
    """ẑ = argmax_z log p(x, z) with the edges summed out: the latents' MAP, by Pyro.

    Optimised with L-BFGS (strong Wolfe line search, 20 iterations a round) on
    ``TraceEnum_ELBO().differentiable_loss`` with an ``AutoDelta`` guide — deterministic,
    and precise enough for 1e-4 agreement in float64. It stops when the gradient falls to
    ``gtol`` or a round makes no progress.

    Args:
        model (Declaration | Callable): a ``structattn`` declaration (e.g. a catalogue
            model) or a Pyro program built from ``structattn.nodes``/``edges``/``potential``/
            ``value``.
        *inputs (Any): the program's inputs.
        init (dict | None): starting states by latent name; None, the default: each latent's
            declared ``init`` (the compiled reading's start, so both find the same optimum).
        max_iter (int): the L-BFGS iterations at most (in rounds of 20); default 500.
        gtol (float): the gradient's max-norm that counts as converged; default 1e-10.
        progress (bool): show a tqdm bar; default False.
        **kwargs (Any): the program's keyword inputs.

    Returns:
        MAPEstimate: ẑ, its free energy, the losses and whether it converged.

    Raises:
        ValueError: a model without latent node sets, or ``init`` naming another one.
    """
    program = as_declaration(model).model
    structure = trace_structure(program, *inputs, **kwargs)
    latents = structure.latents
    if not latents:
        raise ValueError("the model declares no latent node set (structattn.latent): use "
                         "structattn.inference.exact for its ground truth")
    start = {name: ns.states for name, ns in latents.items()}
    for name, value in (init or {}).items():
        if name not in latents:
            raise ValueError(f"init= names {name!r}, not a latent node set of the model; "
                             f"latents: {sorted(latents)}")
        start[name] = value
    values = site_values(start)

    with pyro.get_param_store().scope():
        guide = AutoDelta(poutine.block(program, expose=list(latents)),
                          init_loc_fn=init_to_value(values=values))
        elbo = elbo_for(structure)
        guide(*inputs, **kwargs)  # create the point-mass parameters
        params = list(guide.parameters())
        opt = torch.optim.LBFGS(params, lr=1.0, max_iter=20, tolerance_grad=gtol,
                                tolerance_change=0.0, history_size=50,
                                line_search_fn="strong_wolfe")
        losses, converged, grad = [], False, float("nan")

        def closure():
            opt.zero_grad()
            loss = elbo.differentiable_loss(program, guide, *inputs, **kwargs)
            loss.backward()
            return loss.detach()

        bar = tqdm(range(max(1, max_iter // 20)), disable=not progress, desc="MAP (L-BFGS)")
        for _ in bar:
            loss = float(opt.step(closure).detach())
            losses.append(loss)
            bar.set_postfix(loss=f"{loss:.6g}")
            grad = max(float(p.grad.abs().max()) for p in params)
            if grad <= gtol:
                converged = True
                break
            if len(losses) > 1 and losses[-1] >= losses[-2]:
                break  # no progress left at this precision
        with torch.no_grad():
            found = guide.median(*inputs, **kwargs)
            free_energy = elbo_for(structure).loss(
                poutine.condition(program, data=found), _no_guide, *inputs, **kwargs)
    shapes = {name: ns.states.shape for name, ns in latents.items()}
    return MAPEstimate({name: found[name].detach().reshape(shapes[name]) for name in latents},
                       free_energy, losses, converged, grad)
