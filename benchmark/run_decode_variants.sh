#!/usr/bin/env bash
# Decode kernel variants side by side in one device call (benchmark/NOTES.md "v4"): block shapes,
# a register cap (rN = maxnreg N, more CTAs per SM) and more split waves (wN), against FlashInfer
# BF16 in the same run; then the decode GPU tests (bf16 against the float64 oracle). The first config
# is oscar_decode's default. The v4 call (results/decode_variants_*.json) also ran 64:2:3:vt0, the
# V-codes layout before v4 (row-major + an fp16 transpose per plane), since removed from the kernel.
# Runtime staged as in benchmark/serving/serving_session.sh (call 1 untars .devb/a; this call carries
# .devb/b and .whl):
#   [CONFIGS=...] [IMPLS=...] [CONTEXTS=...] bash benchmark/run_decode_variants.sh [extra bench_decode.py args]
# v4 ring-split check: CONFIGS=128:2:3,128:2:3:ring1 IMPLS=oscar,flashinfer_bf16,flashinfer_fp8
set -uo pipefail
. "$(dirname "$0")/serving/gpu_env.sh" || exit 3
timeout "${VARIANTS_TIMEOUT:-420}" python3 benchmark/bench_decode.py --out "$OUT" --models qwen3-8b,smollm2 \
  --contexts "${CONTEXTS:-8192,32768,131072}" --batches 1,8,64 --impls "${IMPLS:-oscar,flashinfer_bf16}" \
  --oscar-configs "${CONFIGS:-128:2:3,64:2:3,64:2:3:r128:w6,128:2:3:w6,128:2:4}" --report first \
  "$@" 2>&1 | tee "$OUT/decode_variants.log" | grep -v "^  oscar cfg" | tail -40
timeout "${PYTEST_TIMEOUT:-150}" python3 -m pytest -q test/test_decode.py 2>&1 | tee "$OUT/decode_pytest_gpu.txt" | tail -3
