"""Block-slot attention (Singh et al. 2023; paper §4.3, Table 1): slots made of blocks, each
block bound to a prototype from a learned memory."""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

import structattn as sa
from structattn.checks import check_size

from ._catalogue import Entry, randn64
from .slot_attention import SlotAttention


class BlockGRUCell(nn.Module):
    """``num_blocks`` independent GRU cells, one per block of ``block_size`` features:
    weights ``(num_blocks, 3·block_size, block_size)``. One block is ``nn.GRUCell``."""

    def __init__(self, num_blocks, block_size, device=None, dtype=None):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        M, d = num_blocks, block_size
        self.num_blocks, self.block_size = M, d
        bound = 1 / math.sqrt(d)
        self.weight_ih = nn.Parameter(torch.empty(M, 3 * d, d, **kw).uniform_(-bound, bound))
        self.weight_hh = nn.Parameter(torch.empty(M, 3 * d, d, **kw).uniform_(-bound, bound))
        self.bias_ih = nn.Parameter(torch.empty(M, 3 * d, **kw).uniform_(-bound, bound))
        self.bias_hh = nn.Parameter(torch.empty(M, 3 * d, **kw).uniform_(-bound, bound))

    def forward(self, x, h):  # (…, M·d) each
        M, d = self.num_blocks, self.block_size
        xb, hb = x.unflatten(-1, (M, d)), h.unflatten(-1, (M, d))
        gi = torch.einsum("...mi,moi->...mo", xb, self.weight_ih) + self.bias_ih
        gh = torch.einsum("...mi,moi->...mo", hb, self.weight_hh) + self.bias_hh
        r = torch.sigmoid(gi[..., :d] + gh[..., :d])
        z = torch.sigmoid(gi[..., d:2 * d] + gh[..., d:2 * d])
        n = torch.tanh(gi[..., 2 * d:] + r * gh[..., 2 * d:])
        return ((1 - z) * n + z * hb).flatten(-2)


class BlockLinear(nn.Module):
    """A linear map per block: ``(…, M·d_in) → (…, M·d_out)``."""

    def __init__(self, num_blocks, d_in, d_out, device=None, dtype=None):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.num_blocks = num_blocks
        bound = 1 / math.sqrt(d_in)
        self.weight = nn.Parameter(torch.empty(num_blocks, d_out, d_in, **kw).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.empty(num_blocks, d_out, **kw).uniform_(-bound, bound))

    def forward(self, x):
        xb = x.unflatten(-1, (self.num_blocks, -1))
        return (torch.einsum("...mi,moi->...mo", xb, self.weight) + self.bias).flatten(-2)


class BlockLayerNorm(nn.Module):
    """LayerNorm of each block on its own, without affine parameters: ``(…, M·d) → (…, M·d)``,
    block m of x standardised as (x_m − mean(x_m)) / √(var(x_m) + eps) (SysBinder's
    ``BlockLayerNorm``)."""

    def __init__(self, num_blocks, eps=1e-5):
        super().__init__()
        self.num_blocks, self.eps = num_blocks, eps

    def forward(self, x):
        xb = x.unflatten(-1, (self.num_blocks, -1))
        return F.layer_norm(xb, xb.shape[-1:], eps=self.eps).flatten(-2)


RECIPES = ("original", "blockwise", "collapsed")


