#!/usr/bin/env bash
# The CUDA history kernel at head_dim 64 (SmolLM2: 9 query / 3 KV heads) on a device machine: its GPU tests, then the
# issue's table for the SmolLM2 shape with the Triton path, the CUDA history, the read of the same bytes and, where
# the runtime is staged, FlashInfer BF16 / FP8 and SGLang's Triton BF16 in the same process.
# Staging as run_gpu_write_decode.sh (part a 54 MB: move benchmark/results out of the tree for the call that carries
# it): call 1 carries .devb/a and runs the tests, call 2 right after carries .devb/b and runs the table.
#   call 1: OSCAR_COMMIT=<hash> TESTS=1 BENCH=0 bash benchmark/run_gpu_d64.sh      (carry .devb/a)
#   call 2: OSCAR_COMMIT=<hash> TESTS=0 BENCH=1 bash benchmark/run_gpu_d64.sh      (carry .devb/b)
# env: TEST_K (pytest -k), MODELS (smollm2), CONTEXTS (8192,32768,65536,131072), BATCHES (1,8,32,64), GROUP (64),
# IMPLS (default below; FlashInfer / SGLang rows only where importable).
set -uo pipefail
. benchmark/stage_runtime_parts.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv | tee "$OUT/gpu_state.txt"
if [ "${TESTS:-1}" = 1 ]; then
  python3 -m pytest -q -p no:cacheprovider test/test_decode.py \
    -k "${TEST_K:-head_dim_64 or wide_stages or after_the_kv_write or cuda_history_matches_the_oracle or gqa_head_groups or groups_of_128}" \
    2>&1 | tee "$OUT/pytest_gpu.txt" | tail -15
fi
[ "${BENCH:-1}" = 1 ] || exit 0
impls=${IMPLS:-oscar_page64,oscar_cuda_page64,read_same_bytes}
if [ -z "${IMPLS:-}" ]; then
  python3 -c "import flashinfer" 2>/dev/null && impls=$impls,flashinfer_bf16,flashinfer_fp8
  python3 -c "import sglang.kernels.ops.attention.decode_attention" 2>/dev/null && impls=$impls,sglang_triton_bf16
fi
python3 benchmark/bench_decode.py --out "$OUT" --models "${MODELS:-smollm2}" \
  --contexts "${CONTEXTS:-8192,32768,65536,131072}" --batches "${BATCHES:-1,8,32,64}" --group "${GROUP:-64}" \
  --impls "$impls" --oscar-configs auto:2:3 2>&1 | tee "$OUT/bench_decode.log"
