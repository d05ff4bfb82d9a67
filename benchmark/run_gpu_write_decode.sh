#!/usr/bin/env bash
# The decode step's write + decode chain (bench_write_decode.py) and its GPU tests, on a warm device machine in two
# calls: call 1 carries .devb/a (SGLang) and only stages it; call 2, right after, carries .devb/b (FlashInfer,
# tvm-ffi for SGLang's store_cache, the transformers / tokenizers SGLang imports) and runs the tests or the
# benchmark (the full GPU tests ~7 min, the benchmark ~4-5 min: one per 10-minute call; a later call on the warm
# machine needs no carry). Each call stages the part it carries into $HOME/sgl-site.
#   call 1: TESTS=0 BENCH=0 bash benchmark/run_gpu_write_decode.sh                          (carry .devb/a)
#   call 2: OSCAR_COMMIT=<hash> TESTS=1 BENCH=0 bash benchmark/run_gpu_write_decode.sh      (carry .devb/b)
#   call 3: OSCAR_COMMIT=<hash> TESTS=0 BENCH=1 bash benchmark/run_gpu_write_decode.sh
# The kernel tests alone (test_write / test_decode) and the oscar impls need neither part.
# A call carries the working tree and the named paths within 64 MiB: part a is 54.4 MB, so the tree must stay under
# ~9 MB (none of these calls reads benchmark/results).
# env: TEST_K (pytest -k of the GPU tests), MODELS (qwen3-8b), CONTEXTS (32768,65536,131072), BATCHES (1,8,32),
# IMPLS (bench_write_decode's default).
set -uo pipefail
. benchmark/stage_runtime_parts.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu_state.txt"
if [ "${TESTS:-1}" = 1 ]; then
  python3 -m pytest -q -p no:cacheprovider test/test_decode.py test/test_srt_backend_graph.py test/test_write.py \
    -k "${TEST_K:-cuda or after_write or gpu}" 2>&1 | tee "$OUT/pytest_gpu.txt" | tail -15
fi
[ "${BENCH:-1}" = 1 ] || exit 0
python3 -c "import flashinfer" || { echo "flashinfer missing: stage part b (.devb/b)"; exit 3; }
python3 benchmark/bench_write_decode.py --out "$OUT" --models "${MODELS:-qwen3-8b}" \
  --contexts "${CONTEXTS:-32768,65536,131072}" --batches "${BATCHES:-1,8,32}" ${IMPLS:+--impls $IMPLS} 2>&1 | tee "$OUT/bench_write_decode.log"
