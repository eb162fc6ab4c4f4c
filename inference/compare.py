"""Compare a compiled module against ground truth from the same declaration, with a verdict
(``compare``: exact enumeration, edge draws, SVI or NUTS). Sampled checks test each entry
against the compiled posterior (``structattn.inference.sampled``: edge frequencies by an exact
binomial test, E[output] in standard errors) and read its p-value as |z|; with Bonferroni's
rule, m entries tested at family-wise level α (default 0.01), an entry passes when
|z| ≤ Φ⁻¹(1 − α/(2m)).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch

from structattn.compiler import CompiledModule
from structattn.compiler import compile as compile_model
from structattn.compiling import lowering
from structattn.readers import Marginalise, trace_structure

from .exact import exact
from .map import map_estimate
from .sample import sample
from .sampled import edge_z, output_z, z_threshold

METHODS = ("exact", "samples", "svi", "mcmc")
PROGRESS_DRAWS = 100  #: sampled checks show a tqdm bar from this many draws on


@dataclass
class Check:
    """One verdict: ``value`` (an absolute difference, or a |z|) against ``tolerance``."""

    name: str
    value: float
    tolerance: float
    kind: str = "abs"  # "abs" or "z"

    @property
    def passed(self) -> bool:
        return self.value <= self.tolerance


@dataclass
class Comparison:
    """Max |compiled − ground truth| per quantity, and the verdict: ``passed`` (``bool()``).

    Returned by ``compare``; ``print(report)`` gives PASS/FAIL per check with its tolerance,
    ``report.plot(path)`` the compiled and ground-truth posteriors side by side.

    Attributes:
        output (float): max |compiled output − exact output| (nan for "svi"/"mcmc").
        posteriors (dict): per family, max |compiled − exact p(φ_i = j | x)|.
        expectations (dict): per family, max |compiled − exact E[v_i]|.
        sampled_output (float | None): with samples, max |compiled − Monte-Carlo E[output]|.
        sampled_z (dict | None): with samples, each sampled check's statistic per entry, as
            |z| (``structattn.inference.sampled``): "E[output] by samples" ``(*output)``,
            "edge frequencies[f]" ``(*batch, H, C, P)``.
        free_energy (float | None): latent models, |F(compiled final state) − Pyro's
            −log p(x, z) there| (summed over the batch).
        fixed_point (dict | None): latent models, max |compiled final state − Pyro's MAP (or
            SVI's)| per latent; None: no MAP check (a user update rule is not a descent rule
            on the declared free energy).
        fixed_point_free_energy (float | None): F(compiled final state) − F(Pyro MAP); < 0:
            the compiled iteration found a lower free energy (another local optimum).
        notes (list): remarks on the checks, as strings.
        method (str): the method compared with.
        checks (list): each check's name, value and tolerance (``Check``).
        pictures (dict): dense posteriors to draw, family → (compiled, ground truth).
    """

    output: float
    posteriors: dict = field(default_factory=dict)
    expectations: dict = field(default_factory=dict)
    sampled_output: float | None = None
    sampled_z: dict | None = None
    free_energy: float | None = None
    fixed_point: dict | None = None
    fixed_point_free_energy: float | None = None
    notes: list = field(default_factory=list)
    method: str = "exact"
    checks: list = field(default_factory=list)
    pictures: dict = field(default_factory=dict, repr=False)

    @property
    def max_abs_diff(self) -> float:
        """The largest disagreement with Pyro at the same states (output, posteriors, values,
        latent models' free energy); the distance to Pyro's MAP is ``fixed_point``."""
        extra = [] if self.free_energy is None else [self.free_energy]
        return max([self.output, *self.posteriors.values(), *self.expectations.values(), *extra])

    @property
    def passed(self) -> bool:
        """Every check within its tolerance."""
        return all(c.passed for c in self.checks)

    def __bool__(self) -> bool:
        return self.passed

    def __str__(self) -> str:
        lines = [f"{'PASS' if self.passed else 'FAIL'} ({self.method}): compiled vs ground truth"]
        for c in self.checks:
            unit = "|z|" if c.kind == "z" else "abs"
            lines.append(f"  {'ok  ' if c.passed else 'FAIL'} {c.name:<34} {c.value:.3g} "
                         f"{'≤' if c.passed else '>'} {c.tolerance:.3g} ({unit})")
        if self.fixed_point_free_energy is not None:
            lines.append(f"       F(compiled) − F(MAP)  {self.fixed_point_free_energy:.3g}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def plot(self, path=None):
        """Side by side, per family: the compiled posterior and the ground truth's (first batch
        element, first head). Returns the matplotlib figure; saved to ``path`` if given."""
        import matplotlib

        if path is not None:
            matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        if not self.pictures:
            raise ValueError("this comparison kept no posteriors to draw (method "
                             f"{self.method!r})")
        fams = list(self.pictures)
        fig, axes = plt.subplots(len(fams), 3, figsize=(9, 2.8 * len(fams)), squeeze=False)
        for r, fam in enumerate(fams):
            a, b = (t.reshape(-1, *t.shape[-2:])[0].detach().double().cpu()
                    for t in self.pictures[fam])
            for ax, t, title in ((axes[r, 0], a, "compiled"), (axes[r, 1], b, "ground truth"),
                                 (axes[r, 2], (a - b).abs(), "|difference|")):
                im = ax.imshow(t.numpy(), cmap="Blues" if title != "|difference|" else "Reds",
                               vmin=0, vmax=None if title == "|difference|" else 1)
                ax.set_title(f"{fam}: {title}", fontsize=8)
                ax.set_xlabel("parent j", fontsize=7)
                ax.set_ylabel("child i", fontsize=7)
                fig.colorbar(im, ax=ax, fraction=0.046)
        fig.suptitle(f"{'PASS' if self.passed else 'FAIL'} ({self.method})", fontsize=9)
        fig.tight_layout()
        if path is not None:
            fig.savefig(path, dpi=100)
            plt.close(fig)
        return fig


def _maxdiff(a, b) -> float:
    if isinstance(a, torch.Tensor):
        if a.numel() == 0:  # nothing to disagree about (e.g. a graph with no edges)
            return 0.0
        return float((a.detach() - b.detach()).abs().max())
    if isinstance(a, (tuple, list)):
        return max(_maxdiff(x, y) for x, y in zip(a, b, strict=True))
    raise TypeError(f"cannot compare outputs of type {type(a).__name__}")


def _in_layout(family, dense: torch.Tensor) -> torch.Tensor:
    """A dense ``(…, C, P)`` posterior in the compiled layout of the family's operator (e.g.
    per edge ``(…, E)`` for an edge list)."""
    return lowering.operator_for(family).layout(dense)


def _default_atol(inputs) -> float:
    dtypes = {x.dtype for x in inputs if isinstance(x, torch.Tensor) and x.is_floating_point()}
    if dtypes and dtypes <= {torch.float64}:
        return 1e-6
    if dtypes and dtypes <= {torch.float64, torch.float32}:
        return 1e-4
    return 1e-2


def compare(model, *inputs, method: str = "exact", atol: float | None = None,
            samples: int = 0, alpha: float = 0.01, map_atol: float = 1e-4,
            svi_atol: float = 1e-3, num_samples: int = 200, fixed_point: bool = True,
            fit_options: dict | None = None, progress: bool | None = None,
            **kwargs) -> Comparison:
    """Check the compiled module against ground truth from the same declaration: a verdict.

    Args:
        model (Declaration | CompiledModule): a declaration (compiled here) or a ``CompiledModule``.
        *inputs (Any): the model's inputs (keep them small: the ground truth is the oracle).
        method (str): "exact" (the default): Pyro's enumeration at the same states (output,
            posteriors, values, latent models' free energy, within ``atol``), latent models
            also against Pyro's MAP (in the verdict once the iteration converged); "samples":
            edge draws (no latents), the output against the Monte-Carlo E[output] (what sees
            a program not affine in its values) and the posteriors against the edge
            frequencies (an exact binomial test per edge), each entry as a |z|; "svi": the
            final state against SVI's MAP; "mcmc": the final state within the z-threshold
            of NUTS' posterior mean.
        atol (float | None): the exact checks' absolute tolerance; None, the default: 1e-6
            for float64 inputs, 1e-4 for float32, 1e-2 otherwise.
        samples (int): with "exact", S > 0 adds the sampled checks with S draws; default 0.
        alpha (float): the sampled checks' family-wise level; default 0.01.
        map_atol (float): the fixed point against Pyro's MAP; default 1e-4.
        svi_atol (float): the final state against SVI's MAP; default 1e-3.
        num_samples (int): draws for "samples"/"mcmc"; default 200.
        fixed_point (bool): search Pyro's MAP for latent models; default True.
        progress (bool | None): a tqdm bar over the sampled checks' draws; None, the default:
            from ``PROGRESS_DRAWS`` draws on.
        fit_options (dict | None): keyword arguments of the "svi"/"mcmc" fitter (e.g.
            ``{"num_steps": 500}``) or, for a latent model read exactly, of ``map_estimate``
            (``max_iter``, ``gtol``, ``init``, ``progress``).
        **kwargs (Any): the model's keyword inputs.

    Returns:
        Comparison: the differences, ``checks`` and ``passed``.

    Raises:
        ValueError: an unknown ``method``, "svi"/"mcmc" on a model without latents, sampled
            checks on a latent model, or ``fit_options`` the MAP search does not take.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}; got {method!r}")
    atol = _default_atol(inputs) if atol is None else atol
    layer = model if isinstance(model, CompiledModule) else compile_model(model)
    structure = trace_structure(layer.declaration.model, *inputs, **kwargs)
    latent = bool(structure.latents)
    if method in ("svi", "mcmc"):
        if not latent:
            raise ValueError(f"method={method!r} fits latent node sets, and this model has none: "
                             f"its edges are summed out exactly — use method='exact' (or "
                             f"'samples' for draws)")
        return _compare_fitted(layer, *inputs, method=method, atol=svi_atol, alpha=alpha,
                               num_samples=num_samples, fit_options=fit_options or {}, **kwargs)
    if latent:
        if method == "samples" or samples:
            raise ValueError("sampled edge checks are for models without latent node sets; for "
                             "latent models use method='exact', 'svi' or 'mcmc'")
        return _compare_latent(layer, *inputs, structure=structure, atol=atol,
                               map_atol=map_atol, fixed_point=fixed_point,
                               map_options=_map_options(fit_options), **kwargs)
    report = _compare_exact(layer, *inputs, atol=atol, **kwargs)
    if method == "samples" or samples:
        S = samples or num_samples
        progress = S >= PROGRESS_DRAWS if progress is None else progress
        _add_sampled(report, layer, *inputs, S=S, alpha=alpha, atol=atol, progress=progress,
                     **kwargs)
        report.method = method if method == "samples" else "exact + samples"
    return report


