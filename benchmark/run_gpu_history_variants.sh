#!/usr/bin/env bash
# Same-call A/Bs of CUDA history kernel variants (benchmark/probe_history_trace.py --sources) on one GPU, with the
# board's power and clocks logged beside them. Why: at batch >= 8 the H200 runs this kernel at its 700 W cap, rounds
# of one tree spread by up to 17%, and a variant's gain must be read against that (benchmark/NOTES.md "the 700 W cap").
# Kernels only: needs neither SGLang nor FlashInfer.
#   OSCAR_COMMIT=<hash> PROBES="qwen3-8b|alone:65536:1:auto,chain:65536:1:auto|u2=+DOSCAR_TILE_UNROLL=2|unroll" \
#     bash benchmark/run_gpu_history_variants.sh
# PROBES: ';'-separated model|configs|sources|tag (probe_history_trace.py's --model, --configs, --sources, --tag);
# ROUNDS (5): interleaved timing rounds per configuration.
# Outputs: $OUT/probe_history_trace_<tag>_<device>.json per probe, its log, and power_log_<first tag>.csv (past 8 files
# the probes' JSONs and logs in $OUT/probes_<first tag>.tgz).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
[ -n "${OSCAR_COMMIT:-}" ] || echo "warning: OSCAR_COMMIT unset: results name the device copy's git HEAD" >&2
[ -n "${PROBES:-}" ] || { echo "set PROBES (model|configs|sources|tag;...)"; exit 2; }
export PYTHONPATH=$PWD/python PYTHONUNBUFFERED=1 PATH=$PATH:/usr/local/cuda/bin
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.limit --format=csv | tee "$OUT/gpu_state.txt"
first_tag=$(echo "$PROBES" | cut -d';' -f1 | cut -d'|' -f4)
nvidia-smi --query-gpu=timestamp,power.draw,clocks.sm,clocks_throttle_reasons.active,temperature.gpu --format=csv \
  -lms 250 > "$OUT/power_log_${first_tag}.csv" 2>&1 &
smi=$!
rc=0
IFS=';' read -ra items <<< "$PROBES"
for item in "${items[@]}"; do
  IFS='|' read -r model configs sources tag <<< "$item"
  echo "=== $tag: $model $configs $sources" | tee -a "$OUT/gpu_state.txt"
  python3 benchmark/probe_history_trace.py --model "$model" --configs "$configs" --sources "$sources" \
    --rounds "${ROUNDS:-5}" --tag "$tag" --out "$OUT" 2>&1 | tee "$OUT/probe_history_trace_${tag}.log"
  st=${PIPESTATUS[0]}
  [ "$st" = 0 ] || { echo "$tag: rc=$st"; rc=1; }
done
kill "$smi" 2>/dev/null
# a call brings back at most 8 files from $OUT: past that, the probes' JSONs and logs in one archive (built outside
# $OUT, see run_gpu_write_row.sh)
if [ "$(ls "$OUT" | wc -l)" -gt 8 ]; then
  (cd "$OUT" && tar czf /tmp/oscar_probes.tgz probe_history_trace_* && rm -f probe_history_trace_*) &&
    mv /tmp/oscar_probes.tgz "$OUT/probes_${first_tag}.tgz"
fi
exit $rc
