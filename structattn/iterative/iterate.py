"""The iterating reader's loop: collapsed-variational inference of latent node sets.

With the edges summed out, the free energy of point estimates μ of the latents is
(paper §4.1, Eq. 4–8)

    F(μ) = −Σ_z log p(z = μ_z) − Σ_families Σ_{i,h} log Σ_j exp(ψ_ij(μ) + log p(φ_i = j)),

and its gradient is the expectation, under the edge posterior, of the ordinary one
(Lemma 7.1): ∂F/∂μ = ∂(−log p(μ))/∂μ − E_{p(φ|x,μ)}[∂ψ/∂μ]. Update rules:

- ``"cccp"``: minimise the bound F(μ) ≤ −log p(μ) − E_{q_t(φ)}[ψ(μ)] − H[q_t] (tight at
  μ_t, q_t = p(φ | x, μ_t)). When every potential is linear or isotropic-quadratic in μ
  (Bilinear, DotProduct, SquaredDistance) the bound is a quadratic with curvature
  H = 1/scale² + E[−∂²ψ/∂μ²] and its minimiser is μ_t − ∇F(μ_t)/H: the CCCP fixed point
  for bilinear potentials (Hopfield: ξ ← Kᵀ softmax(βKξ)) and the EM M-step for Gaussian
  ones (a posterior-weighted mean). F never increases. Where the potentials state the
  offset b of E[∂ψ/∂μ] = b − c·μ, the minimiser is computed as (loc/scale² + Σ b)/H — EM's
  own form, without the terms in μ that cancel (fewer operations, forward and backward).
- ``"gradient"``: μ ← μ − η ∇F(μ). Too large an η makes F rise: while validating, a
  ``DivergenceWarning`` names ``step_size`` and the step (``structattn.iterative.divergence``).
- a callable ``update(state, step) -> state`` (e.g. slot attention's GRU + MLP), given a
  ``Step``: the operators of the latent's families at the current states.

Latents are updated one after another within a step (block coordinate descent), each from
the latest states of the others.
"""

from __future__ import annotations

import contextlib

import torch

from ..checking import _validation
from ..compiling.lowering import operator_for
from ..compiling.trace import Trace
from ..kinds.base import Operator
from ..latent import LatentNodeSet
from ..nodes import depends_on
from .divergence import DivergenceWatch


def sides(family, latent) -> list[str]:
    """Which ends of ``family`` are the latent node set (both for self-attention over it)."""
    return [s for s, ns in (("children", family.children), ("parents", family.parents))
            if ns is latent]


def through(family, latent) -> bool:
    """Whether an end of ``family`` is a deterministic function of the latent
    (``structattn.deterministic``): its gradient then goes through that function (its
    pullback, or autograd)."""
    return any(ns is not latent and depends_on(ns, latent)
               for ns in (family.children, family.parents))


def touches(family, latent) -> bool:
    """Whether ``family`` depends on the latent's states, at an end or through one."""
    return depends_on(family.children, latent) or depends_on(family.parents, latent)


