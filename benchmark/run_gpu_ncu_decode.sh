#!/usr/bin/env bash
# Nsight Compute profile of the decode kernel's stage 1 (warp stall reasons, per-SASS-line samples;
# summarised by benchmark/ncu_summary.py) and, in the same call, the wave-fill check of the split rule. Runtime staged as run_gpu_kernels.sh.
#   [NCU_SHAPES="model:batch:context:config ..."] [NCU_KERNEL=regex] [FILL=0] bash benchmark/run_gpu_ncu_decode.sh
# The CUDA history stage: NCU_KERNEL=int2_history_kernel NCU_SHAPES="qwen3-8b:8:65536:cuda ..." (config cuda:
# profile_decode_ncu.py). ncu runs with --clock-control none (the device notes: leave the clocks alone), so
# durations are at the card's own clocks.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# the commit the results name: prefix the device command with OSCAR_COMMIT=<the hash of the commit that
# travels>, written out where the call is made (on the device machine the git metadata can be stale)
[ -n "${OSCAR_COMMIT:-}" ] || echo "warning: OSCAR_COMMIT unset: results name the device copy's git HEAD, which can be stale" >&2
SITE=$HOME/sgl-site
if [ -d .devb/b ] && ls .devb/b/*.tgz >/dev/null 2>&1; then tar xzf .devb/b/*.tgz -C "$SITE"; fi
export PYTHONPATH=$SITE:$PWD/python PYTHONUNBUFFERED=1
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: ${NCU:-none}"
if [ -n "$NCU" ]; then
  for shape in ${NCU_SHAPES:-qwen3-8b:32:131072:128:2:3 qwen3-8b:1:131072:128:2:3}; do
    IFS=: read -r m b c cfg <<< "$shape"; tag=${m}_b${b}_ctx${c}_$(echo "$cfg" | tr : _)
    timeout 240 "$NCU" --kernel-name regex:${NCU_KERNEL:-_oscar_decode_stage1} --launch-skip 2 --launch-count 1 --set full \
      --clock-control none \
      --import-source yes -f -o "$OUT/ncu_$tag" python3 benchmark/profile_decode_ncu.py --model $m --batch $b --context $c --config "$cfg" \
      > "$OUT/ncu_$tag.log" 2>&1; echo "ncu $tag rc=$?"; tail -3 "$OUT/ncu_$tag.log"
    "$NCU" -i "$OUT/ncu_$tag.ncu-rep" --page details --print-details all > "$OUT/ncu_${tag}_details.txt" 2>&1
    "$NCU" -i "$OUT/ncu_$tag.ncu-rep" --page source --print-source sass --csv > "$OUT/ncu_${tag}_sass.csv" 2>&1
  done
  # the .ncu-rep / csv files are MBs: keep them out of git, commit the summary
  python3 benchmark/ncu_summary.py "$OUT" --out "$OUT/decode_ncu_stage1.json" | head -60
fi
[ "${FILL:-1}" = 1 ] || exit 0
mkdir -p "$OUT/fill"; timeout 300 python3 benchmark/bench_decode.py --out "$OUT/fill" --models qwen3-8b,smollm2 --batches 2,4,16 \
  --contexts 65536,131072 --impls oscar --oscar-splits auto,nofill 2>&1 | grep -E "oscar|copy bandwidth" | tee "$OUT/fill.log"
