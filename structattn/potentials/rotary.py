"""Rotary positions (RoPE): ψ(x_j, x_i) = (R_i W_Q x_i)ᵀ (R_j W_K x_j) / τ, one per head."""

from __future__ import annotations

import math

import torch

from ..checking._validation import check_size
from ..heads import gather_parents, merge_heads
from .bilinear import Bilinear
from .temperature import per_head, weighted


class Rotary(Bilinear):
    """``ψ_h(x_j, x_i) = (R_i W_Q^h x_i)ᵀ (R_j W_K^h x_j) / τ`` (Su et al., RoFormer): the
    bilinear potential with each head's query and key rotated by their positions.

    R_p rotates the pairs of dimensions (k, k + m), k < m = ``dims``/2, of a head by the angle
    p·θ_k, θ_k = ``base``^(−2k/``dims``) — the "rotate half" layout of GPT-NeoX and LLaMA's
    common implementations; dimensions from ``dims`` on (``dims`` < d_k: partial rotary) are
    not rotated. Since R_iᵀR_j = R_{j−i}, ψ depends on the positions only through j − i.

    Lowered as the bilinear potential on rotated factors: the fused kernels (SDPA, the key-
    bias, stick-breaking and window kernels) read R_i a_i and R_j b_j, so rotary positions
    work with any prior. The Pyro reading (``at``) computes ψ from its definition in complex
    form, Re Σ_k (q_k conj(k_k)) e^{i(i−j)θ_k} over the pairs q_k = a_k + i·a_{k+m} (and the
    unrotated rest), never from the factors.

    Args:
        W_q (torch.Tensor | None): the query projection ``(heads*d_k, d_child)``, or None for
            the identity (``Bilinear``).
        W_k (torch.Tensor | None): the key projection ``(heads*d_k, d_parent)``, or None for
            the identity (not both None).
        heads (int): the number of heads, a positive int dividing the rows. Default 1.
        temperature (float | torch.Tensor | None): τ > 0, a float, a scalar tensor or one per
            head ``(heads,)`` (``Bilinear``). None (default): √d_k.
        base (float): the frequencies' base, θ_k = base^(−2k/dims), a finite number > 1.
            Default 10000.
        dims (int | None): the rotated dimensions of each head, an even positive int ≤ d_k
            (less: partial rotary). None (default): d_k.
        child_positions (torch.Tensor | None): the children's positions, a tensor ``(C,)``
            (checked when the family is declared), e.g. a decoding step's last tokens. None
            (default): 0..C−1.
        parent_positions (torch.Tensor | None): the parents' positions ``(P,)``, as
            ``child_positions``. None (default): 0..P−1.

    Raises:
        ValueError: an argument ``Bilinear`` refuses, ``base`` not a finite number > 1, or
            ``dims`` not a positive int, odd or > d_k.
    """

    def __init__(self, W_q: torch.Tensor | None, W_k: torch.Tensor | None, *, heads: int = 1,
                 temperature: float | torch.Tensor | None = None, base: float = 10000.0,
                 dims: int | None = None, child_positions: torch.Tensor | None = None,
                 parent_positions: torch.Tensor | None = None):
        super().__init__(W_q, W_k, heads=heads, temperature=temperature)
        if isinstance(base, bool) or not isinstance(base, (int, float)) \
                or not math.isfinite(base) or base <= 1:
            raise ValueError(f"Rotary potential: base (of the frequencies base^(−2k/dims)) must "
                             f"be a finite number > 1; got {base!r}")
        dims = self.d_k if dims is None else check_size("Rotary potential", "dims", dims)
        if dims % 2 or dims > self.d_k:
            raise ValueError(f"Rotary potential: dims (the rotated dimensions of each head) must "
                             f"be even and ≤ d_k={self.d_k}; got {dims}")
        self.base, self.dims = float(base), dims
        self.child_positions, self.parent_positions = child_positions, parent_positions

    # -- the rotation (the factors' reading) ---------------------------------------------
    def _angles(self, n: int, positions, like: torch.Tensor):
        """``(cos, sin)``, each ``(n, dims)``, of the angles p·θ_k, the halves repeated."""
        p = (torch.arange(n, device=like.device, dtype=torch.float64) if positions is None
             else positions.to(device=like.device, dtype=torch.float64))
        return rotary_angles(p, self.base, self.dims, like.dtype)

    def rotate(self, x: torch.Tensor, positions=None, *, inverse: bool = False) -> torch.Tensor:
        """R_p x (or R_pᵀ x) for per-head states ``(*batch, H, n, d_k)`` at ``positions``."""
        cos, sin = self._angles(x.shape[-2], positions, x)
        return rotate_half(x, cos, -sin if inverse else sin, self.dims)

    def child_factor(self, children):
        return self.rotate(super().child_factor(children), self.child_positions)

    def parent_factor(self, parents):
        return self.rotate(super().parent_factor(parents), self.parent_positions)

    # -- the definition (the Pyro reading) ------------------------------------------------
    def at(self, children, parents, index):
        """ψ at the parent each child picked, in complex form (class docstring)."""
        H = self.heads

        def project(x, W):  # W x per head from the definition, (*batch, n, d) → (*batch, H, n, d_k)
            if W is None:
                return x.reshape(*x.shape[:-1], H, -1).movedim(-2, -3)
            return torch.einsum("...nd,hkd->...hnk", x, W.reshape(H, -1, W.shape[-1]))

        q = project(children, self.W_q)  # unrotated: the rotation is applied below, in C
        k = gather_parents(project(parents, self.W_k), index)  # (…, H, C, d_k)
        C = q.shape[-2]
        pos_i = (torch.arange(C, device=q.device, dtype=torch.float64)
                 if self.child_positions is None else self.child_positions.to(q.device,
                                                                              torch.float64))
        P = parents.shape[-2]
        pos_all = (torch.arange(P, device=q.device, dtype=torch.float64)
                   if self.parent_positions is None else self.parent_positions.to(
                       q.device, torch.float64))
        pos_j = pos_all[index] if torch.is_tensor(index) else pos_all[torch.as_tensor(index)]
        half = self.dims // 2
        wide = torch.promote_types(q.dtype, torch.float64)
        zq = torch.complex(q[..., :half].to(wide), q[..., half:self.dims].to(wide))
        zk = torch.complex(k[..., :half].to(wide), k[..., half:self.dims].to(wide))
        theta = self.base ** (-torch.arange(half, device=q.device, dtype=torch.float64) * 2
                              / self.dims)
        # ⟨R_i a, R_j b⟩ = Re Σ_k (a_k e^{iθ_k·i}) conj(b_k e^{iθ_k·j}) over the pairs
        shift = (pos_i - pos_j)[..., None] * theta  # (…, C, half)
        turned = (zq * zk.conj() * torch.polar(torch.ones_like(shift), shift)).real.sum(-1)
        plain = (q[..., self.dims:].to(wide) * k[..., self.dims:].to(wide)).sum(-1)
        psi = (turned + plain).to(q.dtype)
        return psi / per_head(self.temperature, psi, 1)

    # -- latent node sets -----------------------------------------------------------------
    def expected_gradient(self, side, op, weight=1.0):
        """E[∂ψ/∂x]: W_Qᵀ R_iᵀ Σ_j p_ij R_j b_j / τ (children) or W_Kᵀ R_jᵀ Σ_i p_ij R_i a_i / τ
        (parents): the bilinear form's, rotated back at the node's own position."""
        a, b, _ = op.factors(self)
        if side == "children":
            g, W, pos = op.attend(b), self.W_q, self.child_positions
        else:
            g, W, pos = op.adjoint(a), self.W_k, self.parent_positions
        g = merge_heads(weighted(self.rotate(g, pos, inverse=True), weight, self.temperature))
        return g if W is None else g @ W

    def validate(self, family, children, parents):
        super().validate(family, children, parents)
        for role, nodes, pos in (("children", children, self.child_positions),
                                 ("parents", parents, self.parent_positions)):
            if pos is not None and (not isinstance(pos, torch.Tensor) or pos.dim() != 1
                                    or pos.shape[0] != nodes.size):
                got = tuple(pos.shape) if isinstance(pos, torch.Tensor) else type(pos).__name__
                raise ValueError(f"edge family {family!r}: rotary {role[:-3]}_positions must be "
                                 f"a tensor ({nodes.size},), one position per node of "
                                 f"{nodes.name!r}; got {got}")

    def describe(self) -> str:
        rotated = "" if self.dims == self.d_k else f", {self.dims} of {self.d_k} dims"
        return f"Rotary(base={self.base:g}{rotated})"


def rotary_angles(p: torch.Tensor, base: float, dims: int, dtype: torch.dtype):
    """``(cos, sin)``, each ``(n, dims)``, of the angles p·θ_k, θ_k = base^(−2k/dims), at the
    float64 positions ``p (n,)``: computed in float64, the halves repeated, then in ``dtype``
    (at least float32)."""
    theta = base ** (-torch.arange(0, dims, 2, device=p.device, dtype=torch.float64) / dims)
    angle = p[:, None] * theta  # (n, dims/2)
    angle = torch.cat([angle, angle], -1)  # (n, dims)
    dtype = torch.promote_types(dtype, torch.float32)
    return angle.cos().to(dtype), angle.sin().to(dtype)


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dims: int):
    """x rotated on its first ``dims`` dimensions, the pairs (k, k + dims/2) ("rotate half"),
    by the angles whose ``cos`` and ``sin`` broadcast against them; the rest as it is."""
    r, rest = x[..., :dims], x[..., dims:]
    half = dims // 2
    turned = torch.cat([-r[..., half:], r[..., :half]], -1)
    out = (r * cos + turned * sin).to(x.dtype)
    return out if rest.shape[-1] == 0 else torch.cat([out, rest], -1)