class BlockSlotAttention(SlotAttention):
    r"""$z_s ∼ \mathcal{N}(μ, σ²)$ (latent slots of $M$ blocks); each input $j$ picks a slot,
    $φ_j ∼ \mathrm{Uniform}(\text{slots})$ (softmax over slots); each block $m$ of each slot picks a
    prototype, $ω_{sm} ∼ \mathrm{Uniform}(\text{memory})$, with $ψ(C_{mk}, z_s)$ on block $m$ — two edge
    families, ``"assign"`` and ``"bind"`` (heads = blocks).

    - ``recipe="original"``: SysBinder (Singh et al. 2023, ``sysbinder.py``), step for step.
      Slot attention's step (ψ = to_k(x̂_j)ᵀ to_q(LN(z_s)) / √dim, the ε-renormalised
      posterior-weighted mean of to_v(x̂)), a block-wise GRU (``BlockGRUCell``), then
      z ← z + MLP(BlockLN(z)) with a block-wise MLP (``BlockLinear``) after a per-block
      LayerNorm without affine parameters (``BlockLayerNorm``), then each block reads the
      memory with its block-normalised state as the query:
      z_sm ← Σ_k p(ω_sm = k | z) C_mk, ψ(C_mk, z_s) = ⟨BlockLN(z_s)_m, C_mk⟩/√d. The memory is
      SysBinder's: learned prototypes P_mk (``prototypes``) through a 4-layer MLP shared by
      the blocks (``memory_mlp``: d → 4d → 4d → 4d → d) and block-normalised,
      C_mk = LN(MLP(P_mk)). SysBinder's weights load with ``load_sysbinder_state_dict``.
    - ``recipe="blockwise"``: slot attention's original step made block-wise, reading raw
      prototypes: the same GRU and MLP per block, but one LayerNorm over the whole slot (with
      affine) before the MLP, and the raw slot blocks query the raw prototypes,
      ψ = ⟨z_sm, P_mk⟩/√d, C = P. With one block and ``num_prototypes=0`` it is slot attention
      exactly (``load_state_dict`` of a slot attention's weights, GRU and MLP unsqueezed).
    - ``recipe="collapsed"``: both families Gaussian, ψ = −‖z_s − k_j‖²/2τ and
      −‖z_sm − P_mk‖²/2τ_mem; the CCCP/EM update pulls each block towards the inputs the slot
      explains *and* the prototypes the block binds to (a posterior-weighted mean of both);
      the free energy never increases.

    ``num_prototypes=0`` drops the memory (one family, no read). The attention returned
    (``return_posterior=True``) is p(φ | x, z_T), at the final slots; SysBinder returns the
    last iteration's attention computed before that iteration's update, p(φ | x, z_{T−1}):
    ``trace.posteriors["assign"][-2]`` with ``return_trace=True, trace_posteriors=True``.

    inputs ``(B, N, input_dim)`` (default ``dim``; SysBinder's ``input_size``), slots
    ``(B, S, dim)`` (optional; SysBinder's ``slot_size``) → slots ``(B, S, dim)``; the
    prototypes are ``(num_blocks, num_prototypes, dim / num_blocks)``; each block's MLP is
    ``hidden_dim // num_blocks`` wide in the original recipe (SysBinder's
    ``mlp_hidden_size // num_blocks``), ``max(dim, hidden_dim) // num_blocks`` in the blockwise
    one.

    ::

        memory   C_m1 … C_mK        ω_sm ~ Uniform(memory), per block m
                    \ | /
        slots        z_s  (blocks z_s1 … z_sM)
                    / | \
        inputs   x_1 … x_N          φ_j ~ Uniform(slots)

    Args:
        num_slots (int): the number of slots S, a positive int, when a call gives neither
            slots nor its own ``num_slots``.
        dim (int): the slots' size, a positive int divisible by ``num_blocks`` (SysBinder's
            ``slot_size``).
        num_blocks (int): the blocks M of each slot, a positive int, each of
            ``dim / num_blocks`` features: the heads of the ``"bind"`` family.
        num_prototypes (int): the prototypes K of each block's memory, an int ≥ 0; 0 drops
            the memory (the ``"collapsed"`` recipe needs ≥ 1).
        iters (int): the slot updates, an int ≥ 0. Default 3.
        eps (float): ε added to the posterior over slots before its renormalisation over
            the inputs (the original and blockwise recipes), a finite number ≥ 0.
            Default 1e-8.
        hidden_dim (int): the MLP's width, a positive int (SysBinder's ``mlp_hidden_size``):
            each block's MLP is ``hidden_dim // num_blocks`` wide in the original recipe
            (so hidden_dim ≥ num_blocks there), ``max(dim, hidden_dim) // num_blocks`` in the
            blockwise one; the collapsed recipe has no MLP. Default 128.
        recipe (str): ``"original"`` (default), ``"blockwise"`` or ``"collapsed"``, as
            above.
        temperature (float | torch.Tensor | None): τ of the ``"assign"`` family, a finite
            number > 0 or a tensor; None, the default, takes √dim.
        memory_temperature (float | torch.Tensor | None): τ_mem of the ``"bind"`` family, a
            finite number > 0 or a tensor; None, the default, takes √(dim / num_blocks).
        grad (str): ``"unroll"`` (default: back-propagate through every update) or
            ``"last"`` (iterate without gradients, then one differentiable step from the
            detached slots).
        input_dim (int | None): the inputs' feature size, a positive int (SysBinder's
            ``input_size``); None, the default, takes dim.
        device (torch.device | str | None): the device of the parameters.
        dtype (torch.dtype | None): the dtype of the parameters.
    """

    def __init__(self, num_slots, dim, *, num_blocks, num_prototypes, iters=3, eps=1e-8,
                 hidden_dim=128, recipe="original", temperature=None, memory_temperature=None,
                 grad="unroll", input_dim=None, device=None, dtype=None):
        if recipe not in RECIPES:
            raise ValueError(f"BlockSlotAttention: recipe must be one of {RECIPES}; got "
                             f"{recipe!r}")
        owner = type(self).__name__
        dim = check_size(owner, "dim", dim)
        num_blocks = check_size(owner, "num_blocks", num_blocks)
        num_prototypes = check_size(owner, "num_prototypes", num_prototypes, 0)
        if dim % num_blocks:
            raise ValueError(f"BlockSlotAttention: dim={dim!r} must be divisible by "
                             f"num_blocks={num_blocks}")
        if recipe == "collapsed" and num_prototypes == 0:
            raise ValueError("BlockSlotAttention: recipe='collapsed' needs num_prototypes ≥ 1")
        hidden_dim = check_size(owner, "hidden_dim", hidden_dim)
        if recipe == "original" and hidden_dim < num_blocks:
            raise ValueError(f"BlockSlotAttention: hidden_dim={hidden_dim} must be ≥ "
                             f"num_blocks={num_blocks} (each block's MLP is hidden_dim // "
                             f"num_blocks wide, as SysBinder's mlp_hidden_size // num_blocks)")
        super().__init__(num_slots, dim, iters=iters, eps=eps, hidden_dim=hidden_dim,
                         recipe="collapsed" if recipe == "collapsed" else "original",
                         temperature=temperature, grad=grad, input_dim=input_dim, device=device,
                         dtype=dtype)
        self.recipe = recipe
        kw = {"device": device, "dtype": dtype}
        M, d = num_blocks, dim // num_blocks
        self.num_blocks, self.block_size, self.num_prototypes = M, d, num_prototypes
        memory_temperature = math.sqrt(d) if memory_temperature is None else memory_temperature
        sa.potentials.bilinear.check_temperature(memory_temperature, "BlockSlotAttention")
        self.memory_temperature = memory_temperature
        self.prototypes = (nn.Parameter(torch.randn(M, num_prototypes, d, **kw))
                           if num_prototypes else None)
        if recipe == "collapsed":
            return
        del self.gru, self.mlp
        self.gru = BlockGRUCell(M, d, **kw)
        # each block's MLP width: SysBinder's mlp_hidden_size // num_blocks (original); slot
        # attention's max(dim, hidden_dim), split over the blocks (blockwise)
        hidden = (hidden_dim if recipe == "original" else max(dim, hidden_dim)) // M
        self.mlp = nn.Sequential(BlockLinear(M, d, hidden, **kw), nn.ReLU(inplace=True),
                                 BlockLinear(M, hidden, d, **kw))
        if recipe == "original":
            del self.norm_pre_ff
            self.norm_pre_ff = BlockLayerNorm(M)
            self.norm_query = BlockLayerNorm(M)  # the slots' blocks, before they query
            if num_prototypes:
                with torch.no_grad():  # SysBinder's initialisation of its memory
                    nn.init.trunc_normal_(self.prototypes)
                layers = [nn.Linear(a, b, **kw) for a, b in ((d, 4 * d), (4 * d, 4 * d),
                                                               (4 * d, 4 * d), (4 * d, d))]
                for lin in layers:
                    nn.init.xavier_uniform_(lin.weight)
                    nn.init.zeros_(lin.bias)
                self.memory_mlp = nn.Sequential(layers[0], nn.ReLU(), layers[1], nn.ReLU(),
                                                layers[2], nn.ReLU(), layers[3])

    def memory(self, batch_shape) -> torch.Tensor:
        """The memory nodes C: ``(*batch, K, M·d)``, block m of node k = C_mk — the raw
        prototypes P_mk, or (original recipe) LN(MLP(P_mk))."""
        C = self.prototypes  # (M, K, d)
        if self.recipe == "original":
            C = F.layer_norm(self.memory_mlp(C), C.shape[-1:])
        C = C.transpose(0, 1).flatten(-2)  # (K, M·d)
        return C.expand(*batch_shape, *C.shape)

    def _bind(self, slots, batch_shape, gaussian):
        memory = sa.nodes("memory", self.memory(batch_shape), features=self.dim,
                          memory=True)
        omega = sa.edges("bind", slots, memory, sa.priors.Uniform(), heads=self.num_blocks)
        if gaussian:
            psi = sa.potentials.SquaredDistance(temperature=self.memory_temperature,
                                                heads=self.num_blocks)
        else:
            psi = sa.potentials.DotProduct(temperature=self.memory_temperature,
                                           heads=self.num_blocks)
            if self.recipe == "original":  # SysBinder queries with block-normalised slots
                psi = sa.potentials.Mapped(psi, children=self.norm_query)
        sa.potential(omega, psi)
        return memory

    def _original(self, x, init):
        inputs = sa.nodes("inputs", x, features=self.input_dim)
        v = self.to_v(x)  # (B, N, dim)
        has_memory = self.prototypes is not None

        def update(z, step):  # slot step, block-wise GRU + MLP, then a read from the memory
            z = self.gru(self.slot_updates(step, v), z)
            z = z + self.mlp(self.norm_pre_ff(z))
            if not has_memory:
                return z
            mem = sa.split_heads(memory.states, self.num_blocks)  # (B, M, K, d)
            return sa.merge_heads(step.move_to(z).attend("bind", mem))  # Σ_k p(ω_sm = k) C_mk

        slots = self._slots(init, update)
        self._assign_by_dot_product(inputs, slots)
        if has_memory:
            memory = self._bind(slots, x.shape[:-2], gaussian=False)
        return sa.infer(slots)

    def _more_families(self, slots, x):  # the collapsed recipe: both families Gaussian
        self._bind(slots, x.shape[:-2], gaussian=True)

    def load_sysbinder_state_dict(self, state: dict) -> None:
        """Load the weights of SysBinder's ``SysBinder`` module (``sysbinder.py``; its
        ``state_dict()``) into this original-recipe model of the same sizes. SysBinder's
        projections have no bias (ours are set to zero); its block GRU is a masked
        ``GRUCell`` (``gru.gru.*``), its block linears hold ``w (M, d_in, d_out)``, ``b (1,
        M·d_out)``, its memory ``prototype_memory.mem_params (1, K, M, d)`` and
        ``prototype_memory.mem_proj.{0,2,4,6}``."""
        if self.recipe != "original" or self.prototypes is None:
            raise ValueError(f"BlockSlotAttention.load_sysbinder_state_dict: needs "
                             f"recipe='original' with num_prototypes ≥ 1; this model has "
                             f"recipe={self.recipe!r}, num_prototypes={self.num_prototypes}")
        M, d = self.num_blocks, self.block_size
        s = state

        def blocks_of(w):  # a block-diagonal (3·M·d, M·d) GRU matrix → (M, 3d, d)
            w = w.reshape(3, M, d, M * d)
            return torch.stack([w[:, m, :, m * d:(m + 1) * d].reshape(3 * d, d)
                                for m in range(M)])

        new = {
            "slots_mu": s["slot_mu"], "slots_logsigma": s["slot_log_sigma"],
            "norm_input.weight": s["norm_inputs.weight"], "norm_input.bias": s["norm_inputs.bias"],
            "norm_slots.weight": s["norm_slots.weight"], "norm_slots.bias": s["norm_slots.bias"],
            "to_q.weight": s["project_q.weight"], "to_k.weight": s["project_k.weight"],
            "to_v.weight": s["project_v.weight"],
            "to_q.bias": torch.zeros_like(self.to_q.bias),
            "to_k.bias": torch.zeros_like(self.to_k.bias),
            "to_v.bias": torch.zeros_like(self.to_v.bias),
            "gru.weight_ih": blocks_of(s["gru.gru.weight_ih"]),
            "gru.weight_hh": blocks_of(s["gru.gru.weight_hh"]),
            "gru.bias_ih": s["gru.gru.bias_ih"].reshape(3, M, d).transpose(0, 1).reshape(M, 3 * d),
            "gru.bias_hh": s["gru.gru.bias_hh"].reshape(3, M, d).transpose(0, 1).reshape(M, 3 * d),
            "prototypes": s["prototype_memory.mem_params"][0].transpose(0, 1),
        }
        for i in (0, 2):
            new[f"mlp.{i}.weight"] = s[f"mlp.{i}.w"].transpose(-1, -2)
            new[f"mlp.{i}.bias"] = s[f"mlp.{i}.b"].reshape(M, -1)
        for i in (0, 2, 4, 6):
            for p in ("weight", "bias"):
                new[f"memory_mlp.{i}.{p}"] = s[f"prototype_memory.mem_proj.{i}.{p}"]
        mine = self.state_dict()
        for k, v in new.items():
            if tuple(v.shape) != tuple(mine[k].shape):
                raise ValueError(f"BlockSlotAttention.load_sysbinder_state_dict: {k} needs "
                                 f"shape {tuple(mine[k].shape)}; SysBinder's gives "
                                 f"{tuple(v.shape)} (the sizes must be SysBinder's: dim = its "
                                 f"slot_size, input_dim = its input_size, num_blocks, "
                                 f"num_prototypes = its num_prototypes, hidden_dim = its "
                                 f"mlp_hidden_size)")
        self.load_state_dict(new)


def block_slot_attention(num_slots, dim, *, num_blocks, num_prototypes, **kwargs):
    """Block-slot attention; see ``BlockSlotAttention``."""
    return BlockSlotAttention(num_slots, dim, num_blocks=num_blocks, num_prototypes=num_prototypes,
                              **kwargs)


def _case(recipe="original"):
    m = block_slot_attention(3, 6, num_blocks=2, num_prototypes=4, iters=2, hidden_dim=8,
                             recipe=recipe, dtype=torch.float64)
    return m, (randn64(2, 7, 6), randn64(2, 3, 6))


#: the catalogue's statement (structattn/models/_catalogue.py)
ENTRY = Entry(block_slot_attention, BlockSlotAttention, case=_case,
              example=dict(num_slots=3, dim=8, num_blocks=2, num_prototypes=3, iters=3, hidden_dim=16),
              sizes=dict(num_slots=1, dim=1, num_blocks=1, num_prototypes=0, iters=0,
                         hidden_dim=1, input_dim=1),
              variants={"blockwise": functools.partial(_case, recipe="blockwise")})
