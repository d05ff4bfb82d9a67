#!/usr/bin/env bash
# Same-call A/B of one benchmark between an older tree (OLD_REF) and this one, on one GPU: the benchmark runs from
# both trees, interleaved (old, new, old, new, ...) so that the run-to-run spread is visible beside the difference,
# then benchmark/ab_summary.py compares them per point. Why: a change to the CUDA history kernel that was off by
# default still made every batch-1 call ~1.8 us slower (benchmark/NOTES.md "q rotated in the decode's CTAs"); only
# an A/B in one call showed it. The benchmark must take --out and accept the same arguments in both trees.
#   OSCAR_COMMIT=<this tree's hash> OLD_REF=<hash> [ROUNDS=2] bash benchmark/run_gpu_ab.sh \
#     benchmark/bench_write_decode.py --models qwen3-8b --contexts 65536,131072 --batches 1,8 --impls oscar_cuda_fused_q
# OLD_TGZ=<path>: the old tree from a tarball instead of git (the device copy's git metadata can be stale).
# Uses SGLang / FlashInfer from $HOME/sgl-site where a run_gpu_*.sh call staged them (the oscar impls need neither).
# Outputs: $OUT/ab_summary.json (and the table on stdout) and $OUT/ab.tgz (every run's JSONs and log).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/ab"
[ -n "${OLD_REF:-}" ] || { echo "set OLD_REF (the commit to compare with)"; exit 2; }
[ $# -ge 1 ] || { echo "usage: OLD_REF=<hash> bash benchmark/run_gpu_ab.sh <benchmark script> [its arguments]"; exit 2; }
[ -n "${OSCAR_COMMIT:-}" ] || echo "warning: OSCAR_COMMIT unset: the new tree's results name the device copy's git HEAD" >&2
OLD=/tmp/oscar_ab_old; rm -rf "$OLD"; mkdir -p "$OLD"
if [ -n "${OLD_TGZ:-}" ]; then  # the device copy's git may lack OLD_REF: a tarball made here, carried with the call
  tar xzf "$OLD_TGZ" -C "$OLD" || exit 2  # e.g. git archive OLD_REF python benchmark test ":!benchmark/results" | gzip
else
  git archive "$OLD_REF" python benchmark test | tar -x -C "$OLD" || exit 2  # bench_decode imports test_decode
fi
export PYTHONUNBUFFERED=1 PATH=$PATH:/usr/local/cuda/bin
SITE=$HOME/sgl-site
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu_state.txt"
for round in $(seq 1 "${ROUNDS:-2}"); do
  for tree in old new; do
    # each tree's results name its own commit (versions() reads OSCAR_COMMIT; the old tree has no git metadata)
    if [ $tree = old ]; then dir=$OLD; commit=$OLD_REF; else dir=$PWD; commit=${OSCAR_COMMIT:-}; fi
    (cd "$dir" && OSCAR_COMMIT=$commit PYTHONPATH=$SITE:$dir/python python3 "$@" --out "$OUT/ab/${tree}_$round") \
      > "$OUT/ab/${tree}_$round.log" 2>&1 || echo "$tree round $round: rc=$? (see ${tree}_$round.log)"
  done
done
python3 benchmark/ab_summary.py "$OUT/ab" --out "$OUT/ab_summary.json"
# one archive: a call brings back a limited number of files (built outside $OUT, see run_gpu_write_row.sh)
tar czf /tmp/oscar_ab.tgz --exclude="*.png" -C "$OUT" ab && mv /tmp/oscar_ab.tgz "$OUT/ab.tgz" && rm -rf "$OUT/ab"
