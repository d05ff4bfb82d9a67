#!/usr/bin/env bash
# Several bench_decode.py runs in one device call (variants, split sweeps), each to its own JSON:
#   [TESTS=0] bash benchmark/run_gpu_decode_sweeps.sh NAME "bench_decode.py args" [NAME "args" ...]
# -> $OUT/NAME.json (rows + oscar_variants) and $OUT/NAME.log per run, $OUT/gpu_state.txt, and with
# TESTS=1 (default) $OUT/pytest_gpu.txt from test/test_decode.py first. The SGLang/FlashInfer runtime
# is staged as for run_gpu_kernels.sh (call 1 untars .devb/a into $HOME/sgl-site, this call .devb/b).
# At most 3 runs: the device returns 8 files.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# the commit the results name: prefix the device command with OSCAR_COMMIT=<the hash of the commit that
# travels>, written out where the call is made (on the device machine the git metadata can be stale)
[ -n "${OSCAR_COMMIT:-}" ] || echo "warning: OSCAR_COMMIT unset: results name the device copy's git HEAD, which can be stale" >&2
if [ $(( $# % 2 )) -ne 0 ] || [ $# -eq 0 ] || [ $# -gt 6 ]; then
  echo "usage: $0 NAME \"bench args\" [NAME \"bench args\" ...] (1-3 runs)" >&2; exit 2
fi
SITE=$HOME/sgl-site
if [ -d .devb/b ] && ls .devb/b/*.tgz >/dev/null 2>&1; then tar xzf .devb/b/*.tgz -C "$SITE"; fi
export PYTHONPATH=$SITE:$PWD/python PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu_state.txt"
if [ "${TESTS:-1}" = 1 ]; then
  python3 -m pytest -q -x test/test_decode.py -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/pytest_gpu.txt"
fi
while [ $# -gt 0 ]; do
  name=$1; args=$2; shift 2
  tmp=$(mktemp -d)
  # shellcheck disable=SC2086  # args is a list of words on purpose
  python3 benchmark/bench_decode.py --out "$tmp" $args 2>&1 | grep -v "Warning\|\"\"\"" | tee "$OUT/$name.log"
  cp "$tmp"/decode_kernel_*.json "$OUT/$name.json" 2>/dev/null || echo "no JSON from run $name" | tee -a "$OUT/$name.log"
done
