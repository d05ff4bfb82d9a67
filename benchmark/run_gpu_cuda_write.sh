#!/usr/bin/env bash
# The CUDA decode write (kernels/write_cuda.py) on a bare device machine, one call, no SGLang staging: its GPU tests
# (test_write.py, the chained decode after it in test_decode.py), then the write alone (Triton against CUDA, with and
# without q, alternating per batch) and the write + chained CUDA history layer with either write, same process.
#   OSCAR_COMMIT=<hash> bash benchmark/run_gpu_cuda_write.sh
# env: TESTS (1), SWEEP (1), LAYER (1), MODELS (qwen3-8b,glm-4.7-tp8,qwen3-32b), BATCHES (1,8,32),
# CONTEXTS (32768,65536,131072), LAYER_MODELS (qwen3-8b,glm-4.7-tp8), LAYER_BATCHES (1,8,32), LAYER_IMPLS.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
[ -n "${OSCAR_COMMIT:-}" ] || echo "warning: OSCAR_COMMIT unset: results name the device copy's git HEAD" >&2
export PYTHONPATH=$PWD/python PYTHONUNBUFFERED=1 PATH=$PATH:/usr/local/cuda/bin
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv | tee "$OUT/gpu_state.txt"
if [ "${TESTS:-1}" = 1 ]; then
  python3 -m pytest -q -p no:cacheprovider test/test_write.py test/test_decode.py \
    -k "${TEST_K:-cuda_kernel or cuda_rotates or cuda_source or cuda_launch or refusals or gpu or after_the_kv_write}" \
    --tb=short > "$OUT/pytest_gpu_cuda_write.txt" 2>&1; tail -8 "$OUT/pytest_gpu_cuda_write.txt"
fi
if [ "${SWEEP:-1}" = 1 ]; then
  python3 benchmark/bench_write_decode.py --out "$OUT" --models "${MODELS:-qwen3-8b,glm-4.7-tp8,qwen3-32b}" \
    --batches "${BATCHES:-1,8,32}" --write-sweep 4 --write-no-q --write-kernels triton,cuda 2>&1 \
    | tee "$OUT/write_sweep.log"
fi
if [ "${LAYER:-1}" = 1 ]; then
  python3 benchmark/bench_write_decode.py --out "$OUT" --models "${LAYER_MODELS:-qwen3-8b,glm-4.7-tp8}" \
    --contexts "${CONTEXTS:-32768,65536,131072}" --batches "${LAYER_BATCHES:-1,8,32}" \
    --impls "${LAYER_IMPLS:-oscar_cuda_fused_q_after_write,oscar_cuda_write_fused_q_after_write}" 2>&1 | tee -a "$OUT/layer.log"
fi
