#!/usr/bin/env bash
# The checks that need a CUDA device, in one run on a GPU machine (../shared/GPU.md):
#   1. the CUDA tests (tests/test_cuda.py: the catalogue against Pyro on the GPU, against the
#      CPU, replayed, in float32/bfloat16; tests/test_torch_compile.py's CUDA cases: one dynamo
#      graph, inductor; FlexAttention's path);
#   2. the Triton kernels' tests on CUDA (tests/triton);
#   3. the GPU benchmarks: the Triton kernels against FLA and FlashAttention, per-call cost,
#      large self-attention fwd+bwd, the distance priors.
# That machine has torch with CUDA but no network: Pyro, ArviZ and the other pure-Python
# wheels travel in .gpu-wheels (made here with
#   python -m pip download --no-deps -d .gpu-wheels pyro-ppl pyro-api graphviz arviz \
#       xarray-einstats h5netcdf slot-attention einx frozendict vector-quantize-pytorch \
#       loguru torch-einops-utils fla-core
# — five of them are what slot-attention imports; fla-core carries the authors' Triton kernels
# of FoX and stick-breaking that benchmarks/bench_gpu_kernels.py compares against). Logs go to $OUT (default gpu-out/). Each step has its own time limit, so one that stalls
# does not take the others' results with it.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# the CPU kernels are not what is checked here, and building them costs a minute a kernel
export STRUCTATTN_KERNELS=0
PY="${PYTHON:-python3}"

{ nvidia-smi -L; "$PY" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"; } \
  2>&1 | tee "$OUT/machine.txt"
if [ -d .gpu-wheels ]; then
  "$PY" -m pip install -q --no-deps --no-index .gpu-wheels/*.whl 2>&1 | tail -3
fi
"$PY" -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3

step() {  # step NAME SECONDS COMMAND...: run with a limit, log to $OUT/NAME.txt
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit}s)"
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.txt" | tail -40
  echo "== $name: exit ${PIPESTATUS[0]}"
}

step tests "${TESTS_S:-240}" "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_torch_compile.py \
  tests/models/test_expanding_attention.py -k "cuda" --durations=5
# the Triton kernels on CUDA tensors (elsewhere they run under the interpreter)
step triton "${TRITON_S:-240}" "$PY" -m pytest -q -p no:cacheprovider tests/triton --durations=5
# against FLA (fla-core in .gpu-wheels) and FlashAttention: time and peak memory
step gpu_kernels "${GPU_KERNELS_S:-240}" "$PY" benchmarks/bench_gpu_kernels.py \
  --json "$OUT/gpu_kernels.json"
step per_call "${PER_CALL_S:-150}" "$PY" benchmarks/bench_per_call.py --device cuda \
  --json "$OUT/per_call.json"
step attention "${ATTENTION_S:-60}" "$PY" benchmarks/bench_attention.py --device cuda \
  --json "$OUT/attention.json"
step distance_priors "${DISTANCE_S:-150}" "$PY" benchmarks/bench_distance_priors.py --device cuda \
  --long --json "$OUT/distance_priors.json"
