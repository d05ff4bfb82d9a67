#!/usr/bin/env bash
# The accuracy table of docs/results/accuracy.md, all on CPU (hours on 2 cores: NIAH at 8k dominates;
# the GPU machine does the NIAH stage in minutes: benchmark/run_gpu_accuracy.sh). Calibrate every
# method once (windows of the model's 8k context), then PPL + attention KL beside NIAH, then the report.
#   OUT_DIR   working directory (default runs/acc_full; bundles, ppl.json, niah_*.json)
#   LENGTHS   NIAH context lengths (default 2048 4096 8192), one process each after PPL
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
OUT=${OUT_DIR:-runs/acc_full}
mkdir -p "$OUT"
run() { python -m sglang_oscar.eval.compare --out-dir "$OUT" --quiet "$@"; }
[ -f "$OUT/calibrate.json" ] || run --stage calibrate --threads 2 2>&1 | tee "$OUT/calibrate.log"
run --stage ppl --threads 1 > "$OUT/ppl.log" 2>&1 &
ppl=$!
for L in ${LENGTHS:-2048 4096 8192}; do
    run --stage niah --threads 1 --niah-lengths "$L" --niah-tag "_$L" 2>&1 | tee -a "$OUT/niah.log"
done
wait "$ppl"
run --stage report --json benchmark/results/accuracy_smollm2.json --md docs/results/accuracy_table.md \
    --plot docs/results/accuracy_smollm2.png
