#!/usr/bin/env bash
# GQA 9-16 (GLM-4.x's 12) on the CUDA history stage: one column of 16 heads (history_cuda.TILE16, two 8-column tiles
# sharing the code masks) against head groups of 8 (TILE16 off), same process, H200 / H100. A power log runs beside it
# (the H200 meets its 700 W cap at batch >= 8: compare minima there). Kernel-only parts need no SGLang staging;
# BENCH=1 needs FlashInfer (carry .devb/b).
#   OSCAR_COMMIT=<hash> TESTS=1 PROBE=1 BENCH=0 bash benchmark/run_gpu_tile16.sh           (~8 min)
#   OSCAR_COMMIT=<hash> TESTS=0 PROBE=0 BENCH=1 bash benchmark/run_gpu_tile16.sh           (carry .devb/b)
# env: MODELS (glm-4.7-tp8,glm-4.7-tp4), PROBE_MODELS (glm-4.7-tp8), CONFIGS (probe_history_trace --configs),
# ROUNDS (3), CONTEXTS / BATCHES (bench_decode), TEST_K (pytest -k).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
[ -n "${OSCAR_COMMIT:-}" ] || echo "warning: OSCAR_COMMIT unset: results name the device copy's git HEAD" >&2
SITE=$HOME/sgl-site; mkdir -p "$SITE"
if ls .devb/b/*.tgz >/dev/null 2>&1; then tar xzf .devb/b/*.tgz -C "$SITE" && echo "staged part b"; fi
export PYTHONPATH=$SITE:$PWD/python PYTHONUNBUFFERED=1 PATH=$PATH:/usr/local/cuda/bin
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.limit --format=csv | tee "$OUT/gpu_state.txt"
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,power.limit,clocks_throttle_reasons.active --format=csv \
  -lms 250 > "$OUT/power_log.csv" 2>/dev/null &
PLOG=$!
trap 'kill $PLOG 2>/dev/null' EXIT
if [ "${TESTS:-1}" = 1 ]; then
  python3 -m pytest -q -p no:cacheprovider test/test_decode.py test/test_write.py \
    -k "${TEST_K:-cuda or after_write}" 2>&1 | tail -15 | tee "$OUT/pytest_gpu.txt"
fi
if [ "${PROBE:-1}" = 1 ]; then
  for m in $(echo "${PROBE_MODELS:-glm-4.7-tp8}" | tr , ' '); do
    python3 benchmark/probe_history_trace.py --model "$m" --sources g8=+T0 --rounds "${ROUNDS:-3}" --tag "tile16_$m" \
      --configs "${CONFIGS:-alone:32768:1:auto,alone:65536:1:auto,alone:131072:1:auto,chain:65536:1:auto,alone:65536:8:auto,alone:131072:8:auto,alone:65536:32:auto}" \
      --out "$OUT" 2>&1 | tee "$OUT/probe_tile16_$m.log"
  done
fi
[ "${BENCH:-0}" = 1 ] || exit 0
python3 -c "import flashinfer" || { echo "flashinfer missing: carry .devb/b"; exit 3; }
python3 benchmark/bench_decode.py --out "$OUT" --models "${MODELS:-glm-4.7-tp8,glm-4.7-tp4}" \
  --contexts "${CONTEXTS:-32768,65536,131072}" --batches "${BATCHES:-1,8,32}" --oscar-configs auto:2:3 \
  --impls oscar_cuda_page64,oscar_cuda_groups8_page64,oscar_page64,read_same_bytes,flashinfer_bf16,flashinfer_fp8 \
  2>&1 | tee "$OUT/bench_decode_tile16.log"
