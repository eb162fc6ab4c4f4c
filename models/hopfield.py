"""Modern continuous Hopfield network (paper §4.2): latent states retrieve stored patterns."""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

import structattn as sa
from structattn.checking.renamed import refuses_renamed
from structattn.checks import check_size
from structattn.latent import IterationOptions

from ._catalogue import Entry, randn64


@refuses_renamed
class Hopfield(sa.Declaration):
    r"""$ξ_i ∼ \mathcal{N}(0, β⁻¹ I)$ (latent); $φ_i ∼ \mathrm{Uniform}(\text{stored patterns})$;
    $ψ(y_j, ξ_i) = β ξ_iᵀ W_K y_j$; $v = W_V y_j$ — per head. Collapsed free energy (per query and
    head, up to a constant): $β E(ξ)$ with $E(ξ) = −β⁻¹ \mathrm{lse}(β K ξ) + ½‖ξ‖²$, $K = W_K Y$
    (Ramsauer et al.'s energy).

    The CCCP update of ξ is ξ ← Kᵀ softmax(β K ξ), T = ``iteration.steps`` times from
    ξ₀ = W_Q r; the output is W_O concat_h(Vᵀ softmax(β K ξ_T)), V = W_V Y — the
    semantics of hopfield-layers' ``Hopfield(update_steps_max=T)`` without
    normalisation or biases. How the latent ξ is iterated is its ``IterationOptions``,
    taken whole (``iteration=sa.IterationOptions(steps=3, tol=1e-6)``).

    queries r: ``(*batch, M, d_query)``, keys Y: ``(*batch, N, d_key)`` →
    ``(*batch, M, d_out or heads·d_v)``. Parameters ``W_q (heads·d_k, d_query)``,
    ``W_k (heads·d_k, d_key)``, ``W_v (heads·d_v, d_key)``, ``W_o (d_out, heads·d_v)``.
    The output reads the memory once more at ξ_T, so with V = K (no projections) it is
    ξ_{T+1}, one retrieval beyond ``trace.states["state"][-1]`` = ξ_T.
    Cost per step O(M·N·heads·d_k) (one SDPA call); memory O((M + N)·d).

    ::

        stored  y_1 … y_N          φ_i ~ Uniform, ψ = β ξ_iᵀ W_K y_j
                   \ | /
        latent     ξ_i  ← Σ_j p(φ_i = j | ξ) W_K y_j   (T times)

    Args:
        d_query (int): the queries' width, r's last dimension; a positive int.
        d_key (int | None): the stored patterns' width, Y's last dimension, a positive int;
            None (default): ``d_query``.
        heads (int): the number of heads, a positive int. Default 1.
        d_k (int | None): each head's size of the state ξ and the keys, a positive int; None
            (default): d_query/heads, which must then be an int.
        d_v (int | None): each head's value size, a positive int; None (default): ``d_k``.
        d_out (int | None): the output's width, W_o's rows, a positive int; None (default):
            ``d_query``.
        beta (float | None): the inverse temperature β, a finite number > 0; None (default):
            1/τ when ``temperature`` is given, else 1/√d_k.
        temperature (float | None): τ = 1/β, a finite number > 0, as every attention model
            takes it (the posterior's, ψ/τ); give ``beta`` or ``temperature`` (both only if
            β·τ = 1).
        iteration (structattn.IterationOptions): how the latent state ξ is inferred, passed
            whole to ``structattn.latent``: ``steps`` (T, the number of updates of ξ, an
            int ≥ 0; 0: cross attention, one softmax), ``tol`` (stop once every state moves
            by at most tol, max abs, in one step; ``steps`` is then a budget), ``damping``,
            ``update`` (``"cccp"``: the update above; ``"gradient"`` or a callable: see
            ``structattn.IterationOptions``), ``step_size`` and ``grad`` (``"unroll"``:
            back-propagate through every update; ``"last"``: iterate without gradients,
            then one differentiable update). Default ``IterationOptions(steps=0)``: cross
            attention.
        out_proj (bool): True (default): W_o maps the merged heads to ``d_out``; False: no
            W_o, the output is ``(*batch, M, heads·d_v)``.
        projections (bool): True (default): W_q, W_k, W_v and W_o as above; False: none of
            the four (the classical network of §4.2: ξ₀ = r, K = V = Y), which needs
            d_key = d_query divisible by ``heads``; d_k = d_v = d_query/heads then, and
            ``d_k``, ``d_v``, ``d_out`` and ``out_proj`` go unused.
        name (str): the edge family's name. Default ``"retrieve"``.
        device (torch.device | str | None): where the parameters live; None: torch's default.
        dtype (torch.dtype | None): the parameters' dtype; None: torch's default.
    """

    def __init__(self, d_query, d_key=None, *, heads=1, d_k=None, d_v=None, d_out=None,
                 beta=None, temperature=None, iteration=IterationOptions(steps=0),
                 out_proj=True, projections=True, name="retrieve", device=None, dtype=None):
        super().__init__()
        d_query, heads = check_size("Hopfield", "d_query", d_query), check_size(
            "Hopfield", "heads", heads)
        d_key = d_query if d_key is None else check_size("Hopfield", "d_key", d_key)
        if d_out is not None:
            d_out = check_size("Hopfield", "d_out", d_out)
        if not projections:
            if d_key != d_query or d_query % heads:
                raise ValueError(f"Hopfield: projections=False needs d_key == d_query divisible "
                                 f"by heads; got d_query={d_query}, d_key={d_key}, heads={heads}")
            d_k = d_v = d_query // heads
        if d_k is None and d_query % heads:
            raise ValueError(f"Hopfield: d_query={d_query} is not divisible by heads={heads}; "
                             f"give d_k (the per-head size) explicitly")
        d_k = d_query // heads if d_k is None else d_k
        d_v = d_k if d_v is None else d_v
        d_k, d_v = check_size("Hopfield", "d_k", d_k), check_size("Hopfield", "d_v", d_v)
        if not isinstance(iteration, IterationOptions):
            raise ValueError(f"Hopfield: iteration must be a structattn.IterationOptions (e.g. "
                             f"IterationOptions(steps=3)); got {iteration!r}")
        beta = _inverse_temperature(beta, temperature, d_k)
        kw = {"device": device, "dtype": dtype}
        self.d_query, self.d_key, self.heads, self.d_k, self.d_v = d_query, d_key, heads, d_k, d_v
        self.beta, self.iteration = float(beta), iteration
        self.family_name = name
        self.projections = bool(projections)
        self.W_q = self.W_k = self.W_v = self.W_o = None
        if projections:
            self.W_q = nn.Parameter(torch.empty(heads * d_k, d_query, **kw))
            self.W_k = nn.Parameter(torch.empty(heads * d_k, d_key, **kw))
            self.W_v = nn.Parameter(torch.empty(heads * d_v, d_key, **kw))
            self.W_o = (nn.Parameter(torch.empty(d_out or d_query, heads * d_v, **kw))
                        if out_proj else None)
        for p in (self.W_q, self.W_k, self.W_v, self.W_o):
            if p is not None:
                nn.init.xavier_uniform_(p)

    @property
    def temperature(self) -> float:
        """τ = 1/β, the temperature of the tempered posterior (as every attention model's)."""
        return 1.0 / self.beta

    @property
    def update_steps(self) -> int:
        """T, the number of updates of ξ: ``iteration.steps``, read by this name."""
        return self.iteration.steps

    def model(self, queries, keys):
        self.check_inputs(queries=queries, keys=keys)
        stored = sa.nodes("stored", keys, features=self.d_key, memory=True)
        sa.nodes("queries", queries, features=self.d_query)  # the observed cue r
        init = queries if self.W_q is None else F.linear(queries, self.W_q)
        state = sa.latent("state", init, scale=self.beta ** -0.5,
                          **{f.name: getattr(self.iteration, f.name)
                             for f in dataclasses.fields(self.iteration)})
        phi = sa.edges(self.family_name, state, stored, sa.priors.Uniform(), heads=self.heads)
        if self.projections:
            psi = sa.potentials.Bilinear(None, self.W_k, heads=self.heads,
                                         temperature=1.0 / self.beta)
            value = sa.values.Linear(self.W_v, heads=self.heads)
        else:
            psi = sa.potentials.DotProduct(heads=self.heads, temperature=1.0 / self.beta)
            value = sa.values.Identity(heads=self.heads)
        sa.potential(phi, psi)
        y = sa.merge_heads(sa.value(phi, value))
        return y if self.W_o is None else F.linear(y, self.W_o)

    def energy(self, state: torch.Tensor, keys: torch.Tensor, *, per_query: bool = False
               ) -> torch.Tensor:
        """Ramsauer et al.'s energy E(ξ) = Σ_{i,h} [−(1/β)·lse_j(β k_jᵀξ_i) + ½‖ξ_i‖²] of states
        ``(*batch, M, heads·d_k)`` (e.g. ``trace.states["state"][t]``): ``(*batch,)``, or
        ``(*batch, M)`` per query with ``per_query=True``."""
        K = sa.split_heads(keys if self.W_k is None else F.linear(keys, self.W_k), self.heads)
        xi = sa.split_heads(state, self.heads)  # (*batch, H, M, d_k)
        lse = torch.logsumexp(self.beta * xi @ K.transpose(-1, -2), -1)
        e = (-lse / self.beta + 0.5 * (xi * xi).sum(-1)).sum(-2)  # heads: (*batch, M)
        return e if per_query else e.sum(-1)

    def example_inputs(self, n=5, batch=1):
        return (self._randn(batch, 3, self.d_query), self._randn(batch, n, self.d_key))


