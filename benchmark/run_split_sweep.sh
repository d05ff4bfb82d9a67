#!/usr/bin/env bash
# The decode kernel's history split count, swept side by side in one device call (benchmark/NOTES.md
# "Split count at small batch"): the default rule (auto), the rule without the small-batch floor
# (sb0 = 3 programs per SM only) and fixed counts, against FlashInfer BF16 in the same run.
# Runtime staged as in benchmark/serving/serving_session.sh (call 1 untars .devb/a; this call carries
# .devb/b and .whl). Qwen3-8B + SmolLM2 at 8k/32k/128k x batch 1/4/8 took > 240 s on an H100:
#   bash benchmark/run_split_sweep.sh [extra bench_decode.py args, e.g. --batches 16,32,64]
set -uo pipefail
. "$(dirname "$0")/serving/gpu_env.sh" || exit 3
timeout "${SWEEP_TIMEOUT:-540}" python3 benchmark/bench_decode.py --out "$OUT" --models qwen3-8b,smollm2 \
  --contexts 8192,32768,131072 --batches 1,4,8 --impls oscar,flashinfer_bf16 \
  --oscar-configs 64:2:3,128:4:3 --oscar-splits auto,sb0,16,32,64,128 "$@" 2>&1 | tee "$OUT/split_sweep.log" | tail -60