def _compare_exact(layer, *inputs, atol, **kwargs) -> Comparison:
    truth = exact(layer.declaration, *inputs, **kwargs)
    with torch.no_grad():
        with Marginalise() as fast:  # the layer's own (SDPA) path
            out = layer.declaration.model(*inputs, **kwargs)
        _, posteriors = layer(*inputs, return_posterior=True, **kwargs)
    report = _agreement(out, truth, posteriors, fast)
    report._out = out  # for the sampled checks
    _exact_checks(report, atol)
    return report


def _exact_checks(report, atol):
    report.checks.append(Check("output", report.output, atol))
    report.checks += [Check(f"posterior[{k}]", v, atol) for k, v in report.posteriors.items()]
    report.checks += [Check(f"E[value][{k}]", v, atol) for k, v in report.expectations.items()]
    if report.free_energy is not None:
        report.checks.append(Check("free energy", report.free_energy,
                                   atol * max(1.0, abs(report._F))))


def _add_sampled(report, layer, *inputs, S, alpha, atol, progress, **kwargs):
    draws = sample(layer.declaration, *inputs, num_samples=S, progress=progress, **kwargs)
    outputs, edges = draws.outputs.flatten(0, 1), draws.flat(draws.edges)  # (S, …)
    posteriors = {name: p for name, (p, _) in report.pictures.items()}  # dense layouts
    zs = {"E[output] by samples": output_z(outputs, report._out, posteriors, edges, atol)}
    for name, p in posteriors.items():  # edge frequencies vs compiled posteriors
        zs[f"edge frequencies[{name}]"] = edge_z(p, edges[name])
    m = sum(z.numel() for z in zs.values())
    crit = z_threshold(m, alpha)
    report.checks += [Check(name, float(z.max()) if z.numel() else 0.0, crit, "z")
                      for name, z in zs.items()]
    report.sampled_output = float((report._out.detach() - outputs.mean(0)).abs().max())
    report.sampled_z = zs
    report.notes.append(f"sampled checks: {S} draws, z-threshold {crit:.2f} = Bonferroni over "
                        f"{m} entries at family-wise α = {alpha}")