class Step:
    """What an update rule sees for one latent at one step: its state and the operators
    (``attend``, ``adjoint``, ``mass``, ``posterior``, ``log_partition``) of every family
    at the current states, by family name or handle.

    The iteration builds one per latent and update and passes it to a callable update rule,
    ``update(state, step) -> state``; user code reads it and does not build one.

    Args:
        engine: the ``Engine`` running the iteration: the reader's latents, edge families
            (by name), per-family caches and node energies.
        latent: the ``LatentNodeSet`` being updated.

    Attributes:
        engine: the ``Engine`` running the iteration.
        latent: the ``LatentNodeSet`` being updated.
        state: the latent's current states ``(*batch, n, d)``, as ``move_to`` last left them.
    """

    def __init__(self, engine: Engine, latent: LatentNodeSet):
        self.engine, self.latent = engine, latent
        self._ops = {}

    @property
    def state(self) -> torch.Tensor:
        return self.latent.states

    def move_to(self, state: torch.Tensor) -> Step:
        """Put the latent at ``state`` within this update (e.g. after a GRU, before a read from a
        memory): operators built from now on see it there. Returns this step."""
        if not isinstance(state, torch.Tensor) or state.shape != self.latent.states.shape:
            got = tuple(state.shape) if isinstance(state, torch.Tensor) else type(state).__name__
            raise ValueError(f"latent node set {self.latent.name!r}: move_to needs a tensor of "
                             f"the state's shape {tuple(self.latent.states.shape)}; got {got}")
        self.latent.states = state
        self._ops = {}
        return self

    def operator(self, family) -> Operator:
        name = family if isinstance(family, str) else family.family.name
        if name not in self._ops:
            try:
                fam = self.engine.families[name]
            except KeyError:
                raise ValueError(f"no edge family {name!r} in this model; families: "
                                 f"{sorted(self.engine.families)}") from None
            self._ops[name] = operator_for(fam, self.engine.caches.setdefault(name, {}))
        return self._ops[name]

    def posterior(self, family):
        return self.operator(family).dense_posterior()

    def attend(self, family, u):
        return self.operator(family).attend(u)

    def adjoint(self, family, u):
        return self.operator(family).adjoint(u)

    def mass(self, family):
        return self.operator(family).mass()

    def families(self) -> list:
        """The families with this latent at one end."""
        return [f for f in self.engine.families.values() if touches(f, self.latent)]

    def expected_gradient(self, weight=1.0) -> torch.Tensor:
        """``weight`` · Σ_families E_{p(φ|x,μ)}[∂ψ/∂μ] (the gradient of Σ log_partition), like
        the state (the weight is folded into each potential's scale where it can be)."""
        terms = []
        for fam in self.families():
            op = self.operator(fam.name)
            closed = [psi.expected_gradient(side, op, weight=weight)
                      for side in sides(fam, self.latent) for psi in fam.potentials]
            if through(fam, self.latent):  # through a deterministic node set: its pullback
                closed.extend(self._pulled_back(fam, op, weight))
            if not closed or any(g is None for g in closed):
                g = self._autograd_gradient(fam)
                terms.append(g if isinstance(weight, float) and weight == 1.0 else weight * g)
            else:
                terms.extend(closed)
        if not terms:
            return torch.zeros_like(self.state)
        return sum(terms[1:], terms[0])

    def _pulled_back(self, fam, op, weight) -> list:
        """E[∂ψ/∂μ] through each end of ``fam`` that is a deterministic node set of μ: the
        potentials' expected gradient on that end, pulled back by the node set's ``pullback``
        (a vector-Jacobian product in closed form); [None] where either is missing."""
        out = []
        z = self.latent
        for side, ns in (("children", fam.children), ("parents", fam.parents)):
            if ns is z or not depends_on(ns, z):
                continue
            # no closed form, or μ reached through another deterministic set: autograd
            if ns.pullback is None or any(s is not z and depends_on(s, z) for s in ns.sources):
                return [None]
            us = [psi.expected_gradient(side, op, weight=weight) for psi in fam.potentials]
            if any(u is None for u in us):
                return [None]
            grads = ns.pull_back(sum(us[1:], us[0]))
            out.extend(g for s, g in zip(ns.sources, grads, strict=True) if s is z)
        return out

    def _partial(self, fn) -> torch.Tensor:
        """∂fn/∂μ with every other node state held fixed (``torch.func.grad``: a partial
        derivative, not a total one through states computed from μ's history), itself
        differentiable for the outer autograd.

        Not while a plan is recorded or a program exported: PyTorch's tracer
        (``make_fx(pre_dispatch=True)``) keeps what autograd computes inside the graph as
        constants, so a recorded gradient would not follow the inputs. The error stops the
        recording (the signature is read every call) or the export, and says why."""
        if _validation.is_recording() or _validation.is_exporting():
            raise NotImplementedError(
                f"latent node set {self.latent.name!r}: its update differentiates with autograd "
                f"(a potential without a closed-form expected gradient, a node energy, or a "
                f"deterministic node set without a pullback), which PyTorch's tracer records "
                f"as constants: this reading is read every call, not recorded, and cannot be "
                f"exported")
        z = self.latent.states

        def at(mu):
            self.latent.states = mu
            try:
                return fn()
            finally:
                self.latent.states = z
        return torch.func.grad(at)(z)

    def _autograd_gradient(self, fam) -> torch.Tensor:
        """∂ Σ log_partition / ∂μ by autograd (Lemma 7.1), for potentials without a closed form."""
        cache = dict(self.engine.caches.get(fam.name, {}))  # nothing built in here leaks out
        return self._partial(lambda: operator_for(fam, cache).log_partition().sum())

    def energy_gradient(self) -> torch.Tensor | None:
        """∂(Σ node energies)/∂μ by autograd (``structattn.energy``), or None without any."""
        terms = [e for e in self.engine.energies.values() if e.touches(self.latent)]
        if not terms:
            return None
        return self._partial(lambda: sum(e.value().sum() for e in terms))

    def free_energy_gradient(self) -> torch.Tensor:
        """∂F/∂μ = (μ − loc)/scale² − E[∂ψ/∂μ] + ∂(node energies)/∂μ."""
        g = self.latent.prior_gradient(self.state)
        if self.families():
            g = g - self.expected_gradient()
        e = self.energy_gradient()
        return g if e is None else g + e

    def curvature(self):
        """1/scale² + Σ E[−∂²ψ/∂μ²] (a multiple of the identity per node), or None when a
        potential is not linear or isotropic-quadratic in this latent."""
        if any(e.touches(self.latent) for e in self.engine.energies.values()):
            return None  # a node energy: no closed form
        total = self.latent.prior_precision()
        for fam in self.families():
            if through(fam, self.latent):
                return None  # a deterministic node set of it: no closed form
            op = self.operator(fam.name)
            for side in sides(fam, self.latent):
                for psi in fam.potentials:
                    c = psi.expected_curvature(side, op)
                    if c is None:
                        return None
                    total = total + c
        return total

    def cccp(self) -> torch.Tensor:
        """The closed-form CCCP/EM update μ − ∇F/H (see the module docstring)."""
        h = self.curvature()
        name = self.latent.name
        z = self.latent
        if h is not None and z.scale is not None and isinstance(h, float) \
                and h == z.prior_precision():
            # every potential is linear in μ: the update is loc + scale²·E[∂ψ/∂μ] (CCCP)
            new = (self.expected_gradient(weight=z.scale ** 2) if isinstance(z.scale, float)
                   else z.scale ** 2 * self.expected_gradient())
            return new if isinstance(z.loc, float) and z.loc == 0.0 else new + z.loc
        if h is None:
            raise ValueError(
                f"latent node set {name!r}: update='cccp' needs potentials that are linear or "
                f"isotropic-quadratic in it (Bilinear, DotProduct, SquaredDistance); a Mapped "
                f"potential, a projected SquaredDistance side or a node energy has no closed "
                f"form. Use update='gradient' or a callable update(state, step)"
            )
        if isinstance(h, float) and h == 0.0:
            raise ValueError(
                f"latent node set {name!r}: update='cccp' with a flat prior (scale=None) and "
                f"potentials linear in it has no fixed point (F is unbounded below); give it "
                f"a Gaussian prior (scale=…) or a Gaussian (SquaredDistance) potential"
            )
        b = self._expected_offset()
        if b is not None:  # EM's form: (loc/scale² + Σ b)/H, the same point without μ's terms
            pull = z.prior_pull()
            return (b if isinstance(pull, float) and pull == 0.0 else b + pull) / h
        return self.state - self.free_energy_gradient() / h

    def _expected_offset(self) -> torch.Tensor | None:
        """Σ over families, sides and potentials of b in E[∂ψ/∂μ] = b − c·μ (each potential's
        ``expected_gradient_offset``), or None when one does not state it."""
        terms = []
        for fam in self.families():
            op = self.operator(fam.name)
            for side in sides(fam, self.latent):
                for psi in fam.potentials:
                    b = psi.expected_gradient_offset(side, op)
                    if b is None:
                        return None
                    terms.append(b)
        return sum(terms[1:], terms[0]) if terms else None

    def gradient_step(self, step_size: float) -> torch.Tensor:
        return self.state - step_size * self.free_energy_gradient()


