"""Compare a compiled module against Pyro's exact answer on the same inputs."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from structattn.compiler import CompiledModule
from structattn.compiler import compile as compile_model
from structattn.readers import Marginalise

from .exact import exact
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

    @property
    def max_abs_diff(self) -> float:
        return max([self.output, *self.posteriors.values(), *self.expectations.values()])

    def __str__(self) -> str:
        lines = [f"max |compiled − Pyro exact|: {self.max_abs_diff:.3g}",
                 f"  output          {self.output:.3g}"]
        for k, v in self.posteriors.items():
            lines.append(f"  posterior[{k}]  {v:.3g}")
        for k, v in self.expectations.items():
            lines.append(f"  E[value][{k}]   {v:.3g}")
        if self.sampled_output is not None:
            lines.append(f"  E[output] by posterior samples: {self.sampled_output:.3g} "
                         f"({self.sampled_z:.2f} standard errors)")
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
