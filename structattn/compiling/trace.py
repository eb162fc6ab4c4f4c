"""What a compiled module reports of a call besides its output (``return_trace=True``): the
iterations it made, the windows it read and what they leave out."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils import _pytree as pytree


@dataclass
class Trace:
    """What a compiled module iterated, one field per inference scheme.

    Returned by a compiled module's call with ``return_trace=True`` (the last output). A
    field that does not apply to the model keeps its default (empty, None, 0).

    Attributes:
        states: latent node sets (``structattn.latent``): the states by latent name,
            ``(T + 1, *batch, n, d)`` each, the initial state first.
        free_energy: F at each recorded state, ``(T + 1, *batch)``; None without latents.
        posteriors: the edge posteriors at each recorded state by family name,
            ``(T + 1, *batch, H, C, P)`` each, when recorded (``trace_posteriors=True``);
            None otherwise.
        steps: T, the updates made. A model whose only iteration is mean-field windows has
            its families' largest round count.
        converged: whether the latents' tolerance was met (None without one). A model whose
            only iteration is mean-field windows has True when every window settled.
        mean_field: mean-field windows (``structattn.windows.MeanFieldWindows``): a
            ``MeanFieldHistory`` by family name (windows, Beta parameters, expected
            distances per child and round).
        truncation: certified truncation (a prior's ``tol``, e.g. ``BetaGeometric(tol=ε)``
            read exactly), by family name: a ``structattn.certificates.certified.CertifiedWindow`` (also
            ``structattn.windows.CertifiedWindow``), the window read and the certified bound
            on each token's posterior mass beyond it; or, with ``certificate="blocks"``, a
            ``structattn.block_sparse.BlockSparse``: the key blocks each block of tokens
            read, per head, and the bound on each token's posterior mass in the others.
        leftover: stick-breaking (``structattn.priors.StickBreaking``), by family name:
            p(no parent | x) per child ``(*batch, H, C)``, the stick left after the scan
            (its value is zero).
        lowering: how each family was read in the call, by family name: a
            ``structattn.kinds.lowered.Lowering`` (the reading — key-bias terms, distance
            table, SDPA, a kind's own, dense — and why a dense one was dense); also what
            ``layer.explain(*inputs)`` returns.
    """

    states: dict = field(default_factory=dict)
    free_energy: torch.Tensor | None = None
    posteriors: dict | None = None
    steps: int = 0
    converged: bool | None = None
    mean_field: dict = field(default_factory=dict)
    truncation: dict = field(default_factory=dict)
    leftover: dict = field(default_factory=dict)
    lowering: dict = field(default_factory=dict)


# a reading returns it beside tensors: a pytree node, so that a plan's graph outputs its
# tensors (``structattn.compiling.replay``)
pytree.register_dataclass(Trace)
