"""Value checks that cost a pass over the data, switchable like ``torch.distributions``.

Shape, dtype and device checks are always on (they are free). Checks that read
tensor *values* — NaN inputs, children whose support is empty — need a pass
over the data and a device sync, so they follow the ``torch.distributions``
convention: on by default, off with ``structattn.set_validation(False)``.
"""

from __future__ import annotations

import contextlib
import threading

import torch

_DEFAULT = True  # the process-wide default (set_validation)
_local = threading.local()  # per-thread overrides (the validation() context manager)


def set_validation(enabled: bool) -> None:
    """Turn the value checks on or off by default, in every thread (on by default)."""
    global _DEFAULT
    _DEFAULT = bool(enabled)
    _local.__dict__.pop("override", None)


def is_validating() -> bool:
    override = getattr(_local, "override", None)
    return _DEFAULT if override is None else override


@contextlib.contextmanager
def validation(enabled: bool):
    """Context manager for this thread only: ``with structattn.validation(False): layer(x)``
    (other threads, e.g. nn.DataParallel replicas, keep their own setting)."""
    old = getattr(_local, "override", None)
    _local.override = bool(enabled)
    try:
        yield
    finally:
        _local.override = old


def first_true(flags: torch.Tensor) -> tuple[int, ...] | None:
    """The index of the first True in a boolean tensor, or None when there is none."""
    if not bool(flags.any()):
        return None
    return tuple(int(i) for i in flags.nonzero()[0])


def check_finite(what: str, tensor: torch.Tensor) -> None:
    """Raise a ValueError naming ``what`` when ``tensor`` holds NaN or ±inf."""
    if not is_validating() or torch.compiler.is_compiling():
        return
    # A finite sum means every entry is finite (NaN or ±inf anywhere poisons it), and the
    # sum allocates nothing the size of the tensor; scan elementwise only when it is not.
    if bool(torch.isfinite(tensor.sum())):
        return
    bad = ~torch.isfinite(tensor)
    first = first_true(bad)
    if first is not None:
        raise ValueError(
            f"{what} contains non-finite values (NaN or inf): {int(bad.sum())} of "
            f"{tensor.numel()} entries, the first at index {first}. structattn refuses to "
            f"propagate them into a posterior; clean the input or call "
            f"structattn.set_validation(False) to skip this check."
        )


def shape_str(shape) -> str:
    return str(tuple(int(s) for s in shape))


def same_device(a, b) -> bool:
    """``cuda`` and ``cuda:0`` name the same device when the index is left out."""
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    return a.index is None or b.index is None or a.index == b.index
