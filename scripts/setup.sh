#!/usr/bin/env bash
# Set up everything structattn needs on a fresh machine (Python 3.10+):
#   - the graphviz `dot` program (apt-get, when missing and apt is available);
#   - a virtual environment in .venv with torch installed FIRST at a pinned version
#     (TORCH_SPEC, default torch==2.13.0: on our CPU machines that is a local CPU wheel,
#     whereas an unpinned torch pulls a multi-GB CUDA build);
#   - Triton (TRITON_SPEC, default triton==3.9.0), whose interpreter runs the GPU kernels' tests;
#   - structattn itself, editable, with its dev, gpu and transformers extras (pytest,
#     hypothesis, ruff, build; Hugging Face transformers for structattn.integrations);
#   - the compiled CPU kernels (structattn/csrc, built once per torch version; needs g++);
#   - Inductor's own first compile on this machine (torch.compile's cache, see below).
# Safe to run again: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v dot >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
    echo "setup: installing graphviz (dot) with apt-get"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq graphviz >/dev/null
  else
    echo "setup: WARNING: graphviz 'dot' not found and no apt-get; install graphviz yourself" \
         "(macOS: brew install graphviz). Drawing to files will raise a clear error until then." >&2
  fi
fi

# A C++ compiler for the compiled kernel (structattn/csrc); without one the library runs its
# Python loop instead, and the kernel's tests say so.
if ! command -v g++ >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  echo "setup: installing g++ with apt-get (for the compiled kernel)"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq g++ >/dev/null
fi

PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  echo "setup: installing ${TORCH_SPEC:-torch==2.13.0}"
  "${PIP[@]}" "${TORCH_SPEC:-torch==2.13.0}"
fi
# Triton: the GPU kernels' compiler, pinned like torch (the tests run its kernels on the CPU
# under its interpreter); the gpu extra below then finds it installed.
if ! .venv/bin/python -c "import triton" >/dev/null 2>&1; then
  echo "setup: installing ${TRITON_SPEC:-triton==3.9.0}"
  "${PIP[@]}" "${TRITON_SPEC:-triton==3.9.0}"
fi
# Re-running is cheap: the editable install is redone only when pyproject.toml changed.
STAMP=.venv/.structattn-installed
WANT="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ] \
    || ! .venv/bin/python -c "import structattn" >/dev/null 2>&1; then
  echo "setup: installing structattn (editable) with its dev, gpu and transformers extras"
  "${PIP[@]}" -e ".[dev,gpu,transformers]"
  echo "$WANT" > "$STAMP"
else
  echo "setup: structattn already installed for this pyproject.toml"
fi
# The compiled CPU kernels: built once per torch version (about a minute each) and kept under
# ~/.cache/torch_extensions/structattn, shared by every environment with the same torch;
# without them the library uses its Python readings (slower) and says so.
if ! .venv/bin/python -m structattn.kernels build; then
  echo "setup: WARNING: a compiled kernel could not be built (a C++ compiler is needed);" \
       "the library uses its Python readings instead" >&2
fi
# On a machine with AVX2, the AVX2 build too (STRUCTATTN_KERNEL_ISA=avx2, -march=x86-64-v3,
# its own cache directory): tests/test_kernel_isa.py holds it to the same references as the
# native build, and would otherwise build it inside the test run.
if grep -qw avx2 /proc/cpuinfo 2>/dev/null; then
  STRUCTATTN_KERNEL_ISA=avx2 .venv/bin/python -m structattn.kernels build \
    || echo "setup: WARNING: the AVX2 build of the kernels failed (its test builds it)" >&2
fi
# Inductor's first compile on a machine (torch.compile's default backend; its cache in
# /tmp/torchinductor_$USER) sets up what every later one reuses: a few seconds that the suite's
# first torch.compile test would otherwise pay (each test still compiles its own graphs).
INDUCTOR_CACHE="${TORCHINDUCTOR_CACHE_DIR:-${TMPDIR:-/tmp}/torchinductor_$(id -un)}"
if [ ! -d "$INDUCTOR_CACHE/fxgraph" ] && ! .venv/bin/python -c \
    "import torch; torch.compile(lambda x: x.sin().sum(-1))(torch.ones(2, 4))" >/dev/null 2>&1
then
  echo "setup: WARNING: torch.compile (Inductor) failed here; its tests will say why" >&2
fi
echo "setup: done ($(.venv/bin/python -c 'import torch, pyro; print("torch", torch.__version__, "pyro", pyro.__version__)'))"
