"""Compare a compiled module against Pyro's exact answer on the same inputs."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from structattn.compiler import CompiledModule
from structattn.compiler import compile as compile_model
from structattn.readers import Marginalise, trace_structure

from .exact import exact
from .map import map_estimate
from .sample import sample


@dataclass
class Comparison:
    """Max absolute differences, compiled vs Pyro enumeration."""

    output: float
    posteriors: dict = field(default_factory=dict)
    expectations: dict = field(default_factory=dict)
    #: with samples: max |compiled − Monte-Carlo E[output]| and the same in standard errors
    sampled_output: float | None = None
    sampled_z: float | None = None
    #: latent models: |F(compiled final state) − Pyro's −log p(x, z) there| (summed over batch)
    free_energy: float | None = None
    #: latent models: max |compiled final state − Pyro MAP| per latent (None: no MAP check,
    #: because an update rule is not a descent rule on the declared free energy)
    fixed_point: dict | None = None
    #: latent models: F(compiled final state) − F(Pyro MAP); < 0 means the compiled iteration
    #: found a lower free energy than the MAP search (another local optimum)
    fixed_point_free_energy: float | None = None
    notes: list = field(default_factory=list)

    @property
    def max_abs_diff(self) -> float:
        """The largest disagreement of the compiled reading with Pyro at the same states
        (output, posteriors, values and, for latent models, the free energy). The distance
        to Pyro's MAP is reported separately (``fixed_point``): a finite number of steps
        need not reach it."""
        extra = [] if self.free_energy is None else [self.free_energy]
        return max([self.output, *self.posteriors.values(), *self.expectations.values(), *extra])

    def __str__(self) -> str:
        lines = [f"max |compiled − Pyro exact|: {self.max_abs_diff:.3g}",
                 f"  output          {self.output:.3g}"]
        for k, v in self.posteriors.items():
            lines.append(f"  posterior[{k}]  {v:.3g}")
        for k, v in self.expectations.items():
            lines.append(f"  E[value][{k}]   {v:.3g}")
        if self.free_energy is not None:
            lines.append(f"  free energy     {self.free_energy:.3g}")
        if self.sampled_output is not None:
            lines.append(f"  E[output] by posterior samples: {self.sampled_output:.3g} "
                         f"({self.sampled_z:.2f} standard errors)")
        if self.fixed_point is not None:
            lines.append("max |compiled final state − Pyro MAP| (Pyro ELBO, point-mass guide):")
            for k, v in self.fixed_point.items():
                lines.append(f"  latent[{k}]  {v:.3g}")
            lines.append(f"  F(compiled) − F(MAP)  {self.fixed_point_free_energy:.3g}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _maxdiff(a, b) -> float:
    if isinstance(a, torch.Tensor):
        if a.numel() == 0:  # nothing to disagree about (e.g. a graph with no edges)
            return 0.0
        return float((a.detach() - b.detach()).abs().max())
    if isinstance(a, (tuple, list)):
        return max(_maxdiff(x, y) for x, y in zip(a, b, strict=True))
    raise TypeError(f"cannot compare outputs of type {type(a).__name__}")


def _in_layout(family, dense: torch.Tensor) -> torch.Tensor:
    """A dense ``(…, C, P)`` posterior in the compiled layout: per edge ``(…, E)`` for
    edge-list supports (causal edges only when causal), else unchanged."""
    if family.prior.edge_index is None:
        return dense
    src, dst = family.prior.edges(dense.device)
    return dense[..., dst, src]


def compare(model, *inputs, samples: int = 0, **kwargs) -> Comparison:
    """Run the compiled module (fast path) and Pyro enumeration; report max abs differences
    of the output, each family's edge posterior and each family's value expectation.

    The exact ``output`` is the program evaluated at the exact E[v], so it agrees with the
    compiled one by construction whenever the values agree. With ``samples=S`` the output
    is also checked against E[output] estimated from S joint posterior samples
    (``sample``): a discrepancy of many standard errors (``sampled_z``) means the program
    is not affine in its values, so the layer does not compute E[output].

    ``model``: a declaration (compiled here) or a ``CompiledModule``.
    """
    layer = model if isinstance(model, CompiledModule) else compile_model(model)
    if trace_structure(layer.declaration.model, *inputs, **kwargs).latents:
        return _compare_latent(layer, *inputs, samples=samples, **kwargs)
    truth = exact(layer.declaration, *inputs, **kwargs)
    with torch.no_grad():
        with Marginalise() as fast:  # the layer's own (SDPA) path
            out = layer.declaration.model(*inputs, **kwargs)
        _, posteriors = layer(*inputs, return_posterior=True, **kwargs)
    if isinstance(posteriors, torch.Tensor):
        posteriors = {next(iter(fast.families)): posteriors}
    sampled = z = None
    if samples:
        mean, se = sample(layer.declaration, *inputs, num_samples=samples, **kwargs).mean_output()
        diff = (out.detach() - mean).abs()
        sampled = float(diff.max())
        z = float(torch.where(se > 0, diff / se.clamp_min(1e-300),
                              torch.where(diff > 1e-9, torch.inf, 0.0)).max())
    return Comparison(
        _maxdiff(out, truth.output),
        {k: _maxdiff(p, _in_layout(fast.families[k], truth.marginals[k]))
         for k, p in posteriors.items()},
        {k: _maxdiff(v, truth.expectations[k]) for k, v in fast.expectations.items()},
        sampled, z,
    )


def _compare_latent(layer, *inputs, samples=0, **kwargs) -> Comparison:
    """Latent models: the compiled reading at its final state against Pyro's exact reading
    at that state (posteriors, values, output, free energy), and the final state against
    Pyro's MAP (when every update is a descent rule on the declared free energy)."""
    if samples:
        raise NotImplementedError("compare(samples=…) is for models without latent node sets")
    with torch.no_grad():
        _, posteriors, trace = layer(*inputs, return_posterior=True, return_trace=True, **kwargs)
        final = {name: s[-1] for name, s in trace.states.items()}
        with Marginalise(latent_values=final) as fast:
            out = layer.declaration.model(*inputs, **kwargs)
    truth = exact(layer.declaration, *inputs, latents=final, **kwargs)
    if isinstance(posteriors, torch.Tensor):
        posteriors = {next(iter(fast.families)): posteriors}
    structure = trace_structure(layer.declaration.model, *inputs, **kwargs)
    rules = {name: ns.options.update for name, ns in structure.latents.items()}
    report = Comparison(
        _maxdiff(out, truth.output),
        {k: _maxdiff(p, _in_layout(fast.families[k], truth.marginals[k]))
         for k, p in posteriors.items()},
        {k: _maxdiff(v, truth.expectations[k]) for k, v in fast.expectations.items()},
        free_energy=abs(float(trace.free_energy[-1].sum()) - truth.free_energy),
    )
    callables = sorted(k for k, r in rules.items() if callable(r))
    if callables:
        report.notes.append(f"no MAP comparison: latents {callables} use a user update rule, "
                            f"which is not a descent rule on the declared free energy")
        return report
    found = map_estimate(layer.declaration, *inputs, **kwargs)
    report.fixed_point = {k: _maxdiff(final[k], v) for k, v in found.latents.items()}
    report.fixed_point_free_energy = float(trace.free_energy[-1].sum()) - found.free_energy
    if trace.steps < max(ns.options.steps for ns in structure.latents.values()) or \
            trace.converged:
        pass
    else:
        report.notes.append(f"the compiled iteration stopped after its budget of {trace.steps} "
                            f"steps; run it to a fixed point (structattn.iteration(steps=…, "
                            f"tol=…)) to compare fixed points")
    if not found.converged:
        report.notes.append(f"Pyro's MAP search stopped at max |∇F| = {found.gradient:.2g}, "
                            f"above its tolerance")
    return report
