"""Window supports — each child reads the parents 1 ≤ d ≤ W positions back, d = i − j — and
their operator: one banded ``scaled_dot_product_attention`` call (``structattn.band``),
O(N·W), or FlexAttention with a block mask on CUDA. The prior must state its log weights
by distance (``log_by_distance(W, device, dtype)``, ``(heads or 1, W + 1)``), as the
geometric–Beta prior of expanding attention does.

The children may be the last C of the P parent tokens (a decoding step): child i sits at
position P − C + i (``offset`` = P − C); the dense reading serves that case.

Cost: O(N·W·(k + d_v)) time, O(N·W) memory; the dense twin (a window holding all of the
past, C < P, or a potential with no factorised form) O(C·P).
"""

from __future__ import annotations

import torch

from .. import band
from ..certified import certify
from .base import Operator, Support


def keep_from_position(n: int, device, dtype) -> torch.Tensor:
    """``(N, 1)``: 0 for the token at position 0, which has no past (zero output), 1 elsewhere."""
    return (torch.arange(n, device=device) > 0).to(dtype)[:, None]


class Window(Support):
    """Φ_i = {j : 1 ≤ (offset + i) − j ≤ width} (``width`` None: all of the past)."""

    def __init__(self, width: int | None, offset: int = 0):
        self.width, self.offset = width, offset

    def contains(self, child, parent):
        d = child + self.offset - parent
        return (d >= 1) if self.width is None else (d >= 1) & (d <= self.width)

    def dense(self, num_children, num_parents, device):
        ones = torch.ones(num_children, num_parents, dtype=torch.bool, device=device)
        past = ones.tril(self.offset - 1)  # j ≤ i + offset − 1
        return past if self.width is None else past & ones.triu(self.offset - self.width)

    def describe(self):
        return "1 ≤ i − j" + ("" if self.width is None else f" ≤ {self.width}")


class WindowOperator(Operator):
    """The banded lowering of a window support (module docstring)."""

    def __init__(self, family, cache=None):
        super().__init__(family, cache)
        self._band = None
        self._width = False  # not chosen yet
        #: certified truncation's choice (``structattn.certified.Certified``) when the
        #: prior asks for one (``tol``) and the band applies; the trace reports it
        self.truncation = None

    def _chosen_width(self) -> int | None:
        """The window the band reads: the support's, or — when the prior states a certified
        ``tol`` — the shortest one whose posterior tail is certified ≤ tol for every child
        (then the support's is its cap); None: all of the past."""
        if self._width is not False:
            return self._width
        f = self.family
        width, eps = f.support.width, getattr(f.prior, "tol", None)
        n = f.children.size
        if eps is not None and self.is_fused() and f.support.offset == 0 \
                and n == f.parents.size and n > 1:
            a, b, scale = self.fused_factors()  # (*batch, H, N, k)
            self.truncation = certify(a, b, scale, f.prior, eps, cap=width,
                                      block=f.prior.block_size)
            width = self.truncation.width
        self._width = width
        return width

    def reports(self) -> dict:
        return {} if self.truncation is None else {"truncation": self.truncation}

    def _banded(self) -> bool:
        """Whether the band applies: one factorised potential, the children are all the
        parents (no offset) and the window is shorter than the past."""
        f = self.family
        n = f.children.size
        if not (self.is_fused() and f.support.offset == 0 and n == f.parents.size):
            return False
        w = self._chosen_width()
        return w is not None and w < n - 1

    def _setup(self):
        if self._band is None:
            f = self.family
            n, window = f.children.size, self._chosen_width()
            a, b, scale = self.fused_factors()  # (*batch, H, N, k)
            xc = f.children.states
            keep = keep_from_position(n, a.device, xc.dtype)
            table = f.prior.log_by_distance(window, a.device, xc.dtype)  # (H|1, W + 1)
            layout = band.BandLayout.for_window(n, window, f.prior.block_size)
            dist = layout.distance(a.device)  # (B, L)
            pos = layout.child_positions(a.device)[:, :, None]  # (nb, B, 1)
            inside = (dist >= 1) & (dist <= window) & (dist <= pos)  # (nb, B, L)
            lp = table[:, dist.clamp(0, window)]  # (H|1, B, L)
            bias = torch.where(inside, lp[:, None], torch.tensor(float("-inf"), dtype=lp.dtype,
                                                                 device=lp.device))
            # children without any parent in the band (child 0, padding) attend anywhere; zeroed
            bias = torch.where(inside.any(-1, keepdim=True), bias, torch.zeros_like(bias))
            self._band = dict(a=a, b=b, scale=scale, keep=keep, table=table, layout=layout,
                              inside=inside, bias=bias, p=None)
        return self._band

    def _band_posterior(self):
        s = self._setup()
        if s["p"] is None:
            scores = band.scores(s["a"], s["b"], s["scale"], s["layout"])  # (*batch, H, nb, B, L)
            s["p"] = torch.softmax(scores + s["bias"], -1) * s["inside"].any(-1, keepdim=True)
        return s["p"]

    def dense_posterior(self):
        if not self._banded():
            return super().dense_posterior()
        return self._setup()["layout"].to_dense(self._band_posterior())

    def attend(self, u):
        if not self._banded():
            return super().attend(u)
        s = self._setup()
        if s["p"] is not None:
            return band.apply(s["p"], u, s["layout"]) * s["keep"]
        a, b, window = s["a"], s["b"], self._chosen_width()
        if a.is_cuda and _flex_available():
            table, H = s["table"], s["table"].shape[0]

            def log_prior(bi, h, i, d):
                return table[h if H > 1 else 0, d.clamp(0, window)]

            lead = a.shape[:-2]  # FlexAttention takes (B, H, N, d): fold the batch dims
            out = band.flex_attend(a.reshape(-1, *a.shape[-3:]), b.reshape(-1, *b.shape[-3:]),
                                   u.reshape(-1, *u.shape[-3:]), s["scale"], log_prior, window)
            return out.reshape(*lead, *out.shape[-2:]) * s["keep"]
        return band.attend(a, b, u, s["scale"], s["bias"], s["layout"]) * s["keep"]


Window.operator = WindowOperator


def _flex_available() -> bool:
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True
