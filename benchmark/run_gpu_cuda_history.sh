#!/usr/bin/env bash
# The CUDA history stage (kernels/history_cuda.py) in one device call: its GPU tests, where the time of a
# call goes (probe_decode_fixed_cost.py: window programs, history kernel, merge, gaps; batch 1 split sweep),
# and the bench_decode table beside the Triton path and the read of the same bytes. FlashInfer baselines
# join the table when the runtime is staged ($HOME/sgl-site with flashinfer: see run_gpu_kernels.sh).
#   OSCAR_COMMIT=<hash> bash benchmark/run_gpu_cuda_history.sh
# env: CONTEXTS (32768,65536,131072), BATCHES (1,2,4,8,32), SPLITS (b1 sweep, 16,33,132,248), CUDA_CONFIGS
# (extra stages:warps, e.g. 3:4,4:4), VARIANTS (probe --variants), PROBE_BATCHES (1,8), TESTS / TRITON_PROBE /
# PROBE / BENCH = 0 to skip; CUDA_WINDOWS (probe --cuda-windows; default triton,fused_merge: the Triton window
# programs, and the merge in the kernel, beside the default window CTAs + Triton merge, at every point); MODELS (bench,
# default qwen3-8b; e.g. qwen3-32b,qwen3-14b), PROBE_MODEL (default qwen3-8b), EXTRA_IMPLS (e.g.
# oscar_cuda_groups4_page64), CUDA_MAX_GQA (bench --cuda-max-gqa).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
[ -n "${OSCAR_COMMIT:-}" ] || echo "warning: OSCAR_COMMIT unset: results name the device copy's git HEAD" >&2
SITE=$HOME/sgl-site
if [ -d .devb/b ] && ls .devb/b/*.tgz >/dev/null 2>&1 && [ -d "$SITE" ]; then tar xzf .devb/b/*.tgz -C "$SITE"; fi
export PYTHONPATH=$SITE:$PWD/python PYTHONUNBUFFERED=1 PATH=$PATH:/usr/local/cuda/bin
CONTEXTS=${CONTEXTS:-32768,65536,131072}
BATCHES=${BATCHES:-1,2,4,8,32}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu_state.txt"
if [ "${TESTS:-1}" = 1 ]; then
  python3 -m pytest -q test/test_decode.py -k "cuda_history or cuda_window" -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/pytest_gpu.txt"
fi
if [ "${PROBE:-1}" = 1 ]; then
  python3 benchmark/probe_decode_fixed_cost.py --model "${PROBE_MODEL:-qwen3-8b}" --history-kernel cuda --page 64 --contexts "$CONTEXTS" \
    --batches "${PROBE_BATCHES:-1,8}" --cuda-windows "${CUDA_WINDOWS-triton,fused_merge}" \
    --splits "${SPLITS-16,33,132,248}" --cuda-configs "${CUDA_CONFIGS:-}" --variants "${VARIANTS:-}" --tag cuda_page64 \
    --out "$OUT" 2>&1 | tee "$OUT/probe_cuda.log"
fi
if [ "${TRITON_PROBE:-1}" = 1 ]; then
  python3 benchmark/probe_decode_fixed_cost.py --contexts "$CONTEXTS" --batches "${PROBE_BATCHES:-1,8}" --tag triton --out "$OUT" 2>&1 \
    | tee "$OUT/probe_triton.log"
fi
[ "${BENCH:-1}" = 1 ] || exit 0
impls=oscar,oscar_cuda_page64${EXTRA_IMPLS:+,$EXTRA_IMPLS},read_same_bytes
python3 -c "import flashinfer" 2>/dev/null && impls=$impls,flashinfer_bf16,flashinfer_fp8
python3 benchmark/bench_decode.py --out "$OUT" --models "${MODELS:-qwen3-8b}" --contexts "$CONTEXTS" --batches "$BATCHES" \
  --impls "$impls" ${CUDA_MAX_GQA:+--cuda-max-gqa $CUDA_MAX_GQA} --oscar-configs auto:2:3 2>&1 | tee "$OUT/bench_decode.log"
