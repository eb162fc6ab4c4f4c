"""The one ArviZ convention of every result of ``structattn.inference``, and the one place that
builds ArviZ objects (arviz 0.x: ``InferenceData``; 1.x: ``DataTree``, where ``from_dict``
takes one dict of groups).

Every result's ``.to_arviz()`` has a ``posterior`` group (a prior predictive: ``prior``) whose
variables carry ArviZ's leading ``(chain, draw)`` dims — the draws of a sampler, or one chain
of one draw for a point result (``exact``, ``map_estimate``) — then named dims:

- an edge family ``f`` (the parent each child chose): ``f_batch_0…``, ``f_head``, ``f_child``;
  from ``exact``: ``f`` the MAP edges, ``f_posterior`` p(φ_i = j | x) (… ``f_parent``) and
  ``f_value`` E[v_i] (… ``f_feature``);
- a latent node set ``z``: ``z_batch_0…``, ``z_node``, ``z_feature``;
- the program's output ``output``: ``output_dim_0…``.

``sample_stats`` holds per-draw diagnostics (``diverging``) and, for point results, the free
energy −log p(x, z) (``free_energy``).
"""

from __future__ import annotations


def _numpy(t):
    detach = getattr(t, "detach", None)  # a torch tensor: float64 (bool and long kept) on the CPU
    if detach is None:
        return t
    t = detach().cpu()
    return (t.double() if t.is_floating_point() else t).numpy()


def edge_dims(name: str, batch_dims: int) -> list[str]:
    """Named dims of an edge family's draws after (chain, draw): batch…, head, child."""
    return [f"{name}_batch_{k}" for k in range(batch_dims)] + [f"{name}_head", f"{name}_child"]


def latent_dims(name: str, batch_dims: int) -> list[str]:
    """Named dims of a latent node set's draws after (chain, draw): batch…, node, feature."""
    return [f"{name}_batch_{k}" for k in range(batch_dims)] + [f"{name}_node", f"{name}_feature"]


def output_dims(ndim: int) -> list[str]:
    """Named dims of the program's output after (chain, draw)."""
    return [f"output_dim_{k}" for k in range(ndim)]


def point(value):
    """A point result as one chain of one draw: ``(1, 1, *shape)``."""
    return _numpy(value)[None, None]


def inference_data(groups: dict, dims: dict | None = None):
    """``groups``: group name ("posterior", "prior", "sample_stats", "observed_data", …) →
    {variable: array with leading (chain, draw) dims, except observed_data}; ``dims``:
    variable → names of its dims after (chain, draw)."""
    import arviz as az

    groups = {g: {k: _numpy(v) for k, v in vs.items()} for g, vs in groups.items() if vs}
    dims = {k: v for k, v in (dims or {}).items()
            if any(k in vs for vs in groups.values())}
    major = int(az.__version__.split(".")[0])
    if major >= 1:  # arviz 1.x: from_dict({group: {var: array}}, dims=…) → DataTree
        return az.from_dict(groups, dims=dims)
    return az.from_dict(**groups, dims=dims)
