"""The compiled kernels built for a chosen instruction set (``STRUCTATTN_KERNEL_ISA``,
``structattn.kernels.isa``): each build lives in its own cache directory, an unknown choice
or one the CPU lacks is refused, and the AVX2 build (x86-64-v3) passes the same
kernel-against-reference tests, to the same tolerances, as the native one.

The two builds register the same ``torch.ops`` namespaces, so one process loads one of
them: the AVX2 build's tests run in a subprocess. ``scripts/setup.sh`` builds it ahead on any
machine that has AVX2 (its flags differ from a native build's, so it has a cache directory of
its own even there); where it is absent the subprocess builds it (about a minute per kernel).
"""

import os
import subprocess
import sys

import pytest

from structattn import kernels

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: the tests that hold the kernels to their references (float64 softmax written out and its
#: autograd, gradcheck, Pyro's enumeration; the mean field's Python loop), as they stand
AGAINST_REFERENCES = [
    "tests/kinds/test_key_bias.py::test_equals_softmax_written_out_and_the_widened_path",
    "tests/kinds/test_key_bias.py::test_gradients_equal_those_of_softmax_written_out",
    "tests/kinds/test_key_bias.py::test_gradcheck",
    "tests/kinds/test_key_bias.py::test_a_band_per_head_equals_softmax_written_out",
    "tests/kinds/test_key_bias.py::test_a_band_per_head_gradcheck_and_opcheck",
    "tests/test_kernels.py::test_kernel_equals_the_loop",
    "tests/test_kernels.py::test_grad_last_gradients_equal_the_loop",
    "tests/test_kernels.py::test_float32_and_bfloat16_agree_with_the_loop",
    "tests/test_kernels.py::test_band_per_child_equals_softmax_written_out",
    "tests/kinds/test_distance_table.py::test_op_equals_softmax_written_out_with_every_gradient",
    "tests/kinds/test_distance_table.py::test_gradcheck_through_the_op",
    "tests/kinds/test_block_support.py::test_the_kernel_equals_a_masked_softmax_with_its_gradients",
    "tests/kinds/test_block_support.py::test_gradcheck",
]

#: run in the subprocess: the AVX2 build loaded (built if absent), then the tests above in
#: that same process, so that they cannot fall back to the Python readings unnoticed
RUN = """
import sys
import pytest
from structattn import kernels
assert kernels.isa() == "avx2", kernels.isa()
assert kernels.available(), kernels.build_error()
for kernel in ("key_bias", "mean_field", "distance_table", "block_support"):
    print(f"{kernel}: {kernels.cache_directory(kernel)}", flush=True)
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-n", "0", *sys.argv[1:]]))
"""


def _flags():
    with open("/proc/cpuinfo") as f:
        return next((line for line in f if line.startswith("flags")), "").split()


def test_each_instruction_set_builds_in_its_own_directory(monkeypatch):
    monkeypatch.setattr(kernels, "_machine", lambda: "flags : avx2 fma bmi1 bmi2 f16c abm movbe")
    monkeypatch.delenv("STRUCTATTN_KERNEL_ISA", raising=False)
    assert kernels.isa() == "native"
    native = {k: kernels.cache_directory(k) for k in kernels._KERNELS}
    assert "-march=native" in kernels._flags("key_bias")
    monkeypatch.setenv("STRUCTATTN_KERNEL_ISA", "avx2")
    assert kernels.isa() == "avx2"
    assert "-march=x86-64-v3" in kernels._flags("key_bias")
    assert "-march=native" not in kernels._flags("mean_field")
    assert "-ffp-contract=off" in kernels._flags("mean_field")  # the other flags kept
    # the ISA enters the key of the kernels it compiles (stick-breaking has no -march)
    assert kernels.cache_directory("key_bias") != native["key_bias"]
    assert kernels.cache_directory("mean_field") != native["mean_field"]
    assert kernels.cache_directory("distance_table") != native["distance_table"]
    assert kernels.cache_directory("block_support") != native["block_support"]
    assert kernels.cache_directory("stick_breaking") == native["stick_breaking"]


def test_an_unknown_or_missing_instruction_set_is_refused(monkeypatch):
    monkeypatch.setenv("STRUCTATTN_KERNEL_ISA", "avx9")
    with pytest.raises(ValueError, match=r"STRUCTATTN_KERNEL_ISA: expected one of \['avx2', "
                                         r"'native'\], got 'avx9'"):
        kernels.isa()
    monkeypatch.setenv("STRUCTATTN_KERNEL_ISA", "avx2")
    monkeypatch.setattr(kernels, "_machine", lambda: "flags : sse2 avx fma")
    with pytest.raises(ValueError, match="this CPU lacks avx2, bmi1"):
        kernels.isa()


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.uname().machine != "x86_64",
                    reason="an x86-64 Linux host (its CPU flags read from /proc/cpuinfo)")
def test_the_avx2_build_passes_the_kernels_tests_against_their_references(monkeypatch):
    if not {"avx2", "fma"} <= set(_flags()):
        pytest.skip("this CPU has no AVX2: the AVX2 build cannot run here")
    env = {**os.environ, "STRUCTATTN_KERNEL_ISA": "avx2", "STRUCTATTN_KERNELS": "1"}
    proc = subprocess.run([sys.executable, "-c", RUN, *AGAINST_REFERENCES], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert " passed" in last and "failed" not in last and "skipped" not in last, last
    monkeypatch.setenv("STRUCTATTN_KERNEL_ISA", "avx2")  # the AVX2 build's directories
    for kernel in ("key_bias", "mean_field", "distance_table", "block_support"):
        assert f"{kernel}: {kernels.cache_directory(kernel)}\n" in proc.stdout
