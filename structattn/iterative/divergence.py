"""A watch on gradient steps: ``update="gradient"`` (μ ← μ − η∇F) diverges when the step size η
is too large for the curvature of F, and the free energy then rises instead of falling — over
a few hundred steps to 1e87 and beyond, while the states stay finite. The watch warns
(``DivergenceWarning``, naming ``step_size`` and the step) when F at the end of an iteration
is above F at its start, or non-finite.

Cost: F at the first and at the last state (two evaluations of the log-partitions, none per
step), only while the value checks are on (``structattn.validation``) and not under
``torch.compile``; when the iteration recorded F (``return_trace=True``) it reads the trace
instead. The step at which F first rose is found on the failure path only, by replaying the
iteration without gradients from the saved initial states.
"""

from __future__ import annotations

import warnings

import torch

from ..checking._validation import checks_on, first_true, is_exporting, passes


class DivergenceWarning(RuntimeWarning):
    """Gradient steps on a free energy made it rise above its start or non-finite: lower
    ``step_size``.

    A ``RuntimeWarning`` issued, while the value checks are on, after an iteration of latents
    with ``update="gradient"`` whose free energy F ended above its start or non-finite. The
    message names the latents, ``step_size``, F at the start and at the end and, when it can
    be found, the step at which F first rose or turned non-finite; it suggests a smaller
    ``step_size``, or ``update="cccp"`` where the potentials have a closed form.
    """


class DivergenceWatch:
    """Watches one run of an ``Engine`` whose latents take gradient steps."""

    def __init__(self, engine):
        self.engine = engine
        self.watched = [z for z in engine.latents if z.options.update == "gradient"]
        # (a warning, not an error: a replay re-reads the call to warn; a program has no warning)
        # len(): dynamo in torch 2.11 cannot trace bool(list) (a graph break under fullgraph)
        self.active = len(self.watched) > 0 and checks_on() and not is_exporting()
        self.start_states: dict = {}
        self.f0: torch.Tensor | None = None

    def start(self, f0: torch.Tensor | None = None) -> None:
        """Remember the initial states and F there (``f0``: already computed, or None)."""
        if not self.active:
            return
        self.start_states = {z.name: z.states for z in self.engine.latents}
        # with gradients on, as the loop builds the caches it shares with the rest of the forward
        self.f0 = (self.engine.free_energy() if f0 is None else f0).detach()

    def rose(self, f: torch.Tensor) -> torch.Tensor:
        """Where F is non-finite or above its start by more than rounding, ``(*batch,)``."""
        f0 = self.f0
        slack = torch.finfo(f0.dtype).eps ** 0.5 * (f0.abs() + 1)
        return ~torch.isfinite(f) | (f > f0 + slack)

    def finish(self, steps: int, energies: list | None = None) -> None:
        """After ``steps`` updates: warn when F ended above its start or non-finite.
        ``energies``: F after every step (index 0: the start), when the run recorded them."""
        if self.f0 is None or steps == 0:
            return
        f_end = (energies[-1] if energies else self.engine.free_energy()).detach()
        if passes(~self.rose(f_end).any()):
            return
        if energies:
            found = next(((t, f.detach()) for t, f in enumerate(energies[1:], 1)
                          if bool(self.rose(f.detach()).any())), None)
        else:
            found = self._replay(steps)
        warnings.warn(self._message(steps, f_end, found), DivergenceWarning, stacklevel=4)

    def _replay(self, steps: int):
        """``(step, F there)`` of the first step whose F rose, replayed without gradients from
        the initial states (the states and caches of the real run are restored); None when the
        replay does not reproduce it (an update rule that draws at random)."""
        engine = self.engine
        final = {z.name: z.states for z in engine.latents}
        caches = {k: dict(v) for k, v in engine.caches.items()}
        try:
            with torch.no_grad():
                for z in engine.latents:
                    z.states = self.start_states[z.name]
                for t in range(steps):
                    engine._one_step([z for z in engine.latents if t < z.options.steps]
                                     or engine.latents)
                    f = engine.free_energy()
                    if bool(self.rose(f).any()):
                        return t + 1, f
            return None
        finally:
            for z in engine.latents:
                z.states = final[z.name]
            for k, v in engine.caches.items():
                v.clear()
                v.update(caches.get(k, {}))

    def _message(self, steps: int, f_end: torch.Tensor, found) -> str:
        names = ", ".join(repr(z.name) for z in self.watched)
        sizes = sorted({z.options.step_size for z in self.watched})
        eta = sizes[0] if len(sizes) == 1 else sizes
        idx = first_true(self.rose(f_end)) or ()
        element = f" (batch element {idx})" if idx else ""
        if found is None:
            first = ""
        else:
            t, f = found
            at = first_true(self.rose(f)) or ()
            what = ("turned non-finite" if not bool(torch.isfinite(f[at])) else
                    "first rose above its start")
            first = f"; it {what} at step {t} (F = {float(f[at]):.4g})"
        smaller = (f"step_size={eta / 4:.3g}" if isinstance(eta, (int, float))
                   else "a smaller step_size")
        return (f"latent node set {names}: update='gradient' with step_size={eta} diverged: the "
                f"free energy went from {float(self.f0[idx]):.4g} to {float(f_end[idx]):.4g} "
                f"over {steps} steps{element}{first}. Lower step_size (e.g. {smaller}), or use "
                f"update='cccp' where the potentials have a closed form.")
