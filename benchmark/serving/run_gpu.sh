#!/usr/bin/env bash
# One device call: stage the runtime (gpu_env.sh), then run the serving driver given as arguments
# with --out $OUT, e.g.
#   bash benchmark/serving/run_gpu.sh benchmark/serving/one_batch.py --contexts 32768
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh" || exit 3
python3 "$@" --out "$OUT" 2>&1 | tee "$OUT/driver.log"
