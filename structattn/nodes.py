"""Node sets: the random variables an edge family connects.

A node set is a named tensor of states ``(*batch, n, features)``; observed
node sets are conditioned on (their states are data), latent node sets will
carry a recognition density (iterative models, SPEC.md §4).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pyro
import torch
from pyro.poutine.runtime import effectful

from ._direct import direct_readers
from ._validation import check_finite, shape_str


@dataclass(eq=False)
class NodeSet:
    """A named set of nodes with states ``(*batch, size, features)``."""

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


@effectful(type="structattn_nodes")
def _nodes(name, states, features=None, observed=True):
    return _make_node_set(name, states, features, observed)


def nodes(name: str, states: torch.Tensor, *, features: int | None = None,
          memory: bool = False) -> NodeSet:
    """Declare an observed node set ``name`` with states ``(*batch, n, features)``.

    ``features`` (optional) is the expected size of the last dimension; a
    mismatch is a ``ValueError`` naming the node set. ``memory=True`` marks stored patterns
    or prototypes (observed, but parameters rather than data): the drawings show them apart.
    """
    if direct_readers():  # a compiled module: no Pyro message needed
        ns = _make_node_set(name, states, features, True)
    else:
        ns = _nodes(name, states, features, True, name=name)
    ns.memory = bool(memory)
    return ns
