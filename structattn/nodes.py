"""Node sets: the random variables an edge family connects.

A node set is a named tensor of states ``(*batch, n, features)``; observed
node sets are conditioned on (their states are data), latent node sets will
carry a recognition density (iterative models, SPEC.md §4).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import reading
from .checking._validation import check_finite, shape_str


@dataclass(eq=False)
class NodeSet:
    """A named set of nodes with states ``(*batch, size, features)``.

    ``structattn.nodes`` builds it (``structattn.latent`` and ``structattn.deterministic`` build
    its subclasses); ``size``, ``features`` and ``batch_shape`` read the states' shape.

    Attributes:
        name: the node set's name (its Pyro site).
        states: ``(*batch, size, features)``, the nodes' states.
        observed: whether the states are data (True) or inferred (a latent node set).
        memory: whether the observed states are stored patterns or prototypes (parameters
            rather than data); drawings show them apart. Default False.
    """

    name: str
    states: torch.Tensor
    observed: bool = True
    _plates: list | None = field(default=None, repr=False)
    #: a memory (stored patterns, prototypes): observed states that are parameters, not data
    memory: bool = False

    def plates(self, event_dims: int = 0) -> list:
        """Pyro plates over ``(*batch, nodes)``, created once per node set so that every
        site indexed by these nodes shares them; ``event_dims`` extra plate dims (e.g.
        heads) sit between batch and nodes."""
        if self._plates is None:
            import pyro

            # Size-1 plates are left out: they state no independence, and Pyro's
            # compute_marginals cannot broadcast over dims it packed away.
            nb = len(self.batch_shape)
            self._plates = [
                pyro.plate(f"{self.name}.batch_{k}", size, dim=k - nb - 1 - event_dims)
                for k, size in enumerate(self.batch_shape) if size > 1
            ] + ([pyro.plate(f"{self.name}.nodes", self.size, dim=-1)] if self.size > 1 else [])
        return self._plates

    def batch_plates(self, event_dims: int = 0) -> list:
        """The batch plates alone (see ``plates``)."""
        plates = self.plates(event_dims)
        return plates[:-1] if self.size > 1 else plates

    @property
    def size(self) -> int:
        return self.states.shape[-2]

    @property
    def features(self) -> int:
        return self.states.shape[-1]

    @property
    def batch_shape(self) -> torch.Size:
        return self.states.shape[:-2]

    def __repr__(self) -> str:
        kind = "observed" if self.observed else "latent"
        return f"NodeSet({self.name!r}, {kind}, states={shape_str(self.states.shape)})"


def _make_node_set(name: str, states, features: int | None = None, observed: bool = True):
    if not isinstance(name, str) or not name:
        raise ValueError(f"a node set needs a non-empty string name; got {name!r}")
    if not isinstance(states, torch.Tensor):
        raise ValueError(
            f"node set {name!r}: states must be a torch.Tensor of shape (*batch, n, features); "
            f"got {type(states).__name__}"
        )
    if states.dim() < 2:
        raise ValueError(
            f"node set {name!r}: states must have shape (*batch, n, features) with at least 2 "
            f"dims; got shape {shape_str(states.shape)}"
        )
    if not states.is_floating_point():
        raise ValueError(
            f"node set {name!r}: states must be floating point (float32, float64 or bfloat16); "
            f"got dtype {states.dtype}"
        )
    if features is not None and states.shape[-1] != features:
        raise ValueError(
            f"node set {name!r}: states must have shape (*batch, n, {features}); got "
            f"{shape_str(states.shape)} (last dim {states.shape[-1]} != {features})"
        )
    if states.shape[-2] == 0:
        raise ValueError(f"node set {name!r} is empty: states have shape {shape_str(states.shape)}")
    check_finite(f"node set {name!r}", states)
    return NodeSet(name, states, observed)


def nodes(name: str, states: torch.Tensor, *, features: int | None = None,
          memory: bool = False) -> NodeSet:
    """Declare an observed node set ``name`` with states ``(*batch, n, features)``.

    Args:
        name: the node set's name (its Pyro site).
        states: ``(*batch, n, features)``, the n nodes' observed states.
        features: the expected size of the last dimension (None: any).
        memory: stored patterns or prototypes (observed, but parameters rather than data):
            the drawings show them apart.

    Returns:
        The ``NodeSet``, for ``structattn.edges``.

    Raises:
        ValueError: states that are not a float tensor of at least two dimensions, or
            whose last dimension is not ``features``, naming the node set.

    Example:
        >>> import torch, structattn as sa
        >>> sa.nodes("x", torch.zeros(2, 5, 4)).size  # the number of nodes
        5
    """
    ns = _make_node_set(name, states, features, True)
    ns.memory = bool(memory)
    return reading.current_reading().nodes(ns)


class DeterministicNodeSet(NodeSet):
    """A node set whose states are a function of other node sets' states.

    ``states = fn(*sources' states)`` (``structattn.deterministic`` builds it and checks its
    arguments): recomputed whenever a source has moved (a latent's iterate), so an edge family
    over it sees the sources' current states and the iterative engine differentiates through
    ``fn``. It is observed when every source is.

    Args:
        name (str): the node set's name.
        fn (Callable): the function ``fn(*states) -> (*batch, n, features)`` of the sources'
            states, in the order of ``sources``.
        sources (Sequence[NodeSet]): the node sets whose states ``fn`` reads (observed, latent
            or deterministic).
        pullback (Callable | None): the vector-Jacobian product of ``fn`` in closed form,
            ``pullback(u, states, *sources' states)`` → one tensor per source (or one tensor
            for one source), shaped like that source's states; None: autograd differentiates
            ``fn``.
    """

    def __init__(self, name, fn, sources, pullback=None):
        self.name, self.fn, self.sources, self.pullback = name, fn, tuple(sources), pullback
        self._plates, self.memory = None, False
        self._memo = None  # (the sources' states, fn of them)

    def pull_back(self, u: torch.Tensor) -> tuple:
        """The vector-Jacobian product of ``fn`` at the current states: Σ ⟨u, ∂states/∂s⟩ for
        each source s, shaped like its states (``pullback(u, states, *sources' states)``)."""
        grads = self.pullback(u, self.states, *(s.states for s in self.sources))
        grads = (grads,) if isinstance(grads, torch.Tensor) else tuple(grads)
        if len(grads) != len(self.sources) or any(
                g.shape != s.states.shape for g, s in zip(grads, self.sources, strict=True)):
            want = [shape_str(s.states.shape) for s in self.sources]
            got = [shape_str(g.shape) if isinstance(g, torch.Tensor) else type(g).__name__
                   for g in grads]
            raise ValueError(f"deterministic node set {self.name!r}: pullback must return one "
                             f"gradient per source, shaped like its states {want}; got {got}")
        return grads

    @property
    def observed(self) -> bool:
        """Data when every source is: computed once; otherwise it moves with a latent."""
        return all(s.observed for s in self.sources)

    @property
    def inferred(self) -> bool:
        """Its latent sources have been inferred (a value read from it is read there)."""
        return all(s.observed or s.inferred for s in self.sources)

    @property
    def states(self) -> torch.Tensor:
        current = tuple(s.states for s in self.sources)
        memo = self._memo
        if memo is None or any(a is not b for a, b in zip(memo[0], current, strict=True)):
            memo = self._memo = (current, self.fn(*current))
        return memo[1]

    def depends_on(self, node_set: NodeSet) -> bool:
        """Whether ``node_set`` is a source, directly or through another deterministic set."""
        return any(depends_on(s, node_set) for s in self.sources)

    def __repr__(self) -> str:
        return (f"DeterministicNodeSet({self.name!r}, of {[s.name for s in self.sources]}, "
                f"states={shape_str(self.states.shape)})")


def depends_on(ns: NodeSet, node_set: NodeSet) -> bool:
    """Whether ``ns`` is ``node_set`` or a deterministic function of it."""
    return ns is node_set or (isinstance(ns, DeterministicNodeSet) and ns.depends_on(node_set))


def _make_deterministic(name, fn, sources, features=None, pullback=None):
    if not callable(fn):
        raise ValueError(f"deterministic node set {name!r}: fn must be callable; got "
                         f"{type(fn).__name__}")
    if not sources or not all(isinstance(s, NodeSet) for s in sources):
        raise ValueError(f"deterministic node set {name!r}: give the node sets its states are "
                         f"computed from (structattn.nodes / latent / deterministic); got "
                         f"{[type(s).__name__ for s in sources]}")
    if pullback is not None and not callable(pullback):
        raise ValueError(f"deterministic node set {name!r}: pullback must be callable or None; "
                         f"got {type(pullback).__name__}")
    ns = DeterministicNodeSet(name, fn, sources, pullback)
    states = _make_node_set(name, ns.states, features).states  # any node set's checks
    if states.shape[:-2] != sources[0].batch_shape:
        want = "".join(f"{n}, " for n in sources[0].batch_shape)
        raise ValueError(f"deterministic node set {name!r}: fn must return states of shape "
                         f"({want}n, features) — the batch dims of {sources[0].name!r}; got "
                         f"{shape_str(states.shape)}")
    return ns


def deterministic(name: str, fn, *node_sets: NodeSet, features: int | None = None,
                  pullback=None) -> NodeSet:
    """Declare a node set ``name`` whose states are ``fn(*states of node_sets)``.

    The states are ``(*batch, n, features)`` — e.g. K predictions g_k(z) of a latent layer z,
    for an edge family that picks one of them. Where a source is latent the states follow its
    iterate; where every source is observed, it is data.

    The iterative engine needs ∂/∂z through ``fn``: give it in closed form as ``pullback(u,
    states, *source states)`` → one tensor per source (one tensor for one source), the
    vector-Jacobian product Σ ⟨u, ∂states/∂source⟩ — e.g. for states = tanh(z Wᵀ),
    ``lambda u, g, z: (u * (1 - g**2)) @ W``. Without it autograd differentiates ``fn``
    (correct, but a reading PyTorch's tracer cannot record: read every call, not exported).

    Args:
        name: the node set's name (its Pyro site).
        fn (Callable): a callable ``fn(*states) -> (*batch, n, features)`` taking the states of
            ``node_sets``, in order; its output must have the batch dims of the first node set.
        *node_sets: the source node sets, at least one (from ``structattn.nodes``,
            ``structattn.latent`` or ``structattn.deterministic``).
        features: the expected size of the states' last dimension (None: any).
        pullback (Callable | None): the vector-Jacobian product of ``fn`` in closed form, as
            above; None:
            autograd differentiates ``fn``.

    Returns:
        The ``DeterministicNodeSet``, for ``structattn.edges``.

    Raises:
        ValueError: ``fn`` or ``pullback`` is not callable, no node set is given or one is
            not a ``NodeSet``, ``name`` is empty, or ``fn``'s output fails a node set's checks
            (a non-empty float tensor ``(*batch, n, features)`` with the first node set's batch
            dims, and finite while the checks are on).
    """
    return reading.current_reading().nodes(
        _make_deterministic(name, fn, node_sets, features, pullback))
