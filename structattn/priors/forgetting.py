"""A forget gate over the past (FoX, Lin et al. 2025): log p(φ_i = j) = Σ_{l=j+1..i} log f_l."""

from __future__ import annotations

import torch

from ..checking._validation import checks_on, passes, shape_str
from ._registry import PriorEntry
from .distance import DistancePrior


class ForgettingGate(DistancePrior):
    r"""$p(φ_i = j) ∝ \prod_{l=j+1}^{i} f_l$ over $j ≤ i$ (FoX, Lin et al. 2025): each token $l$ between
    a child and a parent forgets with its own gate $f_l ∈ (0, 1]$.

    The gates are data-dependent (FoX's $f_l = σ(wᵀx_l + b)$, one per head). With
    $c = \mathrm{cumsum}(\log f)$ the log weight is $c_i − c_j$, a difference of per-token terms (``terms``),
    so the dense operator lowers it, on the CPU, as the fused kernel with $−c_j$ as its mask
    (trained through ``csrc/key_bias.cpp``'s backward), elsewhere as plain SDPA with one more
    key dimension — never an N×N bias. A constant gate $f$ is ALiBi with slope $m = −\log f$.

    A distance prior that is not stationary (``DistancePrior``'s module docstring): the
    weight of a distance depends on the gates in between, so it states no
    ``log_at_distance``; the options, the support (j ≤ i, through a certified window with
    ``tol``) and the window come from the base, and it overrides what reads its weights:
    ``log_weight``, the band's weights (the cumulative sum in the certificate's float64) and
    the tail (exact, O(N)). The children are the first C of the N parent tokens.

    Args:
        log_f (torch.Tensor): the log gates log f_l, a floating-point tensor ``(…, N)`` with
            one entry per parent token, finite and ≤ 0 (values checked while validation is
            on; ``torch.nn.functional.logsigmoid`` of gate logits gives them); its leading
            dims (batch, heads) broadcast against ``(*batch, heads)``.
        tol (float | None): the compiled reading reads the shortest window whose posterior
            mass beyond it is certified ≤ tol for every child, in (0, 1)
            (``structattn.certificates.certified``, from the gates' own tail: FoX's pruning, with a
            proof); the model, and so Pyro's reading, is still all of the past. None
            (default): all of the past.
        block_size (int): the band's block of children, an int ≥ 1. Default 64.
        certificate (str): ``"window"`` (default) or, with a ``tol``, ``"blocks"``: the key
            blocks each block of children needs instead, wherever they lie, per head
            (``structattn.block_sparse``).

    Raises:
        ValueError: ``log_f`` not a floating-point tensor of at least one dim, or not finite
            and ≤ 0; or an option ``DistancePrior`` refuses (``tol``, ``block_size``,
            ``certificate``).
    """

    stationary = False

    def __init__(self, log_f: torch.Tensor, *, tol: float | None = None, block_size: int = 64,
                 certificate: str = "window"):
        if not isinstance(log_f, torch.Tensor) or log_f.dim() < 1 or not log_f.is_floating_point():
            got = shape_str(log_f.shape) if isinstance(log_f, torch.Tensor) else type(log_f).__name__
            raise ValueError(f"ForgettingGate prior: log_f must be a float tensor (…, N) of log "
                             f"forget gates, one per token; got {got}")
        if checks_on() and not passes(((log_f <= 0) & log_f.isfinite()).all()):
            bad = log_f[(log_f > 0) | ~log_f.isfinite()]
            raise ValueError(f"ForgettingGate prior: log_f must be finite and ≤ 0 (a gate "
                             f"f = exp(log_f) in (0, 1]); got {bad.numel()} entries outside, e.g. "
                             f"{float(bad[0])!r}. Use torch.nn.functional.logsigmoid(gate logits)")
        self.log_f = log_f
        super().__init__("ForgettingGate prior", causal=True, tol=tol, block_size=block_size,
                         certificate=certificate)

    def cumulative(self, dtype=None) -> torch.Tensor:
        """c_k = Σ_{l ≤ k} log f_l, ``(…, N)``, summed in ``dtype`` (None: log_f's, at least
        float32 — in bfloat16 a sum of 512 gates near ½ is ~−350, where bfloat16's spacing is
        2, so c_i − c_j, and the prior, would be off by e²) (O(N); not kept: nothing is stored
        on a prior)."""
        dtype = torch.promote_types(self.log_f.dtype, torch.float32) if dtype is None else dtype
        return torch.cumsum(self.log_f, -1, dtype=dtype)

    @property
    def heads(self) -> int:
        """The heads dim of ``log_f`` (its second-to-last; 1 for a gate shared by every head)."""
        return self.log_f.shape[-2] if self.log_f.dim() > 1 else 1

    def log_weight(self, child, parent, sizes):
        c = self.cumulative()
        return c[..., child] - c[..., parent]  # (…, *index)

    def log_weights_on_band(self, layout, width, first, device, dtype,
                            blocks=slice(None)):
        """c_i − c_j at the band's pairs, the cumulative sum taken in ``dtype`` (float64 for
        the certificate; at least float32)."""
        n = layout.n
        c = self.cumulative(torch.promote_types(dtype, torch.float32)).to(device)
        child = layout.child_positions(device)[blocks, :, None].clamp(max=n - 1)  # (nb, B, 1)
        parent = layout.parent_positions(device)[blocks, None].clamp(0, n - 1)  # (nb, 1, L)
        lw = (c[..., child] - c[..., parent]).to(dtype)  # (…, nb, B, L)
        return lw.masked_fill_(~layout.within(width, first, device, blocks), float("-inf"))

    def log_tail_mass(self, width, num_tokens, device, dtype):
        """log Σ_{j < i − width} e^{c_i − c_j} ``(…, N)``, exact: c_i + logcumsumexp(−c) at
        i − width − 1."""
        c = self.cumulative(dtype).to(device)  # (…, N)
        behind = torch.logcumsumexp(-c, -1)  # [k]: log Σ_{j ≤ k} e^{−c_j}
        last = torch.arange(c.shape[-1], device=device) - width - 1  # the farthest j, per i
        tail = c + behind[..., last.clamp(min=0)]
        return tail.masked_fill(last < 0, float("-inf"))

    def check_nodes(self, family, children, parents) -> None:
        N = self.log_f.shape[-1]
        if N != parents.size or children.size > N:
            raise ValueError(f"edge family {family!r}: ForgettingGate has log_f for {N} tokens "
                             f"(last dim of {shape_str(self.log_f.shape)}); it needs one per "
                             f"parent ({parents.size}) and at most as many children "
                             f"({children.size})")

    def terms(self, num_children, num_parents, device):
        c = self.cumulative().to(device)
        return c[..., :num_children], -c[..., :num_parents]

    def describe(self) -> str:
        return f"ForgettingGate(N={self.log_f.shape[-1]}, {self.short_support()})"


