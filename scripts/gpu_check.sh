#!/usr/bin/env bash
# The checks that need a CUDA device, in one run on a GPU machine (../shared/GPU.md):
#   1. the Triton kernels' tests on CUDA (tests/triton);
#   2. the CUDA tests (tests/test_cuda.py: the catalogue against Pyro on the GPU, against the
#      CPU, replayed, in float32/bfloat16, checks that never wait for the GPU;
#      tests/test_torch_compile.py's CUDA cases: one dynamo graph, inductor; FlexAttention's
#      path);
#   3. the catalogue's causal layers as compiled, bfloat16, against the same projections around
#      causal SDPA and FLA's kernels (benchmarks/bench_gpu_layers.py: gpu_layers.json);
#   4. the byte-level language model, two variants a minute each in bfloat16 (autocast) on the
#      corpus the LM table used, carried as gallery/corpus/stdlib.corpus.gz;
#   5. (off unless its limits are given: FLEX_TESTS_S=120 FLEX_S=300, with steps 1-4 at 0 on a
#      machine of its own, fits 15 minutes) FlexAttention's reading of the declared priors and
#      supports: its CUDA tests (tests/kinds/test_flex_reading.py: the reading selected, equal
#      to the readings without it, gradients of the prior's parameters included), then
#      benchmarks/bench_declared.py --device cuda: each declared case at 2,048, 8,192 and 16,384
#      tokens with and without FlexAttention (a Triton kernel, the rows reading or the dense
#      table), the reading each took, time and peak memory (declared_cuda.json), no case
#      started after FLEX_BUDGET_S;
#   6. (off unless their limits are given, e.g. GPU_KERNELS_S=230: their records are committed)
#      the key-bias kernel's launch settings (benchmarks/tune_key_bias.py), then the Triton
#      kernels against FLA and FlashAttention with them (benchmarks/bench_gpu_kernels.py);
#      checks on and off, per-call cost, the distance priors' and expanding attention's layers
#      with --device cuda, and where expanding attention's mean field spends its time
#      (benchmarks/profile_expanding.py, PROFILE_S).
# The default limits add up to 8 minutes 40 seconds (steps 1-4), which leaves a lent machine's 15 minutes
# room to start and to rerun a step. Carry .gpu-wheels and gallery/corpus (the corpus, ~6 MB:
# python gallery/train_lm.py --write-corpus, on Python 3.11.7, writes it).
# The device tool brings back at most eight files: wrap $OUT in one archive afterwards.
# That machine has torch with CUDA but no network: Pyro, ArviZ and the other pure-Python
# wheels travel in .gpu-wheels (made here with
#   python -m pip download --no-deps -d .gpu-wheels pyro-ppl pyro-api graphviz arviz \
#       xarray-einstats h5netcdf slot-attention einx frozendict vector-quantize-pytorch \
#       loguru torch-einops-utils fla-core pytest-xdist execnet
# — five of them are what slot-attention imports; fla-core carries the authors' Triton kernels
# of FoX and stick-breaking that benchmarks/bench_gpu_kernels.py compares against). Logs go to
# $OUT (default gpu-out/). Each step has its own time limit, so one that stalls does not take
# the others' results with it; the steps come in the order of what they settle: the kernels'
# correctness on CUDA, the layers on CUDA against SDPA and the authors' kernels, the language
# model on the GPU, then (when asked) the kernels alone, per-call cost and the other layers.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"

