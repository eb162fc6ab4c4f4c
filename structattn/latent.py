"""Latent node sets: nodes whose states are inferred, not observed (paper §4, SPEC "Iterative").

``latent(name, init, loc=…, scale=…)`` declares nodes z ``(*batch, n, features)`` with a
Gaussian prior z ~ N(loc, scale² I) (``scale=None``: a flat, improper prior). With the
edges summed out the model is p(x, z) = p(z) Π_i Σ_{φ_i} p(φ_i) exp ψ(x, z, φ_i), and its
free energy at a point estimate μ is

    F(μ) = −log p(x, z = μ) = −log p(μ) − Σ_i log Σ_j exp(ψ_ij(μ) + log p(φ_i = j)).

Readings:

- **Pyro**: one ``pyro.sample(name, Normal(loc, scale).to_event(2))`` site inside the batch
  plates, so SVI with a point-mass guide (edges enumerated) finds the MAP of p(x, z);
- **compiled**: the current iterate μ_t. ``infer(z)`` (or the first ``value`` of a family
  touching z) runs the iteration — CCCP/EM fixed point, gradient steps or the user's
  update — and every later read sees the final state.

::

    observed x_1 … x_N        φ collapsed: Σ_φ
                 \\  |  /
    latent        z_i  ~ N(loc, scale²)     μ ← update(μ, E_{p(φ|x, μ)}[∂ψ/∂μ])
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace

import torch

from . import reading
from .checking._validation import is_recording, passes, shape_str
from .nodes import NodeSet, _make_node_set

UPDATES = ("cccp", "gradient")
GRADIENTS = ("unroll", "last")


@dataclass(frozen=True)
class IterationOptions:
    """How the compiled reading infers one latent node set.

    ``structattn.latent`` builds it from its keyword arguments (a latent node set's
    ``options``, with ``structattn.iteration``'s overrides applied); making one checks every
    field.

    Attributes:
        steps: number of updates, an int ≥ 0 (a budget when ``tol`` is set). Default 3.
        tol: stop once every latent moved by at most ``tol`` (max abs) in one step, a finite
            number > 0; None (default): run all ``steps``.
        damping: α in [0, 1): μ ← (1 − α)·update + α·μ. Default 0 (no damping).
        update: ``"cccp"`` (default: the closed-form fixed point, CCCP/EM), ``"gradient"``
            (μ ← μ − η∇F, η = ``step_size``) or a callable ``update(state, step) -> new_state``
            (``step``: a ``structattn.Step``).
        step_size: η of ``"gradient"`` updates, a finite number > 0. Default 0.1.
        grad: ``"unroll"`` (default: back-propagate through every step) or ``"last"``
            (iterate without gradients, then one differentiable step from the detached state:
            first-order implicit differentiation).

    Raises:
        ValueError: a field outside the ranges above, naming it.
    """

    steps: int = 3
    tol: float | None = None
    damping: float = 0.0
    update: object = "cccp"
    step_size: float = 0.1
    grad: str = "unroll"

    def __post_init__(self):
        check_options(self)


def place_latent(node_set, latent_values: dict | None) -> None:
    """Put a latent node set at its given state (``latent_values``: name → states), marking it
    inferred; nothing when no values are given (it starts at its initial state)."""
    if latent_values is None:
        return
    try:
        value = latent_values[node_set.name]
    except KeyError:
        raise ValueError(f"no value given for latent node set {node_set.name!r}; "
                         f"given: {sorted(latent_values)}") from None
    if value.shape != node_set.states.shape:
        raise ValueError(f"latent node set {node_set.name!r}: the given value has shape "
                         f"{tuple(value.shape)}, expected {tuple(node_set.states.shape)}")
    node_set.states, node_set.inferred = value, True


def check_options(o: IterationOptions, where: str = "latent") -> None:
    if not isinstance(o.steps, int) or isinstance(o.steps, bool) or o.steps < 0:
        raise ValueError(f"{where}: steps must be an int ≥ 0; got {o.steps!r}")
    if o.tol is not None and not (isinstance(o.tol, (int, float)) and o.tol > 0
                                  and math.isfinite(o.tol)):
        raise ValueError(f"{where}: tol must be a finite number > 0 or None; got {o.tol!r}")
    if not (isinstance(o.damping, (int, float)) and 0 <= o.damping < 1):
        raise ValueError(f"{where}: damping must be a number in [0, 1); got {o.damping!r}")
    if not (callable(o.update) or o.update in UPDATES):
        raise ValueError(f"{where}: update must be one of {UPDATES} or a callable "
                         f"update(state, step) -> state; got {o.update!r}")
    if not (isinstance(o.step_size, (int, float)) and o.step_size > 0
            and math.isfinite(o.step_size)):
        raise ValueError(f"{where}: step_size must be a finite number > 0; got {o.step_size!r}")
    if o.grad not in GRADIENTS:
        raise ValueError(f"{where}: grad must be one of {GRADIENTS}; got {o.grad!r}")


@contextlib.contextmanager
def iteration(**options):
    """Override every latent's iteration options in this thread.

    E.g. ``with structattn.iteration(steps=500, tol=1e-12): layer(x)`` (run to a fixed point).
    Nested blocks add to the enclosing block's overrides; each block's exit restores those in
    force before it.

    Args:
        **options (Any): ``IterationOptions`` fields by name (``steps``, ``tol``, ``damping``,
            ``update``, ``step_size``, ``grad``), each replacing that option of every latent
            node set read inside the block.

    Yields:
        (None): nothing; the overrides hold inside the ``with`` block.

    Raises:
        ValueError: an option that is not an ``IterationOptions`` field, or a value that
            ``IterationOptions`` refuses.
    """
    unknown = set(options) - set(IterationOptions.__dataclass_fields__)
    if unknown:
        raise ValueError(f"structattn.iteration: unknown options {sorted(unknown)}; expected "
                         f"some of {sorted(IterationOptions.__dataclass_fields__)}")
    check_options(replace(IterationOptions(), **options), "structattn.iteration")
    with reading.entered(iteration={**reading.context().iteration, **options}):
        yield


def iteration_overrides() -> dict:
    """The options ``structattn.iteration(...)`` sets in this thread (name → value)."""
    return dict(reading.context().iteration)


class LatentNodeSet(NodeSet):
    """A node set whose states are inferred: prior N(loc, scale²) (or flat), an initial state,
    and the options of its iteration.

    ``structattn.latent`` builds it and checks its arguments. ``states`` is the current
    iterate; ``options`` applies ``structattn.iteration``'s overrides in force.

    Args:
        name (str): the node set's name (its Pyro site).
        init (torch.Tensor): the initial state ``(*batch, n, features)``.
        loc (float | torch.Tensor): the prior's mean, a number or a tensor broadcastable to
            ``init``.
        scale (float | torch.Tensor | None): the prior's standard deviation, a number > 0 or a
            tensor broadcastable to ``init``; None: a flat, improper prior.
        options: how the compiled reading infers it (``IterationOptions``).

    Attributes:
        init: the initial state ``(*batch, n, features)``.
        loc: the prior's mean.
        scale: the prior's standard deviation (None: flat).
        inferred: whether the states are final (iterated, or given): False until then.
    """

    def __init__(self, name, init, loc, scale, options: IterationOptions):
        super().__init__(name, init, observed=False)
        self.init, self.loc, self.scale, self._options = init, loc, scale, options
        self.inferred = False
        # a learned scale's 1/scale² and loc/scale², once per forward and grad mode (not once
        # per step: each is an operation, and another in the backward, at every step)
        self._prior_terms: dict = {}

    def pyro_sample(self) -> LatentNodeSet:
        """Pyro's reading (``structattn.reading.PYRO``): z a ``pyro.sample`` site."""
        return _sample_latent(self)

    @property
    def options(self) -> IterationOptions:
        over = reading.context().iteration
        return replace(self._options, **over) if over else self._options

    def prior_precision(self):
        """1/scale² (0 for a flat prior), broadcastable to the states."""
        if self.scale is None:
            return 0.0
        if not isinstance(self.scale, torch.Tensor):
            return self.scale ** -2
        return self._once("precision", lambda: self.scale ** -2)

    def prior_pull(self):
        """loc/scale² (0 for a flat prior or loc 0): the prior's term in EM's numerator."""
        if self.scale is None or (isinstance(self.loc, float) and self.loc == 0.0):
            return 0.0
        if not isinstance(self.scale, torch.Tensor) and not isinstance(self.loc, torch.Tensor):
            return self.scale ** -2 * self.loc
        return self._once("pull", lambda: self.prior_precision() * self.loc)

    def _once(self, what: str, make):
        """``make()`` computed once per forward and grad mode (a no-grad value has no graph
        for the differentiable step that follows it)."""
        key = (what, torch.is_grad_enabled())
        if key not in self._prior_terms:
            self._prior_terms[key] = make()
        return self._prior_terms[key]

    def log_prior(self, states: torch.Tensor | None = None) -> torch.Tensor:
        """log p(z) summed over nodes and features: ``(*batch,)`` (0 for a flat prior)."""
        z = self.states if states is None else states
        if self.scale is None:
            return z.new_zeros(z.shape[:-2])
        scale = torch.as_tensor(self.scale, dtype=z.dtype, device=z.device)
        lp = -0.5 * ((z - self.loc) / scale) ** 2 - torch.log(scale) - 0.5 * math.log(2 * math.pi)
        return lp.expand(z.shape).sum((-2, -1))

    def prior_gradient(self, states: torch.Tensor) -> torch.Tensor:
        """∂(−log p(z))/∂z = (z − loc)/scale² (0 for a flat prior)."""
        if self.scale is None:
            return torch.zeros_like(states)
        return (states - self.loc) * self.prior_precision()

    def __repr__(self) -> str:
        prior = "flat" if self.scale is None else "Gaussian"
        return f"LatentNodeSet({self.name!r}, {prior} prior, states={shape_str(self.states.shape)})"


def _check_prior_param(name, what, value, init):
    if isinstance(value, torch.Tensor):
        try:
            torch.broadcast_shapes(value.shape, init.shape)
        except RuntimeError:
            raise ValueError(f"latent node set {name!r}: {what} must broadcast to the states "
                             f"{shape_str(init.shape)}; got {shape_str(value.shape)}") from None
        if what == "scale" and (not torch.compiler.is_compiling() or is_recording()) \
                and not passes(~(value <= 0).any()):  # NaN: named as a parameter elsewhere
            raise ValueError(f"latent node set {name!r}: scale must be > 0 everywhere")
        return value
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"latent node set {name!r}: {what} must be a number or a tensor; got "
                         f"{value!r}") from None
    if not math.isfinite(v) or (what == "scale" and v <= 0):
        cond = "a finite number > 0" if what == "scale" else "finite"
        raise ValueError(f"latent node set {name!r}: {what} must be {cond}; got {value!r}")
    return v