def _formula(prior, C, P):
    import numpy as np

    c = np.cumsum(prior.log_f.detach().numpy(), -1).reshape(-1, P)  # (H|1, P)
    w = c[:, :C, None] - c[:, None, :]  # c_i − c_j
    return np.where(np.arange(P)[None, :] <= np.arange(C)[:, None], w, -np.inf)


def _gates(g, P=5):
    return -torch.rand(2, P, generator=g, dtype=torch.float64) - 0.05


def _cases(C, P, g):
    if C > P:
        return []
    return [ForgettingGate(-torch.rand(2, P, generator=g, dtype=torch.float64)),
            ForgettingGate(-torch.rand(2, P, generator=g, dtype=torch.float64), tol=0.1,
                           block_size=2)]


def _certified(g, n=48):
    """Gates f = σ(z), z ~ N(−0.5, 1), at N = ``n`` (``check_certificate``'s)."""
    logits = torch.randn(2, n, generator=g, dtype=torch.float64) - 0.5
    return ForgettingGate(torch.nn.functional.logsigmoid(logits), tol=1e-2, block_size=8)


ENTRY = PriorEntry(
    ForgettingGate, _cases,
    _formula,
    bad={"log_f must be finite and ≤ 0": lambda: ForgettingGate(torch.ones(5)),
         "log_f must be a float tensor": lambda: ForgettingGate(torch.zeros(5).long())},
    parameters=lambda g: ((_gates(g),), lambda t: ForgettingGate(t)),
    certified=_certified)
