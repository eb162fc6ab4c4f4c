"""Compiled CPU kernels, built on first use by torch's C++ extension loader and cached.

Five kernels, each one source file in ``csrc/``:

- ``mean_field_windows.cpp``: the mean-field iteration of expanding attention child by child
  (``structattn.windows``). A Python loop of small tensor operations pays a fixed cost per
  operation and per iteration that, at tens or hundreds of tokens, is far larger than the
  arithmetic; the kernel runs each child's whole iteration in one call.
- ``stick_breaking.cpp``: stick-breaking attention's forward and backward
  (``structattn.kinds.stick_breaking``), tile by tile, never the C×P posterior.
- ``key_bias.cpp``: attention under a log prior g_i + h_j (FoX, ALiBi) with the gradient of
  h: the forward is PyTorch's fused kernel with h as a mask, the backward its own, tile by
  tile (``structattn.kinds.key_bias``).
- ``distance_table.cpp``: attention under a log prior that is a function of i − j alone (a
  user's ``DistancePrior``, ALiBi on every parent, relative positions, the generalised
  Gaussian), its table looked up inside each tile of scores, forward and backward with the
  table's gradient (``structattn.kinds.distance_table``).
- ``block_support.cpp``: attention over a support's non-empty tiles only (``structattn.kinds.
  blocks``: full or partial, a partial one with its own mask), forward and backward
  (``structattn.kinds.block_support``).

The build needs a C++ compiler and ``ninja`` (a dependency); it takes about a minute per
kernel, once per torch version (``python -m structattn.kernels build`` does it ahead of time,
as ``scripts/setup.sh`` does), and is kept under ``TORCH_EXTENSIONS_DIR`` (default
``~/.cache/torch_extensions``) in a directory named by a hash of what the library depends on
(``cache_directory``): virtual environments with the same torch share it. Where it cannot be built,
the library warns once per kernel and uses its Python reading, which computes the same thing
(to rounding: in bfloat16 the kernels score in float32, the Python loop in bfloat16).
``STRUCTATTN_KERNELS=0`` in the environment, or ``with structattn.kernels.disabled():``,
turns the kernels off (e.g. to compare against the Python loop). ``STRUCTATTN_KERNEL_ISA``
chooses the instruction set they are compiled for (``isa``): ``native`` (the default,
``-march=native``) or ``avx2`` (x86-64-v3: AVX2 and FMA, what an AVX2-only machine builds),
each in its own cache directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import sys
import threading
import warnings

import torch

from . import reading

__all__ = ["available", "block_support", "build", "build_error", "cache_directory",
           "disabled", "distance_table", "isa", "key_bias", "mean_field_windows",
           "stick_breaking", "with_rules"]

#: kernel → (its source in csrc/, the name of its extension and op namespace, what falls back)
_KERNELS = {
    "mean_field": ("mean_field_windows.cpp", "structattn_mean_field",
                   "expanding attention uses its Python loop"),
    "stick_breaking": ("stick_breaking.cpp", "structattn_stick_breaking",
                       "stick-breaking attention uses its dense reading (C×P memory)"),
    "key_bias": ("key_bias.cpp", "structattn_key_bias",
                 "FoX and ALiBi train through one more key dimension (~12% slower)"),
    "distance_table": ("distance_table.cpp", "structattn_distance_table",
                       "a stationary distance prior is read as a dense (heads, C, P) table"),
    "block_support": ("block_support.cpp", "structattn_block_support",
                      "supports read by blocks use their Python loop over child blocks"),
}
#: kernel → compiler flags beyond -O3 -fopenmp. ``-march=<isa>`` (see ``_ISAS``) gives the
#: kernels' own vectorised exp (``csrc/tiles.h``: the C library's exp is never vectorised
#: there) and their loops the chosen instruction set's vectors — by default the machine's
#: widest, each machine building its own copy. -fno-trapping-math (as PyTorch's own build):
#: vexp's range checks are thread-jumped into a branch around its polynomial, which only
#: AVX-512's masked instructions vectorise while floating-point traps must be kept — without
#: the flag an AVX2 build scores its tiles one entry at a time (7× slower; the results are the
#: same, IEEE arithmetic is unchanged). The mean field's iteration keeps its products and sums
#: unfused (-ffp-contract=off), as PyTorch's loop computes them
_FLAGS = {"key_bias": ["-march=native", "-fno-trapping-math"],
          "distance_table": ["-march=native", "-fno-trapping-math"],
          "block_support": ["-march=native", "-fno-trapping-math"],
          "mean_field": ["-march=native", "-fno-trapping-math", "-ffp-contract=off"]}
#: ``STRUCTATTN_KERNEL_ISA`` → (what replaces -march=native, the CPU flags it needs).
#: "avx2": x86-64-v3 (AVX2, FMA, BMI1/2, F16C, LZCNT, MOVBE: every AVX2 CPU of Intel since
#: Haswell and of AMD since Zen), the code an AVX2-only machine builds, built side by side
#: with the native one on an AVX-512 machine (its own cache directory)
_ISAS = {"native": (None, ()),
         "avx2": ("-march=x86-64-v3", ("avx2", "fma", "bmi1", "bmi2", "f16c", "abm", "movbe"))}
_lock = threading.Lock()
#: kernel → its ops, why its build failed, whether it was tried
_states: dict = {k: {"ops": None, "error": None, "tried": False, "rules": False} for k in _KERNELS}


def _enabled() -> bool:
    return reading.context().kernels and os.environ.get("STRUCTATTN_KERNELS", "1") != "0"


@contextlib.contextmanager
def disabled():
    """Context manager: the Python loops, not the compiled kernels, inside this block.

    Per thread (``ReadingContext.kernels``).

    Yields:
        (None): the block runs with the kernels off.
    """
    with reading.entered(kernels=False):
        yield


def isa() -> str:
    """The instruction set the kernels are built for: ``STRUCTATTN_KERNEL_ISA``, "native"
    (the default: ``-march=native``, the machine's widest vectors) or "avx2" (x86-64-v3: AVX2
    and FMA, what an AVX2-only machine builds; refused on a CPU without them).

    Returns:
        str: "native" or "avx2".

    Raises:
        ValueError: an unknown ``STRUCTATTN_KERNEL_ISA``, or "avx2" on a CPU that lacks it.
    """
    chosen = os.environ.get("STRUCTATTN_KERNEL_ISA", "native").strip().lower() or "native"
    if chosen not in _ISAS:
        raise ValueError(f"STRUCTATTN_KERNEL_ISA: expected one of {sorted(_ISAS)}, got "
                         f"{chosen!r}")
    missing = [f for f in _ISAS[chosen][1] if f not in _machine().split()]
    if missing:
        raise ValueError(f"STRUCTATTN_KERNEL_ISA={chosen}: this CPU lacks {', '.join(missing)} "
                         f"(its flags: /proc/cpuinfo); expected a CPU with "
                         f"{', '.join(_ISAS[chosen][1])}, or STRUCTATTN_KERNEL_ISA=native")
    return chosen


def _flags(kernel: str) -> list:
    """``kernel``'s compiler flags beyond -O3 -fopenmp, for the chosen instruction set."""
    march = _ISAS[isa()][0]
    flags = _FLAGS.get(kernel, [])
    return [march if march and f == "-march=native" else f for f in flags]


