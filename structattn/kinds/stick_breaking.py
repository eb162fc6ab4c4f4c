"""The operator of a stick-breaking family (``structattn.priors.StickBreaking``).

Child i scans its parents back from i − 1 and breaks at parent l with probability
β_il = σ(ψ_il) unless it broke nearer:

    p(φ_i = j | x) = σ(ψ_ij) Π_{j<l<i} σ(−ψ_il),    p(no parent | x) = Π_{l<i} σ(−ψ_il).

Two readings of the same numbers:

- **dense** (``stick_breaking_table``): log p = ψ_ij − Σ_{l=j}^{i−1} softplus(ψ_il) (since
  log σ(s) − log σ(−s) = s), a reverse cumulative sum along each row — O(C·P) memory; the
  posterior asked for, potentials without factors, devices other than the CPU, and
  ``torch.export`` (a program that must run without structattn) read it;
- **fused** (``csrc/stick_breaking.cpp``, ``structattn.kernels``): the CPU kernel, forward
  and backward, tile by tile, never the C×P posterior; it stops a block's scan once every
  child's stick is below the dtype's rounding (``stop_mass``), so on a sequence whose
  breaks come early it reads far fewer pairs than causal attention. It is an operator
  (``torch.ops.structattn_stick_breaking.forward``) with a fake tensor rule and an autograd
  formula registered here, so ``torch.compile`` and the compile-once plans take it whole.

The leftover mass (``leftover()``, ``(*batch, H, C)``) is the posterior of "no parent",
whose value is zero: the output is Σ_j p_ij v_j, rows summing to 1 − leftover.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import kernels, triton_kernels
from ..checking._validation import checks_on
from .base import Operator, keep_nonfinite_rows


def stop_mass(dtype: torch.dtype) -> float:
    """The stick below which a scan stops: 2⁻¹⁰ of the dtype's epsilon (float32 1.2e-10,
    float64 2.2e-19) — everything further back weighs less than that together."""
    return torch.finfo(dtype).eps * 2.0 ** -10


def stick_breaking_table(scores: torch.Tensor, allowed: torch.Tensor):
    """``(p, leftover)`` from dense break logits ``scores`` ``(…, C, P)`` and the support
    ``allowed`` (boolean, broadcasting): p ``(…, C, P)`` (zero off the support) and the
    leftover ``(…, C)``, by the reverse cumulative sum of softplus along each row."""
    # softplus(s) = −log σ(−s), exactly (F.softplus is linear beyond 20: an error of e⁻²⁰)
    sp = -F.logsigmoid(-scores).masked_fill(~allowed, 0.0)
    nearer = sp.flip(-1).cumsum(-1).flip(-1)  # Σ_{l ≥ j} softplus(ψ_il)
    log_p = (scores - nearer).masked_fill(~allowed, float("-inf"))
    return log_p.exp(), torch.exp(-sp.sum(-1))


def _ops():
    """The kernel's ops, with their fake-tensor and autograd rules registered once; None
    where kernels are off or could not be built."""
    return kernels.with_rules("stick_breaking", _register)


def _register(ops) -> None:
    lib = "structattn_stick_breaking"

    @torch.library.register_fake(f"{lib}::forward")
    def _(a, b, v, scale, stop):
        G, C = a.shape[0], a.shape[1]
        blocks = (C + 63) // 64
        return (v.new_empty(G, C, v.shape[-1]), a.new_empty(G, C),
                a.new_empty(G, blocks, dtype=torch.long))

    @torch.library.register_fake(f"{lib}::backward")
    def _(dout, dleft, a, b, v, scale, out, leftover, start):
        return a.new_empty(a.shape), b.new_empty(b.shape), v.new_empty(v.shape)

    def setup(ctx, inputs, output):
        a, b, v, scale, _ = inputs
        out, leftover, start = output
        ctx.save_for_backward(a, b, v, out, leftover, start)
        ctx.scale = scale
        ctx.mark_non_differentiable(start)

    def backward(ctx, dout, dleft, _):
        a, b, v, out, leftover, start = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout
        dleft = torch.zeros_like(leftover) if dleft is None else dleft
        da, db, dv = torch.ops.structattn_stick_breaking.backward(
            dout, dleft, a, b, v, ctx.scale, out, leftover, start)
        return da, db, dv, None, None

    torch.library.register_autograd(f"{lib}::forward", backward, setup_context=setup)


def fused(a, b, v, scale: float, tol: float | None = None):
    """``(out, leftover)`` of a fused kernel for factors ``a (…, C, k)``, ``b (…, P, k)``,
    values ``v (…, P, d)`` (leading dims broadcast; children are the first C tokens),
    stopping a scan at a stick ≤ ``tol`` (None: ``stop_mass``), or None where no kernel
    applies. On the CPU the C++ kernel (``csrc/stick_breaking.cpp``; None where kernels are
    off or unbuilt); on CUDA the Triton kernel (``structattn.triton_kernels``; None without
    Triton). The Triton kernel takes half precision as it is (its scores and sums in float32);
    the C++ kernel computes it in float32."""
    lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2], v.shape[:-2])
    dtype = torch.promote_types(torch.promote_types(a.dtype, b.dtype), v.dtype)
    if triton_kernels.serves(a, b, v) and kernels._enabled():
        from ..triton_kernels.stick_breaking import forward as op
    elif a.device.type == "cpu" and (ops := _ops()) is not None:
        op = ops.forward
        dtype = torch.promote_types(dtype, torch.float32)
    else:
        return None
    flat = [t.expand(*lead, *t.shape[-2:]).reshape(-1, *t.shape[-2:]).to(dtype)
            for t in (a, b, v)]
    stop = stop_mass(torch.promote_types(dtype, torch.float32)) if tol is None else tol
    out, leftover, _ = op(*flat, float(scale), stop)
    C = a.shape[-2]
    return (out.reshape(*lead, C, v.shape[-1]).to(v.dtype),
            leftover.reshape(*lead, C).to(v.dtype))


class StickBreakingOperator(Operator):
    """Attention under a stick-breaking prior (``structattn.priors.StickBreaking``):
    ``attend(u) = P u`` with P the scan's distribution (module docstring), through a fused
    kernel where one applies (``fused``: C++ on the CPU, Triton on CUDA); everything else
    from the dense table. Reports each child's leftover mass (``leftover``); has no
    log-partition (no latent node sets).

    Args:
        family (EdgeFamily): the edge family whose posterior it reads (``Operator``).
        cache (dict | None): what an iterating reader keeps across steps (``Operator``).
            None (default): a new, empty one.
    """

    reading_name = "stick-breaking"

    kind_name = "a stick-breaking"

    def __init__(self, family, cache=None):
        super().__init__(family, cache)
        self._dense = None
        self._leftover = None

    def _table(self):
        """``(p, leftover)``, dense: the potential's own dense table (``pairwise``, float32 for
        half precision) through ``stick_breaking_table`` on the support's mask."""
        if self._dense is None:
            f = self.family
            scores = f.potentials[0].pairwise(f.children.states, f.parents.states)
            scores = scores.expand(*f.batch_shape, f.heads, *scores.shape[-2:])
            p, left = stick_breaking_table(scores, f.tables.support_dense())
            dtype = f.children.states.dtype
            self._dense = (p.to(dtype), left.to(dtype))
        return self._dense

    def _use_kernel(self) -> bool:
        return (self._dense is None and self.is_fused()
                and not torch.compiler.is_exporting())

    def dense_posterior(self) -> torch.Tensor:
        return self._table()[0]

    def leftover(self) -> torch.Tensor:
        """p(no parent | x) per child, ``(*batch, H, C)``: the stick left after the scan."""
        if self._leftover is None:
            self._leftover = self._table()[1]
        return self._leftover

    def attend(self, u: torch.Tensor) -> torch.Tensor:
        if self._use_kernel():
            a, b, scale = self.fused_factors()
            got = fused(a, b, u, scale, self.family.prior.tol)
            if got is not None:
                out, self._leftover = got
                if not checks_on():  # nothing was checked: a NaN must stay a NaN
                    out = keep_nonfinite_rows(out, a, b)
                return out
        return self.dense_posterior() @ u

    def adjoint(self, u: torch.Tensor) -> torch.Tensor:
        return self.dense_posterior().transpose(-1, -2) @ u

    def mass(self) -> torch.Tensor:
        return self.dense_posterior().sum(-2).unsqueeze(-1)

    def log_partition(self) -> torch.Tensor:
        raise NotImplementedError(
            f"edge family {self.family.name!r}: a stick-breaking prior reads its potential as "
            f"break logits, not as a likelihood with a log-partition; it serves single-shot "
            f"values, not latent node sets")

    def reports(self) -> dict:
        return {"leftover": self.leftover()}