def _agreement(out, truth, posteriors, fast, **fields) -> Comparison:
    """Max differences of the compiled output, posteriors and values (``fast``: the reader
    that produced them) from Pyro's exact reading ``truth``, and the posteriors to draw."""
    if isinstance(posteriors, torch.Tensor):
        posteriors = {next(iter(fast.families)): posteriors}
    report = Comparison(
        _maxdiff(out, truth.output),
        {k: _maxdiff(p, _in_layout(fast.families[k], truth.marginals[k]))
         for k, p in posteriors.items()},
        {k: _maxdiff(v, truth.expectations[k]) for k, v in fast.expectations.items()},
        **fields)
    report.pictures = {k: (p, truth.marginals[k]) for k, p in posteriors.items()
                       if p.shape == truth.marginals[k].shape}  # dense layouts
    return report


MAP_OPTIONS = ("max_iter", "gtol", "init", "progress")


def _map_options(fit_options) -> dict:
    """``fit_options`` for the MAP search of ``method="exact"`` on a latent model, checked."""
    options = dict(fit_options or {})
    unknown = sorted(set(options) - set(MAP_OPTIONS))
    if unknown:
        raise ValueError(f"fit_options {unknown} are not options of the MAP search "
                         f"(structattn.inference.map_estimate) that method='exact' runs on a "
                         f"latent model; it takes {list(MAP_OPTIONS)}")
    return options