class Engine:
    """Runs the iteration over the latents and families a reader has seen."""

    def __init__(self, latents: list, families: dict, caches: dict, energies: dict | None = None):
        self.latents, self.families, self.caches = latents, families, caches
        self.energies = energies or {}
        for fam in families.values():
            if fam.inference is not None:
                raise ValueError(
                    f"edge family {fam.name!r}: its inference scheme ({fam.inference.describe()}) "
                    f"iterates on its own and cannot join the iteration of latent node sets; "
                    f"declare it after structattn.infer(...), or read it exactly (no scheme)")

    def operators(self) -> dict:
        """One operator per family at the current states."""
        return {name: operator_for(fam, self.caches.setdefault(name, {}))
                for name, fam in self.families.items()}

    def free_energy(self, ops: dict | None = None) -> torch.Tensor:
        """F at the current states, ``(*batch,)`` (``ops``: the families' operators there, if
        already built)."""
        ops = self.operators() if ops is None else ops
        total = 0
        for z in self.latents:
            total = total - z.log_prior()
        for term in self.energies.values():
            total = total + term.value()
        for op in ops.values():
            total = total - op.log_partition().sum((-2, -1))
        return total

    def _update(self, z: LatentNodeSet) -> torch.Tensor:
        o = z.options
        old = z.states
        step = Step(self, z)
        if o.update == "cccp":
            new = step.cccp()
        elif o.update == "gradient":
            new = step.gradient_step(o.step_size)
        else:
            new = o.update(z.states, step)
            if not isinstance(new, torch.Tensor) or new.shape != z.states.shape:
                got = tuple(new.shape) if isinstance(new, torch.Tensor) else type(new).__name__
                raise ValueError(f"latent node set {z.name!r}: the update rule must return a "
                                 f"tensor of the state's shape {tuple(z.states.shape)}; got {got}")
        z.states = old  # (an update may have moved it: Step.move_to)
        if o.damping:
            new = (1 - o.damping) * new + o.damping * old
        return new

    def _one_step(self, active) -> float:
        moved = 0.0
        for z in active:
            old = z.states
            new = self._update(z)
            if z.options.tol is not None:
                moved = max(moved, float((new - old).abs().max().detach()))
            z.states = new
        return moved

    def run(self, *, record: bool = False, record_posteriors: bool = False) -> Trace:
        grads = {z.options.grad for z in self.latents}
        if len(grads) > 1:
            raise ValueError(f"latent node sets {[z.name for z in self.latents]} ask for "
                             f"different grad= options {sorted(grads)}; use one per model")
        last_only = grads == {"last"}
        budget = max(z.options.steps for z in self.latents)
        trace = Trace(converged=None if all(z.options.tol is None for z in self.latents)
                      else False)
        history, energies, posts = {z.name: [] for z in self.latents}, [], {}

        def remember():
            if not record:
                return
            for z in self.latents:
                history[z.name].append(z.states)
            ops = self.operators()  # shared by F and the posteriors: one score table each
            energies.append(self.free_energy(ops))
            if record_posteriors:
                for name, op in ops.items():
                    posts.setdefault(name, []).append(op.dense_posterior())

        remember()
        watch = DivergenceWatch(self)  # update="gradient": warn when F ends above its start
        if budget:
            watch.start(energies[0] if energies else None)
        t = 0
        free_steps = budget - 1 if last_only else budget
        no_grad = torch.no_grad() if last_only else contextlib.nullcontext()
        with no_grad:
            while t < free_steps:
                active = [z for z in self.latents if t < z.options.steps]
                moved = self._one_step(active)
                t += 1
                remember()
                if trace.converged is not None and moved <= min(
                        z.options.tol for z in self.latents if z.options.tol is not None):
                    trace.converged = True
                    break
        if last_only and budget > 0:  # one differentiable step from the detached state
            for cache in self.caches.values():  # built without gradients: build them again
                cache.clear()
            for z in self.latents:
                z.states = z.states.detach()
            self._one_step([z for z in self.latents if t < z.options.steps or trace.converged])
            t += 1
            remember()
        trace.steps = t
        watch.finish(t, energies if record else None)
        if record:
            trace.states = {k: torch.stack(v) for k, v in history.items()}
            trace.free_energy = torch.stack(energies)
            if record_posteriors:
                trace.posteriors = {k: torch.stack(v) for k, v in posts.items()}
        return trace
