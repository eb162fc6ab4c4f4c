"""Block-slot attention (Singh et al. 2023; paper §4.3, Table 1): slots made of blocks, each
block bound to a prototype from a learned memory."""

from __future__ import annotations

import math

import torch
from torch import nn

import structattn as sa
from structattn._validation import check_size

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


class BlockSlotAttention(SlotAttention):
    """z_s ~ N(μ, σ²) (latent slots of M blocks); each input j picks a slot, φ_j ~ Uniform(slots)
    (softmax over slots); each block m of each slot picks a prototype, ω_sm ~ Uniform(memory),
    with ψ(C_mk, z_s) on block m — two edge families, ``"assign"`` and ``"bind"`` (heads = blocks).

    - ``recipe="original"`` (the block-slot recipe): slot attention's step with a block-wise
      GRU and MLP (``BlockGRUCell``, ``BlockLinear``), then each block reads the memory:
      z_sm ← Σ_k p(ω_sm = k | z) C_mk, ψ = ⟨z_sm, C_mk⟩/√d. ``num_prototypes=0`` drops the
      memory (one family); with one block it is then slot attention exactly.
    - ``recipe="collapsed"``: both families Gaussian, ψ = −‖z_s − k_j‖²/2τ and
      −‖z_sm − C_mk‖²/2τ_mem; the CCCP/EM update pulls each block towards the inputs the slot
      explains *and* the prototypes the block binds to (a posterior-weighted mean of both);
      the free energy never increases.

    inputs ``(B, N, dim)``, slots ``(B, S, dim)`` (optional) → slots ``(B, S, dim)``; the
    memory ``prototypes`` is ``(num_blocks, num_prototypes, dim / num_blocks)``.

    ::

        memory   C_m1 … C_mK        ω_sm ~ Uniform(memory), per block m
                    \\ | /
        slots        z_s  (blocks z_s1 … z_sM)
                    / | \\
        inputs   x_1 … x_N          φ_j ~ Uniform(slots)
    """

    def __init__(self, num_slots, dim, *, num_blocks, num_prototypes, iters=3, eps=1e-8,
                 hidden_dim=128, recipe="original", temperature=None, memory_temperature=None,
                 grad="unroll", device=None, dtype=None):
        owner = type(self).__name__
        dim = check_size(owner, "dim", dim)
        num_blocks = check_size(owner, "num_blocks", num_blocks)
        num_prototypes = check_size(owner, "num_prototypes", num_prototypes, 0)
        if dim % num_blocks:
            raise ValueError(f"BlockSlotAttention: dim={dim!r} must be divisible by "
                             f"num_blocks={num_blocks}")
        if recipe == "collapsed" and num_prototypes == 0:
            raise ValueError("BlockSlotAttention: recipe='collapsed' needs num_prototypes ≥ 1")
        super().__init__(num_slots, dim, iters=iters, eps=eps, hidden_dim=hidden_dim,
                         recipe=recipe, temperature=temperature, grad=grad, device=device,
                         dtype=dtype)
        kw = {"device": device, "dtype": dtype}
        M, d = num_blocks, dim // num_blocks
        self.num_blocks, self.block_size, self.num_prototypes = M, d, num_prototypes
        memory_temperature = math.sqrt(d) if memory_temperature is None else memory_temperature
        sa.potentials.bilinear.check_temperature(memory_temperature, "BlockSlotAttention")
        self.memory_temperature = memory_temperature
        self.prototypes = (nn.Parameter(torch.randn(M, num_prototypes, d, **kw))
                           if num_prototypes else None)
        if recipe == "original":
            del self.gru, self.mlp
            self.gru = BlockGRUCell(M, d, **kw)
            hidden = max(dim, hidden_dim) // M
            self.mlp = nn.Sequential(BlockLinear(M, d, hidden, **kw), nn.ReLU(inplace=True),
                                     BlockLinear(M, hidden, d, **kw))

    def memory(self, batch_shape) -> torch.Tensor:
        """The prototypes as memory nodes: ``(*batch, K, M·d)``, block m of node k = C_mk."""
        C = self.prototypes.transpose(0, 1).flatten(-2)  # (K, M·d)
        return C.expand(*batch_shape, *C.shape)

    def _bind(self, slots, batch_shape, gaussian):
        memory = sa.nodes("memory", self.memory(batch_shape), features=self.dim,
                          memory=True)
        omega = sa.edges("bind", slots, memory, sa.priors.Uniform(), heads=self.num_blocks)
        psi = (sa.potentials.SquaredDistance(temperature=self.memory_temperature,
                                             heads=self.num_blocks) if gaussian else
               sa.potentials.DotProduct(temperature=self.memory_temperature,
                                        heads=self.num_blocks))
        sa.potential(omega, psi)
        return memory

    def _original(self, x, init):
        inputs = sa.nodes("inputs", x, features=self.dim)
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


def block_slot_attention(num_slots, dim, *, num_blocks, num_prototypes, **kwargs):
    """Block-slot attention; see :class:`BlockSlotAttention`."""
    return BlockSlotAttention(num_slots, dim, num_blocks=num_blocks, num_prototypes=num_prototypes,
                              **kwargs)


def _case():
    m = block_slot_attention(3, 6, num_blocks=2, num_prototypes=4, iters=2, hidden_dim=8,
                             dtype=torch.float64)
    return m, (randn64(2, 7, 6), randn64(2, 3, 6))


#: the catalogue's statement (models/_catalogue.py)
ENTRY = Entry(block_slot_attention, BlockSlotAttention, case=_case,
              example=dict(num_slots=3, dim=8, num_blocks=2, num_prototypes=3, iters=3, hidden_dim=16),
              sizes=dict(num_slots=1, dim=1, num_blocks=1, num_prototypes=0, iters=0,
                         hidden_dim=1))
