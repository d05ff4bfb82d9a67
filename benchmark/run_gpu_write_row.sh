#!/usr/bin/env bash
# The decode write's one-token programs (kernels/write.py _write_row) against an older tree, in one call on one GPU:
# the write's GPU tests, then the write alone (bench_write_decode --write-sweep) and OSCAR's decode-step layer
# (write + decode chain) from both trees, interleaved (old, new, old, new) so that the spread is visible.
# Needs neither SGLang nor FlashInfer (no carry). Everything also lands in $OUT/all.tgz (JSONs, PNGs, logs).
# NOQ=1: the new tree's write sweep also without q rotated in the launch (--write-no-q).
#   OSCAR_COMMIT=<hash> OLD_REF=<hash> bash benchmark/run_gpu_write_row.sh
# env: MODELS (qwen3-8b,qwen3-32b,smollm2), BATCHES (1,2,4,8,16,32,64), WARPS_NEW (4,8), TILES_NEW (0,1),
#      CONTEXTS (32768,65536,131072), CHAIN_BATCHES (1,8,32), ROUNDS (2)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
[ -n "${OLD_REF:-}" ] || { echo "set OLD_REF (the commit to compare with)"; exit 2; }
OLD=/tmp/oscar_old; rm -rf "$OLD"; mkdir -p "$OLD"
git archive "$OLD_REF" python benchmark | tar -x -C "$OLD" || exit 2
export PYTHONUNBUFFERED=1 PATH=$PATH:/usr/local/cuda/bin
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu_state.txt"
PYTHONPATH=$PWD/python python3 -m pytest -q -p no:cacheprovider test/test_write.py -k "gpu or rotates" 2>&1 \
  | tail -8 | tee "$OUT/pytest_write_gpu.txt"
MODELS=${MODELS:-qwen3-8b,qwen3-32b,smollm2}
for round in $(seq 1 "${ROUNDS:-2}"); do
  for tree in old new; do
    # the commit each tree's results name (versions(): OSCAR_COMMIT, else git, which the old tree has not)
    if [ $tree = old ]; then dir=$OLD; commit=$OLD_REF; extra="--write-sweep 4"; else
      dir=$PWD; commit=${OSCAR_COMMIT:-}; extra="--write-sweep ${WARPS_NEW:-4,8} --write-block-t ${TILES_NEW:-0,1}"
      [ "${NOQ:-0}" = 1 ] && extra="$extra --write-no-q"; fi
    (cd "$dir" && OSCAR_COMMIT=$commit PYTHONPATH=$dir/python python3 benchmark/bench_write_decode.py --out "$OUT/${tree}_$round" \
      --models "$MODELS" --batches "${BATCHES:-1,2,4,8,16,32,64}" $extra) 2>&1 | tee "$OUT/write_${tree}_$round.log"
    (cd "$dir" && OSCAR_COMMIT=$commit PYTHONPATH=$dir/python python3 benchmark/bench_write_decode.py --out "$OUT/${tree}_$round" \
      --models qwen3-8b --contexts "${CONTEXTS:-32768,65536,131072}" --batches "${CHAIN_BATCHES:-1,8,32}" \
      --impls oscar_cuda_fused_q_after_write,oscar_cuda_fused_q) 2>&1 | tee "$OUT/chain_${tree}_$round.log"
  done
done
# one archive: a call brings back a limited number of files
# (built outside $OUT: tar exits 1 on an archive that grows inside the tree it reads, and the clean-up would not run)
tar czf /tmp/oscar_all.tgz -C "$OUT" . && mv /tmp/oscar_all.tgz "$OUT/all.tgz" \
  && (cd "$OUT" && find . -mindepth 1 ! -name all.tgz ! -name '*.log' ! -name '*.txt' -delete)
