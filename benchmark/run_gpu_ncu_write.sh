#!/usr/bin/env bash
# Nsight Compute profile of the decode-step write (kernels/write.py): duration, stall reasons and per-SASS-line samples
# of one launch per shape. No SGLang needed. Outputs in $OUT/ncu_write.tgz (the .ncu-rep files are MBs: not in git).
#   OSCAR_COMMIT=<hash> [SHAPES="qwen3-8b:1 qwen3-8b:1:noq ..."] [SAMPLING=0] [WARM=1] bash benchmark/run_gpu_ncu_write.sh
# SAMPLING: ncu's --warp-sampling-interval (0: every 32 cycles; the launch is ~12k cycles, auto gives ~70 samples);
# WARM=1: no cache flush and no clock lock (as in the CUDA-graph timings of bench_write_decode.py).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/ncu"
export PYTHONPATH=$PWD/python PYTHONUNBUFFERED=1 PATH=$PATH:/usr/local/cuda/bin
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: ${NCU:-none}"; [ -n "$NCU" ] || exit 3
for shape in ${SHAPES:-qwen3-8b:1 qwen3-8b:1:noq qwen3-8b:8 smollm2:1}; do
  IFS=: read -r m b noq <<< "$shape"; tag=${m}_b${b}${noq:+_$noq}
  timeout 200 "$NCU" --kernel-name regex:_oscar_write_kv_kernel --launch-skip 2 --launch-count 1 --set full \
    --warp-sampling-interval "${SAMPLING:-auto}" ${WARM:+--cache-control none --clock-control none} --import-source yes -f -o "$OUT/ncu/write_$tag" python3 benchmark/profile_write_ncu.py --model "$m" --batch "$b" \
    ${noq:+--no-q} > "$OUT/ncu/write_$tag.log" 2>&1; echo "ncu $tag rc=$?"
  "$NCU" -i "$OUT/ncu/write_$tag.ncu-rep" --page details --print-details all > "$OUT/ncu/write_${tag}_details.txt" 2>&1
  "$NCU" -i "$OUT/ncu/write_$tag.ncu-rep" --page source --print-source sass --csv > "$OUT/ncu/write_${tag}_sass.csv" 2>&1
  grep -E "^ +(Duration|Elapsed Cycles|SM Frequency|Registers Per Thread|Achieved Occupancy)" "$OUT/ncu/write_${tag}_details.txt" | head -6
done
(cd "$OUT" && tar czf ncu_write.tgz ncu && rm -rf ncu)
