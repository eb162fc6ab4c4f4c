"""The compiled kernels' cache (structattn.kernels.cache_directory): keyed by what a library
depends on, not by the environment it was built from; ``python -m structattn.kernels build``.
(A second virtual environment finding the first one's build: tests/test_wheel.py.)"""

import os
import subprocess
import sys

import torch

from structattn import kernels


def test_the_cache_key_follows_torch_and_the_source_not_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    here = kernels.cache_directory("stick_breaking")
    assert here.startswith(str(tmp_path / "structattn" / "structattn_stick_breaking-"))
    monkeypatch.setattr(sys, "prefix", "/elsewhere/venv")  # another environment: the same key
    monkeypatch.setattr(sys, "executable", "/elsewhere/venv/bin/python")
    assert kernels.cache_directory("stick_breaking") == here
    monkeypatch.setattr(torch, "__version__", "0.0.0-other")  # another torch: its own build
    assert kernels.cache_directory("stick_breaking") != here
    assert len({kernels.cache_directory(k) for k in kernels._KERNELS}) == len(kernels._KERNELS)


def test_the_build_command_names_each_kernel(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "structattn.kernels", "build"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=900,
                          env={**os.environ, "STRUCTATTN_KERNELS": "0"})
    # kernels off: nothing is built, each says why, and the command fails
    assert proc.returncode == 1
    for kernel in kernels._KERNELS:
        assert f"structattn: {kernel}: not built: kernels are off" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "structattn.kernels", "build"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for kernel in kernels._KERNELS:
        assert f"structattn: {kernel}: ready in {kernels.cache_directory(kernel)}" in proc.stdout


def test_callers_starting_at_once_build_a_kernel_once_and_load_it_whole(monkeypatch, tmp_path):
    """Two callers finding no library at the same moment (DDP ranks, pytest-xdist workers):
    one builds under the cache directory's lock; the other waits, then loads the finished
    library — never one the linker is still writing."""
    import threading
    import time

    import torch.utils.cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    builds, loads = [], []

    def build(name, sources, build_directory, **_):  # a link that takes a while
        builds.append(name)
        with open(os.path.join(build_directory, f"{name}.so"), "w") as f:
            f.write("half")
            f.flush()
            time.sleep(0.3)
            f.write(" whole")

    def load_library(path):
        with open(path) as f:
            loads.append(f.read())

    monkeypatch.setattr(torch.utils.cpp_extension, "load", build)
    monkeypatch.setattr(torch.ops, "load_library", load_library)
    together = threading.Barrier(2)

    def call():
        together.wait()
        kernels._build("stick_breaking")

    threads = [threading.Thread(target=call) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert builds == ["structattn_stick_breaking"]
    assert loads == ["half whole"]
