"""The contrastive reading: p(x_i | η) of the empirical family as an InfoNCE loss."""

from __future__ import annotations

import math

import torch

from .empirical import Empirical


def info_nce(queries: torch.Tensor, keys: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """−(1/M) Σ_i log p(x = k_i | η = q_i/τ) under the empirical measure of the keys.

    The InfoNCE loss with the matching key as the positive (uniform weights), computed as
    G(η_i) − ⟨k_i, η_i⟩ − log M (the measure's log-normaliser): the usual cross-entropy of
    the logits q kᵀ/τ against the diagonal.

    Args:
        queries (torch.Tensor): q, ``(*batch, M, d)``.
        keys (torch.Tensor): k, the same shape; key i is query i's positive.
        temperature (float): τ > 0; default 1.0.

    Returns:
        torch.Tensor: the loss, a scalar (the mean over the batch and the M pairs).

    Raises:
        ValueError: queries and keys of different shapes, or a temperature that is not a
            number > 0 (and the ``Empirical`` measure's refusals of the keys).
    """
    if queries.shape != keys.shape:
        raise ValueError(f"info_nce: queries and keys must have the same shape (*batch, M, d); "
                         f"got {tuple(queries.shape)} and {tuple(keys.shape)}")
    if not (isinstance(temperature, (int, float)) and temperature > 0):
        raise ValueError(f"info_nce: temperature must be > 0; got {temperature!r}")
    eta = queries / temperature
    G = Empirical(keys).log_normaliser(eta)  # log (1/M) Σ_j e^{⟨k_j, η_i⟩}
    log_p = (keys * eta).sum(-1) - G - math.log(keys.shape[-2])
    return -log_p.mean()
