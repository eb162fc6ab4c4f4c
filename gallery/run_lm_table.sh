#!/usr/bin/env bash
# The language-model table: every variant × seed trained for the same minutes on this machine,
# read on every validation byte at 512 … 16,384 bytes, then probed (certified and credible
# windows, passkey: gallery/lm_probes.py). Resumable: what gallery/results/lm_table/ holds is
# skipped, a finished run's result is copied there, an interrupted run continues from its
# checkpoint. A file gallery/output/lm_table/HOLD pauses it before the next run starts (the
# runs' minutes are wall-clock: keep the machine otherwise quiet while one trains).
# Usage: gallery/run_lm_table.sh [variant ...]   (env: SEEDS, MINUTES, THREADS)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
SEEDS=${SEEDS:-"0 1"}
MINUTES=${MINUTES:-30}
THREADS=${THREADS:-2}
VARIANTS=("$@")
if [ ${#VARIANTS[@]} -eq 0 ]; then
  VARIANTS=(rope fox alibi causal stick_breaking fox+rope gaussian expanding_mf)
fi
keep=gallery/results/lm_table
mkdir -p "$keep"
for seed in $SEEDS; do
  for v in "${VARIANTS[@]}"; do
    out="gallery/output/lm_table/seed${seed}"
    run="$out/${v}_T512"
    if [ ! -e "$keep/${v}_seed${seed}.json" ]; then
      if [ ! -e "$run/result.json" ]; then
        while [ -e gallery/output/lm_table/HOLD ]; do sleep 10; done
        "$PY" gallery/train_lm.py --attention "$v" --context 512 --steps 1000000 \
          --minutes "$MINUTES" --seed "$seed" --eval-every 500 --eval-windows 16 \
          --save-every 500 --eval-lengths 512 2048 8192 16384 --threads "$THREADS" \
          --out "$out" --resume
      fi
      cp "$run/result.json" "$keep/${v}_seed${seed}.json"
    fi
    if [ ! -e "$keep/${v}_seed${seed}_probes.json" ]; then
      "$PY" gallery/lm_probes.py "$run" --threads "$THREADS" \
        --json "$keep/${v}_seed${seed}_probes.json"
    fi
  done
done
