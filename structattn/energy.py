"""Node energies: terms of −log p(x, z) on node states that are not edge potentials.

``energy(name, fn, *node_sets)`` adds E(x, z) = ``fn(*states)`` (one value per batch element,
``(*batch,)``) to the model: p(x, z) ∝ exp(−E) · Π_families Σ_φ …. Typical use: the Gaussian
prediction errors of a standard predictive-coding network, ½k‖z_l − W f(z_{l−1})‖², which
connect whole layers rather than choosing one edge.

Readings: Pyro — a ``pyro.factor(name, −E)`` site inside the batch plates; compiled — a term
of the free energy F and, through autograd, of its gradient (the ``"gradient"`` update and
callables; the closed-form CCCP update refuses a latent under an energy).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from . import reading
from .nodes import NodeSet, depends_on


@dataclass(eq=False)
class Energy:
    name: str
    fn: object
    node_sets: tuple

    def value(self) -> torch.Tensor:
        """E at the node sets' current states, ``(*batch,)``."""
        batch = self.node_sets[0].batch_shape
        e = self.fn(*(ns.states for ns in self.node_sets))
        if not isinstance(e, torch.Tensor) or e.shape != batch:
            got = tuple(e.shape) if isinstance(e, torch.Tensor) else type(e).__name__
            raise ValueError(f"energy {self.name!r} must return one value per batch element, a "
                             f"tensor of shape {tuple(batch)}; got {got}")
        return e

    def pyro_factor(self) -> Energy:
        """Pyro's reading (``structattn.reading.PYRO``): ``pyro.factor(name, −E)``."""
        return _factor_energy(self)

    def touches(self, node_set) -> bool:
        return any(depends_on(ns, node_set) for ns in self.node_sets)


def _factor_energy(term: Energy) -> Energy:
    """Default (Pyro) reading: ``pyro.factor(name, −E)`` inside the batch plates."""
    import pyro

    first = term.node_sets[0]
    with contextlib.ExitStack() as stack:
        for plate in first.batch_plates(event_dims=1):
            stack.enter_context(plate)
        pyro.factor(term.name, -term.value()[..., None, None])  # (*batch, heads=1, nodes=1)
    return term


def energy(name: str, fn, *node_sets: NodeSet) -> Energy:
    """Add the energy E(x, z) = ``fn(*states)`` of ``node_sets`` to the model.

    A term of −log p(x, z) on node states that is not an edge potential: p(x, z) ∝ exp(−E) ·
    Π_families Σ_φ …, e.g. the Gaussian prediction errors of a predictive-coding network.
    Read by Pyro as a ``pyro.factor(name, −E)`` site inside the batch plates; compiled, as a
    term of the free energy F and, through autograd, of its gradient (the closed-form CCCP
    update refuses a latent under an energy).

    Args:
        name: the term's name, a non-empty string (its Pyro site).
        fn (Callable): takes the node sets' states in order, each ``(*batch, n, d)``, and
            returns E, one value per batch element, ``(*batch,)``.
        *node_sets: the node sets it reads (``structattn.nodes``, ``structattn.latent``),
            at least one; they share their batch dims.

    Returns:
        The ``Energy`` term (``name``, ``fn``, ``node_sets``).

    Raises:
        ValueError: ``name`` is not a non-empty string, ``fn`` is not callable, no node set
            (or something else) is given, the node sets' batch dims differ, the model
            declares ``name`` twice (compiled or drawn), or ``fn`` returns anything but a
            tensor of shape ``(*batch,)`` when E is evaluated.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"an energy needs a non-empty string name; got {name!r}")
    if not callable(fn):
        raise ValueError(f"energy {name!r}: fn must be callable; got {type(fn).__name__}")
    if not node_sets or not all(isinstance(ns, NodeSet) for ns in node_sets):
        raise ValueError(f"energy {name!r}: give the node sets it reads (structattn.nodes / "
                         f"structattn.latent); got {[type(ns).__name__ for ns in node_sets]}")
    batch = node_sets[0].batch_shape
    for ns in node_sets[1:]:
        if ns.batch_shape != batch:
            raise ValueError(f"energy {name!r}: node sets {node_sets[0].name!r} and {ns.name!r} "
                             f"must share batch dims; got {tuple(batch)} and "
                             f"{tuple(ns.batch_shape)}")
    term = Energy(name, fn, tuple(node_sets))
    return reading.current_reading().energy(term)
