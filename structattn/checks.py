"""The argument checks a declaration's constructor and ``model`` use, public for models of
one's own (the catalogue's included): each raises a ``ValueError`` naming the owner, the
argument, what it must be and what it got.

- ``check_size(owner, name, value, least=1)``: a size (heads, widths, counts, steps), an int
  ≥ ``least``; bools, floats and strings refused.
- ``check_layer_sizes(owner, layer_sizes, order)``: a list of ≥ 2 positive ints.
- ``check_finite(what, tensor)``: no NaN or ±inf (while checks are on; one fused pass).
- ``check_positive(owner, name, value)``: a float, or a tensor () or (heads,), finite and
  > 0 (a Beta parameter, a rate).
- ``raise_pending()``: on a GPU, wait for the queued verdicts of the checks of replayed calls
  and raise the first failure (``structattn.checking.verdicts``).
"""

from __future__ import annotations

from .checking._validation import check_finite, check_layer_sizes, check_positive, check_size
from .checking.verdicts import raise_pending

__all__ = ["check_finite", "check_layer_sizes", "check_positive", "check_size", "raise_pending"]
