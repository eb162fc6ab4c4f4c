"""Triton kernels: the GPU's fused readings of the priors that PyTorch has no fused kernel for.

Each kernel is a ``torch.library`` custom operator (``structattn_triton::…``) with a fake
kernel and an autograd rule, so a compile-once plan, ``torch.compile`` and ``torch.export``
see one node. On a CUDA device the library calls them; on the CPU the C++ kernels
(``structattn.kernels``) serve and these never run — except under Triton's interpreter
(``TRITON_INTERPRET=1``, set before Triton is imported), which runs them on CPU tensors, as the
test suite does on machines without a GPU.

- ``stick_breaking``: stick-breaking attention's forward and backward, scanned in key blocks
  from the diagonal back in log space; O(N·d) memory, never the C×P table.
- ``key_bias``: attention under a log prior g_i + h_j (FoX, ALiBi) with h's gradient, on the
  whole past or a certified band per head.
- ``generalised_gaussian``: attention under −|(i − j − μ)·e^s|^β per head, that prior
  computed inside each block of scores, with the gradients of μ, s and β.
- ``expanding``: expanding attention's mean field — each child's fixed point, and the
  output at it over a band per child, forward and backward.

Triton comes with the ``gpu`` extra (``pip install structattn[gpu]``). ``available()`` says
whether it imports here; ``interpreted()`` whether its interpreter is on.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os

from .. import reading

__all__ = ["available", "interpreted", "on_cpu", "serves"]


_installed: list = []  # [whether Triton is installed], found once (a plain global: dynamo
# traces it, where it warns of a functools cache)


def available() -> bool:
    """Whether Triton is installed (it is imported only when a kernel is first called).

    Returns:
        bool: True where ``triton`` can be imported.
    """
    if not _installed:
        _installed.append(importlib.util.find_spec("triton") is not None)
    return _installed[0]


def interpreted() -> bool:
    """Whether Triton's interpreter runs the kernels (on CPU tensors, slowly: for tests).

    Returns:
        bool: True where ``TRITON_INTERPRET`` is set to something other than "" or "0".
    """
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@contextlib.contextmanager
def on_cpu():
    """Context manager: the library calls the Triton kernels on CPU tensors too, inside it.

    Only where the interpreter is on (``TRITON_INTERPRET=1``): how the tests check a whole
    layer through them without a GPU. Per thread (``ReadingContext.triton_on_cpu``); part of
    a compiled module's signature.

    Yields:
        (None): the block runs with the Triton kernels on CPU tensors too.
    """
    with reading.entered(triton_on_cpu=True):
        yield


def serves(*tensors) -> bool:
    """Whether the library calls the Triton kernels for these tensors.

    It does on a CUDA device with Triton installed, or on the CPU inside ``on_cpu()`` under
    the interpreter (``TRITON_INTERPRET=1``).

    Args:
        *tensors (torch.Tensor): the tensors a kernel would read; all on CUDA, or all on
            the CPU.

    Returns:
        bool: True where the Triton kernels serve them; False for no tensors.
    """
    if not tensors:
        return False
    if all(t.is_cuda for t in tensors):
        return available()
    return (reading.context().triton_on_cpu and interpreted() and available()
            and all(t.device.type == "cpu" for t in tensors))
