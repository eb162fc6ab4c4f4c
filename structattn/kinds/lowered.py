"""Which reading an edge family's operator took, and why a dense one was dense.

Every operator names how it read its family in one call (``Operator.lowering``): the fused
kernels of the catalogue's fast paths — per-token terms (``"key-bias terms"``), a distance
table looked up per tile (``"distance table"``), a distance kernel on the GPU, a support's
non-empty tiles (``"blocks"``, with the share visited), FlexAttention on CUDA for a
distance table or a support's tiles (``"flex"``, with the share visited), a prior of
``log_weight`` alone a
block of children at a time (``"rows"``), SDPA over j ≤ i or every parent without a table
(``"sdpa"``) — a kind's own operator (a window, an
edge list, stick-breaking) or the dense reading, which builds a ``(…, C, P)`` mask, table or
posterior, with the reason (a support or prior that states nothing faster, the posterior
asked for, a dtype or device no kernel serves). ``layer.explain(*inputs)`` returns them by
family, and a returned ``Trace`` holds them (``Trace.lowering``).

A dense reading of a family with N = max(C, P) ≥ ``DENSE_WARNING_SIZE`` tokens warns once per
family and reason (``DenseReadingWarning``): at 4,096 tokens and four heads its table is
256 MiB in float32, and it grows as N².
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass

#: the tokens (max of children and parents) from which a dense reading warns
DENSE_WARNING_SIZE = 4096

_warned: set = set()
_lock = threading.Lock()


class DenseReadingWarning(UserWarning):
    """An edge family of N ≥ ``DENSE_WARNING_SIZE`` tokens was read through a dense ``(…, C,
    P)`` table, mask or posterior; the message names the family and why."""


@dataclass(frozen=True)
class Lowering:
    """How an edge family was read in one call.

    Attributes:
        reading (str): the reading: ``"key-bias terms"``, ``"distance table"``, ``"distance
            kernel"``, ``"blocks"`` (a support's non-empty tiles), ``"flex"`` (FlexAttention on
            CUDA), ``"rows"``, ``"sdpa"``, ``"dense"``,
            ``"dense posterior"``, or a kind's own (``"window"``, ``"edge list"``,
            ``"stick-breaking"``, ``"mean-field windows"``).
        reason (str | None): for a dense reading, why the family is read densely; else None.
        size (tuple | None): ``(C, P)``, the children and parents read.
        visited (float | None): a reading by blocks (``"blocks"``, ``"flex"``): the share of
            the grid's tiles it visited; else None.
    """

    reading: str
    reason: str | None = None
    size: tuple | None = None
    visited: float | None = None

    @property
    def dense(self) -> bool:
        """Whether the reading built a ``(…, C, P)`` table, mask or posterior."""
        return self.reading.startswith("dense")

    def __str__(self) -> str:
        where = f" ({self.size[0]}×{self.size[1]})" if self.size else ""
        seen = "" if self.visited is None else f", {self.visited:.1%} of the tiles"
        return self.reading + where + seen + (f": {self.reason}" if self.reason else "")


def warn_if_large(family: str, lowering: Lowering) -> None:
    """Warn once per family and reason where a dense reading covers N ≥ ``DENSE_WARNING_SIZE``
    tokens (``DenseReadingWarning``)."""
    if not lowering.dense or lowering.size is None or max(lowering.size) < DENSE_WARNING_SIZE:
        return
    key = (family, lowering.reason)
    with _lock:
        if key in _warned:
            return
        _warned.add(key)
    C, P = lowering.size
    warnings.warn(f"structattn: edge family {family!r} ({C} children × {P} parents) is read "
                  f"densely, a (…, {C}, {P}) table in memory: {lowering.reason}",
                  DenseReadingWarning, stacklevel=2)
