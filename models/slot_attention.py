"""Slot attention (paper §4.3): each input picks a slot, so slots compete for inputs."""

from __future__ import annotations

import math

import torch
from torch import nn

import structattn as sa
from structattn.checks import check_size

from ._catalogue import Entry, randn64

RECIPES = ("original", "collapsed")


class SlotAttention(sa.Declaration):
    r"""$z_s ∼ \mathcal{N}(μ, σ²)$ (latent slots); each input $j$ picks a slot,
    $φ_j ∼ \mathrm{Uniform}(\text{slots})$, so the posterior is a softmax over *slots*; the slots are updated
    from it ``iters`` times.

    - ``recipe="original"`` (Locatello et al. 2020; a drop-in for the ``slot-attention``
      package's ``SlotAttention``, same parameter names): ψ(z_s, x_j) = to_k(x̂_j)ᵀ
      to_q(LN(z_s)) / √dim with x̂ = LN(x); updates_s = Σ_j w_js to_v(x̂_j) with
      w_js ∝ p(φ_j = s) + ε normalised over inputs; z ← GRU(updates, z); z ← z + MLP(LN(z)).
      The GRU + MLP is the engine's user-callable update rule.
    - ``recipe="collapsed"``: the pure collapsed-VI model. ψ(z_s, k_j) = −‖z_s − k_j‖²/(2τ)
      with k = to_k(LN(x)) (a Gaussian mixture over the keys with the slots as means, τ =
      √dim); the CCCP/EM update is the posterior-weighted mean
      z_s ← (μ/σ² + Σ_j p(φ_j = s) k_j/τ) / (1/σ² + Σ_j p(φ_j = s)/τ), and the free energy
      never increases (its MAP is ``structattn.inference.map_estimate``'s answer).

    inputs: ``(B, N, input_dim)`` (``input_dim``: default ``dim``; ``to_k``/``to_v`` map it to
    ``dim``); slots (optional initial slots): ``(B, S, dim)``, else
    μ + σ·ε with S = ``num_slots`` (per call) or the constructor's → slots ``(B, S, dim)``.

    Untrained, the collapsed recipe is plain EM and needs what EM needs: τ on the scale of
    the keys' spread (the default √dim suits trained keys; LayerNorm'd, freshly projected
    keys have a per-feature variance near 0.1, so pass e.g. ``temperature=0.03 ·
    keys.var(-2).mean()``) and initial slots near the data (e.g. S keys drawn at random);
    ``gallery/plot_slots.py`` shows each failure mode. The input LayerNorm removes each
    input's mean and scale: give positions a constant channel.
    Cost per iteration O(B·N·S·dim) + the GRU/MLP on B·S slots.

    ::

        slots   z_1  z_2 … z_S      φ_j ~ Uniform(slots): softmax over slots
                  \   |   /
        inputs       x_j

    Args:
        num_slots (int): S, the slots drawn when a call gives neither ``slots`` nor
            ``num_slots``, a positive int.
        dim (int): each slot's size, a positive int.
        iters (int): slot updates, an int ≥ 0. Default 3.
        eps (float): ε added to each assignment weight before the weights are normalised over
            inputs (the original recipe's updates), a finite number ≥ 0. Default 1e-8.
        hidden_dim (int): the width of the original recipe's MLP, a positive int (the MLP
            uses max(dim, hidden_dim)). Default 128.
        recipe (str): ``"original"`` (default) or ``"collapsed"``, as above.
        temperature (float | torch.Tensor | None): τ of the potential (the dot product's
            divisor in the original recipe, of −‖z_s − k_j‖²/(2τ) in the collapsed one), a
            finite number > 0; None (default): √dim.
        grad (str): ``"unroll"`` (default: back-propagate through every update) or
            ``"last"`` (iterate without gradients, then one differentiable update).
        input_dim (int | None): the inputs' features, a positive int; None (default): dim.
        device (torch.device | str | None): where the parameters are made; None: PyTorch's
            default.
        dtype (torch.dtype | None): the parameters' dtype; None: PyTorch's default.
    """

    def __init__(self, num_slots, dim, *, iters=3, eps=1e-8, hidden_dim=128, recipe="original",
                 temperature=None, grad="unroll", input_dim=None, device=None, dtype=None):
        super().__init__()
        owner = type(self).__name__
        num_slots, dim, hidden_dim = (check_size(owner, n, v) for n, v in (
            ("num_slots", num_slots), ("dim", dim), ("hidden_dim", hidden_dim)))
        input_dim = dim if input_dim is None else check_size(owner, "input_dim", input_dim)
        iters = check_size(owner, "iters", iters, 0)
        if recipe not in RECIPES:
            raise ValueError(f"{owner}: recipe must be one of {RECIPES}; got {recipe!r}")
        if not (isinstance(eps, (int, float)) and eps >= 0 and math.isfinite(eps)):
            raise ValueError(f"{owner}: eps must be a finite number ≥ 0; got {eps!r}")
        sa.IterationOptions(steps=iters, grad=grad)  # check them now
        temperature = math.sqrt(dim) if temperature is None else temperature
        sa.potentials.bilinear.check_temperature(temperature, owner)
        kw = {"device": device, "dtype": dtype}
        self.num_slots, self.dim, self.iters, self.eps = num_slots, dim, iters, eps
        self.input_dim = input_dim
        self.recipe, self.temperature, self.grad = recipe, temperature, grad
        self.scale = dim ** -0.5
        self.slots_mu = nn.Parameter(torch.randn(1, 1, dim, **kw))
        self.slots_logsigma = nn.Parameter(torch.zeros(1, 1, dim, **kw))
        nn.init.xavier_uniform_(self.slots_logsigma)
        self.norm_input = nn.LayerNorm(input_dim, **kw)
        self.to_k = nn.Linear(input_dim, dim, **kw)
        if recipe == "original":
            self.to_q = nn.Linear(dim, dim, **kw)
            self.to_v = nn.Linear(input_dim, dim, **kw)
            self.gru = nn.GRUCell(dim, dim, **kw)
            hidden_dim = max(dim, hidden_dim)
            self.mlp = nn.Sequential(nn.Linear(dim, hidden_dim, **kw), nn.ReLU(inplace=True),
                                     nn.Linear(hidden_dim, dim, **kw))
            self.norm_slots = nn.LayerNorm(dim, **kw)
            self.norm_pre_ff = nn.LayerNorm(dim, **kw)

    # -- the declaration ---------------------------------------------------------------
    def model(self, inputs, slots=None, num_slots=None):
        self.check_inputs(inputs=inputs, slots=slots)
        self.check_finite_inputs(inputs=inputs, slots=slots)
        init = self.initial_slots(inputs, slots, num_slots)
        x = self.norm_input(inputs)
        if self.recipe == "collapsed":
            return self._collapsed(x, init)
        return self._original(x, init)

    def _original(self, x, init):
        inputs = sa.nodes("inputs", x, features=self.input_dim)
        v = self.to_v(x)  # (B, N, dim)

        def gru_mlp(z, step):  # the original recipe's update, from the posterior over slots
            updates = self.slot_updates(step, v)
            d = z.shape[-1]
            z = self.gru(updates.reshape(-1, d), z.reshape(-1, d)).reshape(z.shape)
            return z + self.mlp(self.norm_pre_ff(z))

        slots = self._slots(init, gru_mlp)
        self._assign_by_dot_product(inputs, slots)
        return sa.infer(slots)

    def _collapsed(self, x, init):
        keys = sa.nodes("inputs", self.to_k(x), features=self.dim)
        slots = self._slots(init, "cccp")
        phi = sa.edges("assign", keys, slots, sa.priors.Uniform())
        sa.potential(phi, sa.potentials.SquaredDistance(temperature=self.temperature))
        self._more_families(slots, x)
        return sa.infer(slots)

    # -- pieces shared with block-slot attention ------------------------------------------
    def _slots(self, init, update):
        """The latent slots, z ~ N(μ, σ²), iterated ``iters`` times by ``update``."""
        return sa.latent("slots", init, loc=self.slots_mu, scale=self.slots_logsigma.exp(),
                         steps=self.iters, update=update, grad=self.grad)

    def _assign_by_dot_product(self, inputs, slots):
        """Each input picks a slot: ψ = to_k(x̂_j)ᵀ to_q(LN(z_s)) / √dim."""
        phi = sa.edges("assign", inputs, slots, sa.priors.Uniform())
        sa.potential(phi, sa.potentials.Mapped(
            sa.potentials.DotProduct(temperature=self.temperature), children=self.to_k,
            parents=lambda z: self.to_q(self.norm_slots(z))))
        return phi

    def _more_families(self, slots, x):
        """Further edge families on the slots (block-slot attention's memory)."""

    def slot_updates(self, step, v):
        """Σ_j w_js v_j with w_js ∝ p(φ_j = s | x, z) + ε normalised over inputs: ``(B, S, dim)``."""
        w = step.posterior("assign").squeeze(-3) + self.eps  # (B, N, S)
        w = w / w.sum(-2, keepdim=True)
        return w.transpose(-1, -2) @ v

    def initial_slots(self, inputs, slots=None, num_slots=None):
        """The given slots (checked), or μ + σ·ε for ``num_slots`` (default: the constructor's)."""
        if not isinstance(inputs, torch.Tensor) or inputs.dim() != 3 \
                or inputs.shape[-1] != self.input_dim:
            got = tuple(inputs.shape) if isinstance(inputs, torch.Tensor) else type(inputs).__name__
            raise ValueError(f"{type(self).__name__}: inputs must have shape (batch, n, "
                             f"{self.input_dim}); "
                             f"got {got}")
        if num_slots is not None:
            num_slots = check_size(type(self).__name__, "num_slots", num_slots)
        b = inputs.shape[0]
        if slots is not None:
            if not isinstance(slots, torch.Tensor):
                raise ValueError(f"{type(self).__name__}: slots must be a tensor (batch, num_slots, dim); "
                                 f"got {type(slots).__name__}")
            want = (b, num_slots or slots.shape[-2] if slots.dim() == 3 else -1, self.dim)
            if tuple(slots.shape) != want:
                n_s = "num_slots" if num_slots is None else f"num_slots={num_slots}"
                raise ValueError(f"{type(self).__name__}: slots must have shape (batch={b}, {n_s}, "
                                 f"dim={self.dim}); got {tuple(slots.shape)}")
            return slots
        n_s = num_slots or self.num_slots
        mu = self.slots_mu.expand(b, n_s, -1)
        sigma = self.slots_logsigma.exp().expand(b, n_s, -1)
        return mu + sigma * torch.randn(mu.shape, device=inputs.device, dtype=inputs.dtype)

    def example_inputs(self, n=6, batch=1):
        return (self._randn(batch, n, self.input_dim),
                self._randn(batch, self.num_slots, self.dim))


def slot_attention(num_slots, dim, **kwargs) -> SlotAttention:
    """Slot attention; see ``SlotAttention``."""
    return SlotAttention(num_slots, dim, **kwargs)


def _case():
    m = slot_attention(3, 5, iters=2, hidden_dim=8, dtype=torch.float64)
    return m, (randn64(2, 7, 5), randn64(2, 3, 5))


#: the catalogue's statement (structattn/models/_catalogue.py)
ENTRY = Entry(slot_attention, SlotAttention, case=_case,
              example=dict(num_slots=3, dim=8, iters=3, hidden_dim=16),
              sizes=dict(num_slots=1, dim=1, iters=0, hidden_dim=1, input_dim=1))
