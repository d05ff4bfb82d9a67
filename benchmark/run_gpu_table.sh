#!/usr/bin/env bash
# The issue's decode table in one process (bench_decode.py): Qwen3-8B and SmolLM2 layer shapes, 8k-128k, batch 1 / 8 /
# 32 / 64, the served OSCAR path (CUDA history on pages of 64), the Triton path, a read of the same bytes, FlashInfer
# BF16 / FP8 and SGLang's Triton BF16 kernel side by side at every point, with the board's power and clocks logged
# beside it; then our batch-1 rows again on their own, because on H200 the rows after FlashInfer's large batches can run
# on a board still at its power cap (benchmark/NOTES.md, "Measuring on a lent GPU").
# Needs SGLang (part a) and FlashInfer (part b) staged: two calls on one warm machine, as run_gpu_write_decode.sh:
#   call 1: TESTS=0 BENCH=0 bash benchmark/run_gpu_write_decode.sh                (carry .devb/a: 54 MB of the 64 MiB)
#   call 2: OSCAR_COMMIT=<hash> bash benchmark/run_gpu_table.sh                   (carry .devb/b; ~6 min on H200)
# env: MODELS (qwen3-8b,smollm2), CONTEXTS (8192,32768,65536,131072), BATCHES (1,8,32,64), IMPLS (below), RERUN (1: the
# batch-1 rows of the CUDA path alone afterwards).
# Outputs ($OUT, <= 8 files): decode_kernel_<device>.json / .png, bench_decode.log, power_log_table.csv, gpu_state.txt,
# decode_kernel_b1_rerun_<device>.json and its log.
set -uo pipefail
. benchmark/stage_runtime_parts.sh
python3 -c "import flashinfer, sglang" || { echo "stage both runtime parts first (see the header)"; exit 3; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.limit --format=csv | tee "$OUT/gpu_state.txt"
nvidia-smi --query-gpu=timestamp,power.draw,clocks.sm,clocks_throttle_reasons.active,temperature.gpu --format=csv \
  -lms 500 > "$OUT/power_log_table.csv" 2>&1 &
smi=$!
IMPLS=${IMPLS:-oscar_cuda_page64,oscar_page64,read_same_bytes,flashinfer_bf16,flashinfer_fp8,sglang_triton_bf16}
MODELS=${MODELS:-qwen3-8b,smollm2}
CONTEXTS=${CONTEXTS:-8192,32768,65536,131072}
python3 benchmark/bench_decode.py --out "$OUT" --models "$MODELS" --contexts "$CONTEXTS" \
  --batches "${BATCHES:-1,8,32,64}" --impls "$IMPLS" 2>&1 | tee "$OUT/bench_decode.log"
rc=${PIPESTATUS[0]}
if [ "${RERUN:-1}" = 1 ]; then
  echo "=== batch-1 rerun of oscar_cuda_page64 alone ($(date +%T))" | tee -a "$OUT/gpu_state.txt"
  mkdir -p /tmp/oscar_rerun
  python3 benchmark/bench_decode.py --out /tmp/oscar_rerun --models "$MODELS" --contexts "$CONTEXTS" \
    --batches 1 --impls oscar_cuda_page64,read_same_bytes > "$OUT/decode_kernel_b1_rerun.log" 2>&1 || rc=1
  for f in /tmp/oscar_rerun/decode_kernel_*.json; do
    [ -e "$f" ] && mv "$f" "$OUT/$(basename "$f" | sed 's/^decode_kernel_/decode_kernel_b1_rerun_/')"
  done
fi
kill "$smi" 2>/dev/null
exit $rc
