"""One place that builds ArviZ objects, for arviz 0.x (``InferenceData``, Python 3.11) and
1.x (``DataTree``, Python ≥ 3.12, where ``from_dict`` takes one dict of groups)."""

from __future__ import annotations

import torch


def _numpy(t):
    return t.detach().cpu().double().numpy() if isinstance(t, torch.Tensor) else t


def edge_dims(name: str, batch_dims: int) -> list[str]:
    """Named dims of an edge family's samples after (chain, draw): batch…, head, child."""
    return [f"{name}_batch_{k}" for k in range(batch_dims)] + [f"{name}_head", f"{name}_child"]


def latent_dims(name: str, batch_dims: int) -> list[str]:
    """Named dims of a latent node set's samples after (chain, draw): batch…, node, feature."""
    return [f"{name}_batch_{k}" for k in range(batch_dims)] + [f"{name}_node", f"{name}_feature"]


def inference_data(groups: dict, dims: dict | None = None):
    """``groups``: group name ("posterior", "sample_stats", "observed_data", "log_likelihood",
    "prior", …) → {variable: array with leading (chain, draw) dims, except observed_data}."""
    import arviz as az

    groups = {g: {k: _numpy(v) for k, v in vs.items()} for g, vs in groups.items() if vs}
    major = int(az.__version__.split(".")[0])
    if major >= 1:  # arviz 1.x: from_dict({group: {var: array}}, dims=…) → DataTree
        return az.from_dict(groups, dims=dims or {})
    return az.from_dict(**groups, dims=dims or {})