def _make_latent(name, init, loc, scale, options, features):
    ns = _make_node_set(name, init, features, observed=False)
    loc = _check_prior_param(name, "loc", loc, init)
    scale = None if scale is None else _check_prior_param(name, "scale", scale, init)
    return LatentNodeSet(name, ns.states, loc, scale, options)


def _flat() -> type:
    """``_Flat``, Pyro's improper flat density with log p = 0 in the value's dtype (Pyro's is
    float32): defined on the first Pyro reading of a flat prior, so that importing structattn
    does not import Pyro."""
    global _Flat
    if "_Flat" in globals():
        return _Flat
    import pyro.distributions as dist

    class _Flat(dist.ImproperUniform):
        """Pyro's improper flat density, with log p = 0 in the value's dtype."""

        def log_prob(self, value):
            shape = value.shape[:value.dim() - self.event_dim]
            return value.new_zeros(torch.broadcast_shapes(shape, self.batch_shape))

    return _Flat


def _sample_latent(node_set: LatentNodeSet) -> LatentNodeSet:
    """Default (Pyro) reading: z is a ``pyro.sample`` site in the plates (*batch, heads = 1,
    nodes) of the families, event dim = features; its value is ``(*batch, 1, n, d)``."""
    import pyro
    import pyro.distributions as dist
    from pyro.distributions import constraints

    z = node_set.init
    shape = (*z.shape[:-2], 1, z.shape[-2])
    if node_set.scale is None:
        prior = _flat()(constraints.real, shape, z.shape[-1:])
    else:
        loc = torch.as_tensor(node_set.loc, dtype=z.dtype, device=z.device).expand(z.shape)
        scale = torch.as_tensor(node_set.scale, dtype=z.dtype, device=z.device).expand(z.shape)
        prior = dist.Normal(loc.unsqueeze(-3), scale.unsqueeze(-3)).to_event(1)
    with contextlib.ExitStack() as stack:
        for plate in node_set.plates(event_dims=1):
            stack.enter_context(plate)
        value = pyro.sample(node_set.name, prior)
    node_set.states = value.reshape(z.shape)
    return node_set