{ nvidia-smi -L; "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', \
triton.__version__, torch.cuda.get_device_name())"; } 2>&1 | tee "$OUT/machine.txt"
if [ -d .gpu-wheels ]; then
  "$PY" -m pip install -q --no-deps --no-index .gpu-wheels/*.whl 2>&1 | tail -3
fi
"$PY" -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3
# the CPU kernels (the CPU twins some tests compare against) build in the background meanwhile
timeout 300 "$PY" -m structattn.kernels build > "$OUT/kernels_build.txt" 2>&1 &

# pytest-xdist where it is installed: the Triton kernels compile per size and dtype, in parallel
# (pytest-benchmark, where installed, refuses to run beside it: off); without it, pyproject's
# addopts (-n auto) are replaced by the same options less -n
if "$PY" -c "import xdist" 2>/dev/null; then XDIST=(-n 8); else XDIST=(-o "addopts=-ra -m 'not slow'"); fi

step() {  # step NAME SECONDS COMMAND...: run with a limit (0: skip), log to $OUT/NAME.txt
  local name=$1 limit=$2; shift 2
  [ "$limit" = 0 ] && { echo "== $name: skipped (limit 0)"; return; }
  echo "== $name (limit ${limit}s) $(date +%T)"
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.txt" | tail -"${TAIL:-25}"
  echo "== $name: exit ${PIPESTATUS[0]} $(date +%T)"
}

# the Triton kernels on CUDA tensors (elsewhere they run under the interpreter): among them
# the generalised Gaussian's kernel, the certificate read from the band's log-sums and the
# float32 solve against the CPU kernel (a threshold tie compared at its own step)
step triton "${TRITON_S:-150}" "$PY" -m pytest -q -p no:cacheprovider -p no:benchmark "${XDIST[@]}" \
  ${TRITON_TESTS:-tests/triton} --durations=5
step tests "${TESTS_S:-90}" "$PY" -m pytest -q -p no:cacheprovider -p no:benchmark "${XDIST[@]}" \
  ${CUDA_TESTS:-tests/test_cuda.py tests/test_torch_compile.py tests/models/test_expanding_attention.py} \
  -k "cuda" --durations=5
# the compiled layers as a user builds them (projections included, bfloat16 parameters, B=2,
# H=8, d=64, N = 1,024, 4,096, 16,384) against causal SDPA and FLA around the same
# projections: time (CUDA events) and peak memory; each N is saved as it ends, and no N starts
# after LAYERS_BUDGET_S
step layers "${LAYERS_S:-120}" "$PY" benchmarks/bench_gpu_layers.py --device cuda \
  --dtype "${LAYERS_DTYPE:-bfloat16}" ${LAYERS_SIZES:+--sizes $LAYERS_SIZES} \
  --budget "${LAYERS_BUDGET_S:-75}" --json "$OUT/gpu_layers.json"
# the byte-level language model on the GPU (gallery/train_lm.py --device cuda --dtype bfloat16,
# the forward under autocast), LM_MINUTES each, on the carried corpus (refused if its hash is
# not the LM table's); its table and result files land in $OUT/lm (each variant's result.json,
# read at 512 … 16,384 bytes, goes into gallery/lm_table.py --runs DIR as
# DIR/<variant>_seed0.json)
step lm "${LM_S:-160}" "$PY" gallery/train_lm.py --device cuda --dtype bfloat16 \
  --corpus "${LM_CORPUS:-gallery/corpus/stdlib.corpus.gz}" --attention ${LM_VARIANTS:-rope fox} \
  --context 512 --steps 1000000 --minutes "${LM_MINUTES:-1}" --eval-every 500 --eval-windows 16 \
  --eval-lengths 512 2048 8192 16384 --out "$OUT/lm"
# FlexAttention's reading on CUDA: which route serves each declared case is measured here
step flex_tests "${FLEX_TESTS_S:-0}" "$PY" -m pytest -q -p no:cacheprovider -p no:benchmark \
  -o "addopts=-ra" tests/kinds/test_flex_reading.py -k cuda --durations=5
step flex "${FLEX_S:-0}" "$PY" benchmarks/bench_declared.py --device cuda \
  --sizes ${FLEX_SIZES:-2048 8192 16384} --budget "${FLEX_BUDGET_S:-240}" --reps "${FLEX_REPS:-10}" \
  ${FLEX_CASES:+--cases $FLEX_CASES} --json "$OUT/declared_cuda.json"
# the key-bias kernel's launch settings, one kernel at a time; then against FLA (fla-core in
# .gpu-wheels) and FlashAttention, with those settings: time and peak memory
step tune "${TUNE_S:-0}" "$PY" benchmarks/tune_key_bias.py --json "$OUT/tuned.json" \
  --budget "${TUNE_BUDGET_S:-90}"
step gpu_kernels "${GPU_KERNELS_S:-0}" "$PY" benchmarks/bench_gpu_kernels.py \
  --tuned "$OUT/tuned.json" --dtypes ${GPU_DTYPES:-bfloat16 float32} ${GPU_SIZES:+--sizes $GPU_SIZES} \
  --json "$OUT/gpu_kernels.json"
step per_call "${PER_CALL_S:-0}" "$PY" benchmarks/bench_per_call.py --device cuda \
  ${PER_CALL_SKIP:+--skip $PER_CALL_SKIP} --json "$OUT/per_call.json"
step attention "${ATTENTION_S:-0}" "$PY" benchmarks/bench_attention.py --device cuda \
  --json "$OUT/attention.json"
step distance_priors "${DISTANCE_S:-0}" "$PY" benchmarks/bench_distance_priors.py --device cuda \
  --sizes ${DISTANCE_SIZES:-1024 4096 16384} ${DISTANCE_VARIANTS:+--variants $DISTANCE_VARIANTS} \
  --json "$OUT/distance_priors.json"
# expanding attention's mean field on CUDA: the Triton solve and band per child, against
# causal SDPA and the Python loop
step expanding "${EXPANDING_S:-0}" "$PY" benchmarks/bench_expanding.py --device cuda \
  --sizes ${EXPANDING_SIZES:-4096 16384} --repeats ${EXPANDING_REPEATS:-3} \
  --json "$OUT/expanding.json"
# where expanding attention's mean field spends its time (the solve, the band per child's
# forward and backward, its db and du per block of parents against the atomic adds), on the
# benchmark's input at N = 16,384, the solve's default settings only
step profile_expanding "${PROFILE_S:-0}" "$PY" benchmarks/profile_expanding.py --no-sweep \
  --json "$OUT/profile_expanding.json"
