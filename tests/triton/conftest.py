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
