"""Ground truth by stochastic variational inference, the edges enumerated.

The declaration runs as its Pyro program; a guide over the latent node sets (a point mass:
MAP; a mean-field Normal; or the user's) is fitted by ``SVI`` on ``TraceEnum_ELBO``, which
sums every edge family out exactly. What the fit says about the edges is
E_{q(z)}[p(φ | x, z)], by exact enumeration at guide draws.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyro
import torch
from pyro import poutine
from pyro.infer import SVI
from pyro.infer.autoguide import AutoDelta, AutoNormal
from pyro.infer.autoguide.initialization import init_to_value
from tqdm.auto import tqdm

from structattn.declaration import as_declaration
from structattn.readers import trace_structure

from .draws import Draws, draw_edges
from .exact import elbo_for, exact, site_values

GUIDES = ("map", "normal")


@dataclass
class SVIResult:
    """What ``svi`` fitted: a guide q(z) and the edge marginals E_{q(z)}[p(φ | x, z)].

    ``sample()`` draws (z, φ) from it and ``to_arviz()`` converts those draws.

    Attributes:
        losses (list): −ELBO per step.
        guide (Callable): the fitted guide (its parameters live in ``params``).
        params (dict): the Pyro parameter store's state holding the guide's parameters.
        latents (dict): the guide's median per latent node set, ``(*batch, n, d)``.
        marginals (dict): per family f, E_{q(z)}[p(φ_i = j | x, z)], ``(*batch, H, C, P)``.
        converged (bool): whether the stopping rule fired before ``num_steps``.
        program (Callable): the Pyro program fitted; inputs (tuple), kwargs (dict): its
            inputs.
    """

    losses: list
    guide: object
    params: dict
    latents: dict
    marginals: dict
    converged: bool
    program: object = None
    inputs: tuple = ()
    kwargs: dict = None

    def sample(self, num_samples: int = 200, chains: int = 1, progress: bool = False) -> Draws:
        """Joint draws (z, φ) ~ q(z) p(φ | x, z): latents from the guide, edges by
        ``infer_discrete`` at each; independent draws, one chain unless ``chains`` deals them
        into groups (for ArviZ's between-chain diagnostics)."""
        if not isinstance(chains, int) or isinstance(chains, bool) or chains < 1 \
                or num_samples % chains:
            raise ValueError(f"chains must be a positive int dividing num_samples={num_samples}; "
                             f"got {chains!r}")
        latents = _guide_draws(self.guide, self.params, list(self.latents), num_samples,
                               self.inputs, self.kwargs)
        return draw_edges(self.program, *self.inputs, latents=latents, num_samples=num_samples,
                          chains=chains, progress=progress, **self.kwargs)

    def to_arviz(self, num_samples: int = 200, chains: int = 1):
        """ArviZ data of ``sample(num_samples, chains)`` (the draws' convention), with the
        floating-point inputs as observed_data (``input_0``, …)."""
        draws = self.sample(num_samples, chains)
        observed = {f"input_{i}": x for i, x in enumerate(self.inputs)
                    if isinstance(x, torch.Tensor) and x.is_floating_point()}
        return draws.to_arviz(observed=observed)


def _latent_sites(program, inputs, kwargs):
    structure = trace_structure(program, *inputs, **kwargs)
    return structure, list(structure.latents)


def _guide_draws(guide, params, names, num_samples, inputs, kwargs):
    """``num_samples`` draws of each latent from the guide: ``(S, *batch, n, d)``."""
    if not names:
        return {}
    draws = {n: [] for n in names}
    with pyro.get_param_store().scope(params), torch.no_grad():
        for _ in range(num_samples):
            trace = poutine.trace(guide).get_trace(*inputs, **kwargs)
            for n in names:
                draws[n].append(trace.nodes[n]["value"].detach())
    return {n: torch.stack(v).squeeze(-3) for n, v in draws.items()}


def svi(model, *inputs, guide="map", num_steps: int = 2000, lr: float = 0.01,
        tol: float | None = 1e-7, window: int = 50, num_particles: int = 1,
        marginal_samples: int = 32, progress: bool = True, seed: int = 0, **kwargs) -> SVIResult:
    """Fit q(z) ≈ p(z | x) by SVI on ``TraceEnum_ELBO`` (edges enumerated), with Adam.

    Initialised at the declared initial states; the tqdm bar shows the ELBO.

    Args:
        model (Declaration | Callable): a ``structattn`` declaration (e.g. a catalogue
            model) or a Pyro program built from ``structattn.nodes``/``edges``/``potential``/
            ``value``.
        *inputs (Any): the program's inputs.
        guide (str | Callable): "map" (``AutoDelta``, a point mass; the default), "normal" (``AutoNormal``,
            a mean-field Normal) or a callable Pyro guide over the latent sites (each state
            ``(*batch, 1, n, d)``).
        num_steps (int): the most steps, a positive int; default 2000.
        lr (float): Adam's learning rate, > 0; default 0.01.
        tol (float | None): stop when the mean loss over the last ``window`` steps changes by
            less than ``tol`` (relative) from the window before; None: always ``num_steps``.
            Default 1e-7.
        window (int): the steps averaged for ``tol``; default 50.
        num_particles (int): the ELBO's particles; default 1.
        marginal_samples (int): guide draws that estimate the edge marginals for a guide
            other than "map"; default 32.
        progress (bool): show a tqdm bar; default True.
        seed (int): the RNG seed; default 0.
        **kwargs (Any): the program's keyword inputs.

    Returns:
        SVIResult: the losses, guide, latents' medians and edge marginals.

    Raises:
        ValueError: ``num_steps`` or ``lr`` out of range, or an unknown ``guide``.
    """
    if not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be a positive int; got {num_steps!r}")
    if not (isinstance(lr, (int, float)) and lr > 0):
        raise ValueError(f"lr must be a number > 0; got {lr!r}")
    if not (guide in GUIDES or callable(guide)):
        raise ValueError(f"guide must be one of {GUIDES} or a callable Pyro guide; got {guide!r}")
    program = as_declaration(model).model
    structure, names = _latent_sites(program, inputs, kwargs)
    init = init_to_value(values=site_values({n: ns.states
                                             for n, ns in structure.latents.items()}))
    pyro.set_rng_seed(seed)
    with pyro.get_param_store().scope() as params:
        if guide == "map":
            g = AutoDelta(poutine.block(program, expose=names), init_loc_fn=init)
        elif guide == "normal":
            g = AutoNormal(poutine.block(program, expose=names), init_loc_fn=init, init_scale=0.05)
        else:
            g = guide
        if not names and guide in GUIDES:
            def g(*args, **kw):  # nothing continuous to fit: the evidence alone
                return {}
        engine = SVI(program, g, pyro.optim.Adam({"lr": lr}),
                     elbo_for(structure, num_particles=num_particles))
        losses, converged = [], False
        bar = tqdm(range(num_steps), disable=not progress, desc="SVI")
        for step in bar:
            losses.append(float(engine.step(*inputs, **kwargs)))
            if step % 10 == 0:
                bar.set_postfix(elbo=f"{-losses[-1]:.6g}")
            if tol is not None and len(losses) >= 2 * window:
                new = sum(losses[-window:]) / window
                old = sum(losses[-2 * window:-window]) / window
                if abs(new - old) <= tol * max(1.0, abs(old)):
                    converged = True
                    break
        if names and guide in GUIDES:
            medians = g.median(*inputs, **kwargs)
        elif names:  # a user's guide: one draw stands for it
            medians = {k: v[0] for k, v in _guide_draws(g, params, names, 1, inputs, kwargs).items()}
    latents = ({n: medians[n].detach().reshape(structure.latents[n].states.shape) for n in names}
               if names else {})
    marginals = _marginals(program, inputs, kwargs, structure, g, params, guide, latents,
                           marginal_samples)
    return SVIResult(losses, g, params, latents, marginals, converged, program, inputs, kwargs)


def _marginals(program, inputs, kwargs, structure, g, params, guide, latents, S):
    if not structure.families:
        return {}
    if not structure.latents:
        return exact(program, *inputs, **kwargs).marginals
    if guide == "map":
        return exact(program, *inputs, latents=latents, **kwargs).marginals
    draws = _guide_draws(g, params, list(structure.latents), S, inputs, kwargs)
    total = None
    for s in range(S):
        m = exact(program, *inputs, latents={k: v[s] for k, v in draws.items()},
                  **kwargs).marginals
        total = m if total is None else {k: total[k] + m[k] for k in m}
    return {k: v / S for k, v in total.items()}
