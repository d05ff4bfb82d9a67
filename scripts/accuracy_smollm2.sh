#!/usr/bin/env bash
# The full accuracy table of docs/results/accuracy.md (about an hour on 2 CPU cores):
# calibrate every method once, then perplexity+KL and NIAH in two parallel processes, then report.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
OUT=${OUT_DIR:-runs/accuracy}
mkdir -p "$OUT"
run() { python -m sglang_oscar.eval.compare --out-dir "$OUT" --quiet "$@"; }
run --stage calibrate --threads 2 2>&1 | tee "$OUT/calibrate.log"
run --stage ppl --threads 1 > "$OUT/ppl.log" 2>&1 &
ppl_pid=$!
run --stage niah --threads 1 > "$OUT/niah.log" 2>&1 &
niah_pid=$!
wait $ppl_pid
wait $niah_pid
run --stage report --json benchmark/results/accuracy_smollm2.json --md docs/results/accuracy_table.md \
    --plot docs/results/accuracy_smollm2.png