def _machine() -> str:
    """What a ``-march=native`` build depends on: the CPU's instruction-set flags."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), platform.machine())
    except OSError:
        return platform.machine() + platform.processor()


def cache_directory(kernel: str) -> str:
    """Where ``kernel``'s library is built and kept: ``<root>/structattn/<name>-<key>``.

    The root is ``TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``. The key hashes what
    the library depends on — its source and the headers, the compiler flags, torch's version
    and C++ ABI, Python's, the CPU's flags — and nothing of the environment's paths: a second
    virtual environment with the same torch finds it built, one with another torch builds
    its own.

    Args:
        kernel (str): the kernel, "mean_field", "stick_breaking", "key_bias",
            "distance_table" or "block_support".

    Returns:
        str: the directory's path (it need not exist yet).
    """
    source, name, _ = _KERNELS[kernel]
    csrc = os.path.join(os.path.dirname(__file__), "csrc")
    with open(os.path.join(csrc, source), "rb") as f:
        digest = hashlib.sha256(f.read())
    for header in sorted(n for n in os.listdir(csrc) if n.endswith(".h")):  # what it includes
        with open(os.path.join(csrc, header), "rb") as f:
            digest.update(f.read())
    for part in (*_flags(kernel), torch.__version__, str(torch._C._GLIBCXX_USE_CXX11_ABI),
                 sys.version, _machine()):
        digest.update(part.encode())
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "torch_extensions")
    return os.path.join(root, "structattn", f"{name}-{digest.hexdigest()[:16]}")


@contextlib.contextmanager
def _exclusive(where: str):
    """Hold ``where/.lock`` exclusively: processes that first call a kernel at once (DDP ranks,
    pytest-xdist workers) build it once, the others waiting and then loading it, never a
    library half written. Where the lock cannot be taken (a read-only cache, no ``fcntl``),
    nothing is held."""
    try:
        import fcntl

        os.makedirs(where, exist_ok=True)
        lock = open(os.path.join(where, ".lock"), "a")  # noqa: SIM115 (closed below)
    except (ImportError, OSError):
        yield
        return
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
    finally:
        lock.close()  # releases the lock


def _build(kernel: str = "mean_field"):
    """Load ``kernel``'s library from its cache directory, building it there first if it is
    not yet built (torch's C++ extension loader: about a minute), under the directory's lock."""
    from torch.utils.cpp_extension import load

    source, name, _ = _KERNELS[kernel]
    where = cache_directory(kernel)
    library = os.path.join(where, f"{name}.so")
    with _exclusive(where):
        if os.path.exists(library):
            torch.ops.load_library(library)
            return getattr(torch.ops, name)
        print(f"structattn: building the compiled {kernel.replace('_', '-')} kernel (about a "
              f"minute, once per torch version) in {where}", file=sys.stderr, flush=True)
        os.makedirs(where, exist_ok=True)
        with warnings.catch_warnings():  # the loader's own notes (compiler version, ABI)
            warnings.simplefilter("ignore")
            # -fopenmp: at::parallel_for spreads the work over torch's intra-op threads
            load(name=name, sources=[os.path.join(os.path.dirname(__file__), "csrc", source)],
                 extra_cflags=["-O3", "-fopenmp", *_flags(kernel)],
                 extra_ldflags=["-fopenmp"], build_directory=where,
                 is_python_module=False, verbose=False)
    return getattr(torch.ops, name)


def build() -> int:
    """Build (or find built) every kernel, printing where each is or why it is not.

    What ``python -m structattn.kernels build`` runs, for set-up scripts.

    Returns:
        int: how many kernels are not built (0: all ready).
    """
    failed = 0
    for kernel in _KERNELS:
        ops = _ops(kernel)
        state = _states[kernel]
        if ops is None:
            failed += 1
            why = state["error"] or "kernels are off (STRUCTATTN_KERNELS=0)"
            print(f"structattn: {kernel}: not built: {why.splitlines()[0][:300]}")
        else:
            print(f"structattn: {kernel}: ready in {cache_directory(kernel)}")
    return failed


def _ops(kernel: str):
    """A kernel's ops, built on first use; None where kernels are off or the build failed.
    Under ``torch.compile`` nothing is built (dynamo cannot enter the build's lock): a graph
    traced before any eager call has loaded the kernel uses the Python reading."""
    if not _enabled():
        return None
    state = _states[kernel]
    if not state["tried"] and not torch.compiler.is_compiling():
        with _lock:
            if not state["tried"]:
                try:
                    state["ops"] = _build(kernel)
                except Exception as err:  # no compiler, no ninja, a read-only cache …
                    state["error"] = f"{type(err).__name__}: {err}"
                    warnings.warn(f"structattn: the compiled {kernel.replace('_', '-')} kernel "
                                  f"could not be built ({state['error'].splitlines()[0][:300]}); "
                                  f"{_KERNELS[kernel][2]} (same results, slower). "
                                  f"Set STRUCTATTN_KERNELS=0 to silence this.", RuntimeWarning,
                                  stacklevel=4)
                state["tried"] = True
    return state["ops"]


def with_rules(kernel: str, register):
    """A kernel's ops, its Python rules registered on them once per process.

    Args:
        kernel (str): the kernel, "mean_field", "stick_breaking", "key_bias",
            "distance_table" or "block_support" (built on first use).
        register (Callable): called with the ops the first time only, to register their
            Python rules (fake kernels, an autograd formula).

    Returns:
        (object | None): the kernel's ops, or None where kernels are off or the build failed (``register``
            is then not called).
    """
    ops = _ops(kernel)
    if ops is None:
        return None
    state = _states[kernel]
    if not state["rules"]:
        with _lock:
            if not state["rules"]:
                register(ops)
                state["rules"] = True
    return ops


def mean_field_windows():
    """The mean-field kernel's ops, built on first use.

    Returns:
        (object | None): the ops (``solve``, ``attend``), or None where kernels are off or the build failed
            (then: one ``RuntimeWarning`` saying why, and the Python loop).
    """
    return _ops("mean_field")


def stick_breaking():
    """The stick-breaking kernel's ops, built on first use.

    Returns:
        (object | None): the ops (``forward``, ``backward``), or None where kernels are off or the build
            failed (then: one ``RuntimeWarning`` saying why, and the dense reading).
    """
    return _ops("stick_breaking")


def key_bias():
    """The key-bias kernel's ops: attention with a per-parent term, and its gradient.

    Returns:
        (object | None): the ops (``forward``, ``backward``), or None where kernels are off or the build
            failed (then: one ``RuntimeWarning`` saying why, and the widened head).
    """
    return _ops("key_bias")


def distance_table():
    """The distance-table kernel's ops: attention under a log prior of i − j alone.

    Returns:
        (object | None): the ops (``forward``, ``backward``), or None where kernels are off or
            the build failed (then: one ``RuntimeWarning`` saying why, and the prior's dense
            table).
    """
    return _ops("distance_table")


def block_support():
    """The block-support kernel's ops: attention over a support's listed tiles, and its
    gradient.

    Returns:
        (object | None): the ops (``forward``, ``backward``), or None where kernels are off or the build
            failed (then: one ``RuntimeWarning`` saying why, and the Python loop).
    """
    return _ops("block_support")


def available() -> bool:
    """Whether the compiled kernels are on and built, building them if need be.

    Returns:
        bool: True where all five kernels can be called.
    """
    return (mean_field_windows() is not None and stick_breaking() is not None
            and key_bias() is not None and distance_table() is not None
            and block_support() is not None)


def build_error() -> str | None:
    """Why a kernel's build failed.

    Returns:
        str | None: the build errors, joined by "; ", or None where none failed.
    """
    errors = [s["error"] for s in _states.values() if s["error"]]
    return "; ".join(errors) if errors else None


def main(argv=None) -> int:
    """``python -m structattn.kernels build``: build the kernels ahead of their first use."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m structattn.kernels",
                                     description="The compiled CPU kernels of structattn.")
    parser.add_argument("command", choices=["build"], help="build (or find built) every kernel")
    parser.parse_args(argv)
    return 1 if build() else 0


if __name__ == "__main__":
    sys.exit(main())
