#!/usr/bin/env bash
# GPU kernel check + benchmark, one device call (the SGLang/FlashInfer runtime staged per
# /work/shared/device/README.md: call 1 untars .devb/a into $HOME/sgl-site, this call .devb/b).
#   [BENCH_WRITE=0] [TESTS=0] bash benchmark/run_gpu_kernels.sh [bench_decode.py args...]
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# the commit the results name: prefix the device command with OSCAR_COMMIT=<the hash of the commit that
# travels>, written out where the call is made (on the device machine the git metadata can be stale)
[ -n "${OSCAR_COMMIT:-}" ] || echo "warning: OSCAR_COMMIT unset: results name the device copy's git HEAD, which can be stale" >&2
SITE=$HOME/sgl-site
if [ -d .devb/b ] && ls .devb/b/*.tgz >/dev/null 2>&1; then tar xzf .devb/b/*.tgz -C "$SITE"; fi
if [ ! -d "$SITE/sglang" ] || [ ! -d "$SITE/flashinfer" ]; then
  echo "runtime not staged in $SITE (sglang: $(ls -d $SITE/sglang 2>/dev/null), flashinfer: $(ls -d $SITE/flashinfer 2>/dev/null))"
fi
export PYTHONPATH=$SITE:$PWD/python PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu_state.txt"
tests=test/test_decode.py; [ -f test/test_write.py ] && tests="$tests test/test_write.py"
if [ "${TESTS:-1}" = 1 ]; then python3 -m pytest -q -x $tests -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/pytest_gpu.txt"; fi
python3 benchmark/bench_decode.py --out "$OUT" "$@" 2>&1 | tee "$OUT/bench_decode.log"
if [ "${BENCH_WRITE:-1}" = 1 ] && [ -f benchmark/bench_write.py ]; then python3 benchmark/bench_write.py --out "$OUT" 2>&1 | tail -30 | tee "$OUT/bench_write.log"; fi