def _inverse_temperature(beta, temperature, d_k) -> float:
    """β from ``beta`` or ``temperature`` τ = 1/β (default β = 1/√d_k); both given must agree."""
    for what, v in (("beta", beta), ("temperature", temperature)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                              or not (math.isfinite(v) and v > 0)):
            raise ValueError(f"Hopfield: {what} must be a finite number > 0 (or None); got {v!r}")
    if beta is not None and temperature is not None and not math.isclose(
            beta * temperature, 1.0, rel_tol=1e-9):
        raise ValueError(f"Hopfield: beta and temperature are one setting, β = 1/τ; got beta={beta!r} "
                         f"and temperature={temperature!r} (1/τ = {1 / temperature:.6g}): give one "
                         f"of them")
    if beta is None:
        beta = 1.0 / (math.sqrt(d_k) if temperature is None else temperature)
    return float(beta)


def hopfield(d_query, d_key=None, **kwargs) -> Hopfield:
    """The modern Hopfield layer; see ``Hopfield``."""
    return Hopfield(d_query, d_key, **kwargs)


def _case():
    m = hopfield(7, 5, heads=2, d_k=3, d_v=2, beta=0.8, iteration=IterationOptions(steps=3),
                 dtype=torch.float64)
    return m, (randn64(2, 3, 7), randn64(2, 6, 5))


#: the catalogue's statement (structattn/models/_catalogue.py)
ENTRY = Entry(hopfield, Hopfield, case=_case,
              example=dict(d_query=8, heads=2, iteration=IterationOptions(steps=3)),
              sizes=dict(d_query=1, d_key=1, heads=1, d_k=1, d_v=1, d_out=1))