def _map_note(found, options) -> str:
    """What to do when Pyro's MAP search stopped above its tolerance and a fixed-point check
    failed: it ran out of rounds (give it more), or it stopped making progress."""
    defaults = inspect.signature(map_estimate).parameters
    gtol = options.get("gtol", defaults["gtol"].default)
    max_iter = options.get("max_iter", defaults["max_iter"].default)
    head = (f"Pyro's MAP search stopped at max |∇F| = {found.gradient:.2g}, above its tolerance "
            f"gtol = {gtol:g}")
    if len(found.losses) >= max(1, max_iter // 20):  # its whole budget: it may get closer
        return (f"{head}, at its budget of {max_iter} L-BFGS iterations: the MAP itself may be "
                f"inexact, which could explain the failed fixed-point check. Give it more, "
                f"compare(..., fit_options={{'max_iter': {4 * max_iter}}}), and compare again")
    return (f"{head}, where its loss stopped decreasing: the MAP is no more precise than that in "
            f"this dtype, so a fixed-point gap of the order of |∇F| / curvature is the MAP's own — "
            f"loosen map_atol to it; a larger gap is the compiled iteration's (run it longer, "
            f"structattn.iteration(steps=…, tol=…), or it found another local optimum)")


def _compare_latent(layer, *inputs, structure, atol, map_atol, fixed_point=True,
                    map_options=None, **kwargs) -> Comparison:
    """Latent models: the compiled reading at its final state against Pyro's exact reading
    there, and the final state against Pyro's MAP (when every update is a descent rule)."""
    with torch.no_grad():
        _, posteriors, trace = layer(*inputs, return_posterior=True, return_trace=True, **kwargs)
        final = {name: s[-1] for name, s in trace.states.items()}
        with Marginalise(latent_values=final) as fast:
            out = layer.declaration.model(*inputs, **kwargs)
    truth = exact(layer.declaration, *inputs, latents=final, **kwargs)
    rules = {name: ns.options.update for name, ns in structure.latents.items()}
    with torch.no_grad():  # F of the whole model at the final state (every family, energy)
        F = float(layer.free_energy(*inputs, latents=final, **kwargs).sum())
    report = _agreement(out, truth, posteriors, fast, free_energy=abs(F - truth.free_energy))
    report._F = F
    _exact_checks(report, atol)
    callables = sorted(k for k, r in rules.items() if callable(r))
    if not fixed_point:
        return report
    if callables:
        report.notes.append(f"no MAP comparison: latents {callables} use a user update rule, "
                            f"which is not a descent rule on the declared free energy")
        return report
    found = map_estimate(layer.declaration, *inputs, **(map_options or {}), **kwargs)
    report.fixed_point = {k: _maxdiff(final[k], v) for k, v in found.latents.items()}
    report.fixed_point_free_energy = F - found.free_energy
    if trace.converged:
        report.checks += [Check(f"fixed point[{k}] vs Pyro MAP", v, map_atol)
                          for k, v in report.fixed_point.items()]
    else:
        report.notes.append(
            "fixed point vs Pyro MAP (not in the verdict: the iteration did not run to a "
            "tolerance): " + ", ".join(f"{k} {v:.3g}" for k, v in report.fixed_point.items())
            + "; run it to a fixed point (structattn.iteration(steps=…, tol=…)) to check it")
    if report.fixed_point_free_energy < -1e-9:
        report.notes.append("the compiled iteration found a lower free energy than the MAP "
                            "search: they sit in different local optima")
    if not found.converged and any(not c.passed for c in report.checks
                                   if c.name.startswith("fixed point")):
        report.notes.append(_map_note(found, map_options or {}))
    return report


def _compare_fitted(layer, *inputs, method, atol, alpha, num_samples, fit_options,
                    **kwargs) -> Comparison:
    from .mcmc import mcmc
    from .svi import svi

    with torch.no_grad():
        _, trace = layer(*inputs, return_trace=True, **kwargs)
    final = {name: s[-1] for name, s in trace.states.items()}
    report = Comparison(float("nan"), method=method)
    if method == "svi":
        fit = svi(layer.declaration, *inputs, **{"guide": "map", "progress": False,
                                                  **fit_options}, **kwargs)
        report.fixed_point = {k: _maxdiff(final[k], v) for k, v in fit.latents.items()}
        report.checks += [Check(f"state[{k}] vs SVI MAP", v, atol)
                          for k, v in report.fixed_point.items()]
        if not fit.converged:
            report.notes.append("SVI stopped at its step budget before its convergence rule")
        return report
    draws = mcmc(layer.declaration, *inputs, **{"num_samples": num_samples, "progress": False,
                                                **fit_options}, **kwargs)
    zs = {}
    for k, v in draws.flat(draws.latents).items():
        mean, sd = v.mean(0), v.std(0)
        zs[k] = ((final[k] - mean).abs() / sd.clamp_min(1e-300)).flatten()
    crit = z_threshold(sum(z.numel() for z in zs.values()), alpha)
    report.checks += [Check(f"state[{k}] in NUTS posterior", float(z.max()), crit, "z")
                      for k, z in zs.items()]
    report.notes.append(f"mcmc: the compiled state in posterior standard deviations from the "
                        f"NUTS posterior mean ({num_samples} draws); threshold {crit:.2f} = "
                        f"Bonferroni at α = {alpha}")
    return report
