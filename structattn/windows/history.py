"""What the mean-field window iteration did: ``Trace.mean_field[family]``."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils import _pytree as pytree


@dataclass
class MeanFieldHistory:
    """What the mean-field window iteration did for one family, per round t.

    Reported as ``Trace.mean_field[family]``. The per-round tensors have T rows, one per
    round; a child that has settled keeps its final values. A child at position 0 (no past)
    has window 0 and no iterations.

    Attributes:
        windows: each child's window W_i per round, ``(T, *batch, H, N)``, long.
        alpha: the first of q's Beta parameters that the posterior of round t used,
            ``(T, *batch, H, N)``.
        beta: the second of q's Beta parameters that the posterior of round t used,
            ``(T, *batch, H, N)``.
        expected_distance: E_{p_t}[φ_i], the expected distance to the parent under round
            t's posterior, ``(T, *batch, H, N)``.
        band: the Python loop's band reach per round; the compiled kernel builds no band and
            reports the widest window it scored that round.
        iterations: T, the rounds: the slowest child's iterations.
        converged: whether every child settled within ``max_iters``.
        discarded: the final predictive tail mass beyond each window (the prior's side
            only), ``(*batch, H, N)``.
        child_iterations: each child's own iteration count, ``(*batch, H, N)``.
        bound: a certified upper bound on the final posterior's mass beyond each window,
            over all of the child's past (whatever the rule), ``(*batch, H, N)``.
        offset: the first child's position: the children are the last N of offset + N
            tokens (``last=``).
    """

    windows: torch.Tensor
    alpha: torch.Tensor
    beta: torch.Tensor
    expected_distance: torch.Tensor
    band: list = field(default_factory=list)
    iterations: int = 0
    converged: bool = False
    discarded: torch.Tensor | None = None
    child_iterations: torch.Tensor | None = None
    bound: torch.Tensor | None = None
    offset: int = 0

    @property
    def mean_window(self) -> float:
        """The final windows' mean over children that have a past (0 when nothing iterated)."""
        if self.windows.shape[0] == 0 or self.windows.numel() == 0:
            return 0.0
        w = self.windows[-1].to(torch.float64)
        w = w[..., 1:] if self.offset == 0 else w  # the child at position 0 has no past
        return float(w.mean()) if w.shape[-1] else 0.0

    def relative_operations(self, d: int) -> float:
        """The authors' counted-operations metric against full attention, averaged over
        children: mean_i W_i · (d + iterations_i + 1) / (n · d), n the tokens each child
        would read under full attention (all of them, also with ``last=``)."""
        n = self.offset + self.windows.shape[-1]
        if self.windows.shape[0] == 0 or self.windows.numel() == 0:
            return 0.0
        w = self.windows[-1].to(torch.float64)
        its = (self.child_iterations if self.child_iterations is not None
               else torch.full_like(w, self.iterations)).to(torch.float64)
        return float((w * (d + its + 1)).mean()) / (n * d)


# a reading returns it beside tensors: a pytree node, so that a plan's graph outputs its
# tensors (``structattn.compiling.replay``)
pytree.register_dataclass(MeanFieldHistory)
