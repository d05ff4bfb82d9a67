#!/usr/bin/env bash
# One device call, no SGLang runtime needed (torch + triton of the GPU image): the write kernel's
# GPU tests in bf16, then bench_write.py (decode cases as CUDA-graph replays, prefill of 8k and 100k tokens).
#   OSCAR_COMMIT=<hash> bash benchmark/run_gpu_write.sh [bench_write.py args, e.g. --decode-only]
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# the commit the results name: prefix the device command with OSCAR_COMMIT=<the hash of the commit that
# travels>, written out where the call is made (on the device machine the git metadata can be stale)
[ -n "${OSCAR_COMMIT:-}" ] || echo "warning: OSCAR_COMMIT unset: results name the device copy's git HEAD, which can be stale" >&2
export PYTHONPATH=$PWD/python PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu_state.txt"
python3 -m pytest -q test/test_write.py -p no:cacheprovider 2>&1 | tail -8 | tee "$OUT/pytest_write_gpu.txt"
OSCAR_COMMIT=${OSCAR_COMMIT:-} python3 benchmark/bench_write.py --out "$OUT" "$@" 2>&1 | tee "$OUT/bench_write.log"
