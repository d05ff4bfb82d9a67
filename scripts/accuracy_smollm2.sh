#!/usr/bin/env bash
# The full accuracy table of docs/results/accuracy.md (about an hour on 2 CPU cores):
# calibrate every method once, then perplexity+KL and three NIAH processes in parallel, then report.
#   NIAH: 2k with both tasks and every method; 4k and 8k with niah_single_1 (20 samples) and the
#   ten main methods (SmolLM2-135M scores ~0 on niah_multikey_2 even in bf16, see the results page).
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
OUT=${OUT_DIR:-runs/accuracy}
mkdir -p "$OUT"
M10=bf16,int2_naive,int2_hadamard_clip,int2_pca_clip,int2_oscar_clip,int2_oscar_g32_p_clip,int2_oscar_perhead_clip,int4_hadamard,int2_best,int2_best_vhad
run() { python -m sglang_oscar.eval.compare --out-dir "$OUT" --quiet "$@"; }
run --stage calibrate --threads 2 2>&1 | tee "$OUT/calibrate.log"
pids=()
run --stage ppl --threads 1 > "$OUT/ppl.log" 2>&1 & pids+=($!)
run --stage niah --threads 1 --niah-lengths 2048 --niah-tag _2k > "$OUT/niah_2k.log" 2>&1 & pids+=($!)
run --stage niah --threads 1 --niah-lengths 4096 --niah-tasks niah_single_1 --niah-per-task 20 --methods "$M10" \
    --niah-tag _4k > "$OUT/niah_4k.log" 2>&1 & pids+=($!)
run --stage niah --threads 1 --niah-lengths 8192 --niah-tasks niah_single_1 --niah-per-task 20 --methods "$M10" \
    --niah-tag _8k > "$OUT/niah_8k.log" 2>&1 & pids+=($!)
for p in "${pids[@]}"; do wait "$p"; done
run --stage report --json benchmark/results/accuracy_smollm2.json --md docs/results/accuracy_table.md \
    --plot docs/results/accuracy_smollm2.png