def latent(name: str, init: torch.Tensor, *, loc=0.0, scale=1.0, steps: int = 3,
           tol: float | None = None, damping: float = 0.0, update="cccp", step_size: float = 0.1,
           grad: str = "unroll", features: int | None = None) -> LatentNodeSet:
    """Declare a latent node set ``name`` with prior z ~ N(loc, scale²·I).

    ``scale=None`` gives a flat prior. The Pyro reading samples z at a ``pyro.sample`` site;
    the compiled reading starts it at ``init`` and iterates it. The options after ``scale``
    say how the compiled reading infers it (see ``IterationOptions``).

    Args:
        name: the node set's name (its Pyro site).
        init: the initial state ``(*batch, n, features)``, a float tensor.
        loc (float | torch.Tensor): the prior's mean, a finite number or a tensor
            broadcastable to ``init``. Default 0.
        scale (float | torch.Tensor | None): the prior's standard deviation, a finite number
            > 0 or a tensor broadcastable to ``init`` (> 0 everywhere); None: a flat, improper
            prior. Default 1.
        steps: number of updates, an int ≥ 0 (a budget when ``tol`` is set).
        tol: stop once every latent moved by at most ``tol`` (max abs) in one step; None: run
            all ``steps``.
        damping: α in [0, 1): μ ← (1 − α)·update + α·μ; 0: no damping.
        update (str | Callable): ``"cccp"`` (the closed-form fixed point), ``"gradient"``
            (gradient steps of size ``step_size``) or a callable
            ``update(state, step) -> new_state``.
        step_size: the step size of ``"gradient"`` updates.
        grad: ``"unroll"`` (back-propagate through every step) or ``"last"`` (one
            differentiable step from the detached final state).
        features: the expected size of the states' last dimension (None: any).

    Returns:
        The ``LatentNodeSet``, for ``structattn.edges``; read its inferred states with
            ``structattn.infer``.

    Raises:
        ValueError: an ``init`` or ``name`` that a node set refuses (see ``structattn.nodes``),
            a ``loc`` or ``scale`` that is not a finite number or a tensor broadcastable to
            ``init`` (or a ``scale`` ≤ 0), an iteration option outside its range, or, under a
            structattn reader, a second latent node set of the same name in one model.
    """
    options = IterationOptions(steps, tol, damping, update, step_size, grad)
    node_set = _make_latent(name, init, loc, scale, options, features)
    return reading.current_reading().latent(node_set)


def infer(*node_sets: LatentNodeSet):
    """The inferred states of latent node sets.

    The compiled reading iterates every latent declared so far to its (approximate) fixed
    point; the Pyro reading returns the sampled (or guided) value.

    Args:
        *node_sets: the latent node sets to read (``structattn.latent``).

    Returns:
        (torch.Tensor | tuple[torch.Tensor, ...]): for one node set, its states
            ``(*batch, n, features)``; for several, a tuple of them, in the order given.

    Raises:
        ValueError: an argument that is not a latent node set from ``structattn.latent``, or,
            in the compiled reading, a latent to iterate that is in no edge family and no
            energy.
    """
    for ns in node_sets:
        if not isinstance(ns, LatentNodeSet):
            raise ValueError(f"structattn.infer takes latent node sets from structattn.latent(...); "
                             f"got {type(ns).__name__}")
    reading.current_reading().infer(node_sets)
    states = tuple(ns.states for ns in node_sets)
    return states[0] if len(states) == 1 else states
