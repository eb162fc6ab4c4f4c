"""What a compiled module reports of a call besides its output (``return_trace=True``): the
iterations it made, the windows it read and what they leave out."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Trace:
    """What a compiled module iterated, one field per inference scheme.

    Latent node sets (``structattn.latent``): ``states[name]``: ``(T + 1, *batch, n, d)``
    (initial state first); ``free_energy``: ``(T + 1, *batch)``, F at each recorded state;
    ``posteriors[family]``: ``(T + 1, *batch, H, C, P)`` when recorded; ``steps``: T, the
    updates made; ``converged``: whether the tolerance was met (None without one).

    Mean-field windows (``structattn.windows.MeanFieldWindows``): ``mean_field[family]``, a
    ``MeanFieldHistory`` (windows, Beta parameters, expected distances per child and
    round). A model whose only iteration is mean-field windows has ``steps`` = its families'
    largest round count and ``converged`` = every window settled.

    Certified truncation (a prior's ``tol``, e.g. ``BetaGeometric(tol=ε)`` read exactly):
    ``truncation[family]``, a ``structattn.certified.CertifiedWindow`` (also
    ``structattn.windows.CertifiedWindow``) — the window read and the certified bound on each
    token's posterior mass beyond it — or, with ``certificate="blocks"``, a
    ``structattn.block_sparse.BlockSparse``: the key blocks each block of tokens read, per
    head, and the bound on each token's posterior mass in the others.

    Stick-breaking (``structattn.priors.StickBreaking``): ``leftover[family]``, p(no parent |
    x) per child ``(*batch, H, C)``, the stick left after the scan (its value is zero).
    """

    states: dict = field(default_factory=dict)
    free_energy: torch.Tensor | None = None
    posteriors: dict | None = None
    steps: int = 0
    converged: bool | None = None
    mean_field: dict = field(default_factory=dict)
    truncation: dict = field(default_factory=dict)
    leftover: dict = field(default_factory=dict)
