"""Compiled CPU kernels, built on first use by torch's C++ extension loader and cached.

One kernel today: ``csrc/mean_field_windows.cpp``, the mean-field iteration of expanding
attention child by child (``structattn.windows``). A Python loop of small tensor operations
pays a fixed cost per operation and per iteration that, at tens or hundreds of tokens, is
far larger than the arithmetic; the kernel runs each child's whole iteration in one call.

The build needs a C++ compiler and ``ninja`` (a dependency); it takes about a minute once
per machine (``scripts/setup.sh`` does it ahead of time) and is cached under
``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``). Where it cannot be built,
the library warns once and uses its Python loop, which computes the same thing (to rounding:
in bfloat16 the kernel scores in float32, the loop in bfloat16).
``STRUCTATTN_KERNELS=0`` in the environment, or ``with structattn.kernels.disabled():``,
turns the kernels off (e.g. to compare against the Python loop).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import warnings

import torch

__all__ = ["available", "disabled", "mean_field_windows", "build_error"]

_SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "mean_field_windows.cpp")
_NAME = "structattn_mean_field"
_lock = threading.Lock()
_state: dict = {"ops": None, "error": None, "tried": False}
_off = threading.local()
log = logging.getLogger("structattn.kernels")


def _enabled() -> bool:
    return os.environ.get("STRUCTATTN_KERNELS", "1") != "0" and not getattr(_off, "depth", 0)


@contextlib.contextmanager
def disabled():
    """Use the Python loops inside this block (this thread)."""
    _off.depth = getattr(_off, "depth", 0) + 1
    try:
        yield
    finally:
        _off.depth -= 1


def _build():
    from torch.utils.cpp_extension import load

    log.info("structattn: building the mean-field kernel (once per machine, about a minute)")
    with warnings.catch_warnings():  # the loader's own notes (compiler version, ABI)
        warnings.simplefilter("ignore")
        # -fopenmp: at::parallel_for spreads the children over torch's intra-op threads
        load(name=_NAME, sources=[_SOURCE], extra_cflags=["-O3", "-fopenmp"],
             extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    return getattr(torch.ops, _NAME)


def mean_field_windows():
    """The kernel's ops (``solve``, ``attend``), or None where kernels are off or the build
    failed (then: one ``RuntimeWarning`` saying why, and the Python loop)."""
    if not _enabled():
        return None
    if not _state["tried"]:
        with _lock:
            if not _state["tried"]:
                try:
                    _state["ops"] = _build()
                except Exception as err:  # no compiler, no ninja, a read-only cache …
                    _state["error"] = f"{type(err).__name__}: {err}"
                    warnings.warn(f"structattn: the compiled mean-field kernel could not be "
                                  f"built ({_state['error'].splitlines()[0][:300]}); expanding "
                                  f"attention uses its Python loop (same results, slower). "
                                  f"Set STRUCTATTN_KERNELS=0 to silence this.", RuntimeWarning,
                                  stacklevel=3)
                _state["tried"] = True
    return _state["ops"]


def available() -> bool:
    """Whether the compiled kernels are on and built (building them if need be)."""
    return mean_field_windows() is not None


def build_error() -> str | None:
    """Why the build failed, or None."""
    return _state["error"]
