"""The Triton kernels' tests run on any machine: without a CUDA device, Triton's interpreter
runs them on CPU tensors (set by tests/conftest.py, and here again for a run of this folder
alone, before anything imports Triton's decorators). Without Triton installed (the ``gpu``
extra) they skip and say so."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    from structattn import triton_kernels

    if triton_kernels.available():
        return
    skip = pytest.mark.skip(reason="Triton is not installed (pip install structattn[gpu]); "
                                   "its kernels are not tested here")
    for item in items:
        if "tests/triton/" in str(item.fspath):
            item.add_marker(skip)


def _patch_the_language_once_a_launch():
    """Triton's interpreter patches ``triton.language`` for the kernel it launches (and puts
    it back after), then again at every call of a device function inside that kernel
    (``InterpretedFunction.__call__``: every builtin of the module wrapped anew, ~0.3 ms a
    call, the patch never put back) — ~1,400 calls of ``tl.zeros`` alone in one gradient
    test. Within a launch, a module patched once stays patched: a device call whose modules
    (``triton.language``, ``triton.language.core``) all are skips the patch."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:  # no Triton: its tests skip
        return
    patch, launch = interpreter._patch_lang, interpreter.GridExecutor.__call__
    patched: set = set()  # the modules patched in the launch under way (empty between)

    def _patch_lang(fn):
        langs = {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}
        if patched and langs <= patched:
            return interpreter._LangPatchScope()
        scope = patch(fn)
        patched.update(langs)
        return scope

    def __call__(self, *args, **kwargs):
        patched.clear()  # the launch's own patch is always made
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.clear()

    interpreter._patch_lang, interpreter.GridExecutor.__call__ = _patch_lang, __call__


_patch_the_language_once_a_launch()
