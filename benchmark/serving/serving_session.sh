#!/usr/bin/env bash
# Issue 5's serving benchmark on one GPU (H100 or H200), as a sequence of device calls on one warm
# machine (each call <= 10 minutes; the machine stays warm 30 s between calls):
#
#   call 1 (carry .devb/a):  mkdir -p $HOME/sgl-site && tar xzf .devb/a/*.tgz -C $HOME/sgl-site
#   call 2 (carry .devb/b .whl):  bash benchmark/serving/serving_session.sh latency
#   call 3:                  bash benchmark/serving/serving_session.sh latency2
#   call 4:                  bash benchmark/serving/serving_session.sh serve
#   call 5:                  bash benchmark/serving/serving_session.sh throughput100k
#   (any later call)         bash benchmark/serving/serving_session.sh latency_cuda
#   (any later call)         MODES=int2 bash benchmark/serving/serving_session.sh batch_decode (then fi_bf16)
#   (any later call)         bash benchmark/serving/serving_session.sh capacity
#   (any later call)         bash benchmark/serving/serving_session.sh capacity_bg, then wait_bg in each next call
#
# latency:  bs=1 prefill + decode latency of dummy-weight Qwen3-8B at 8k/32k/64k/100k for int2 and
#           FlashInfer BF16 (one_batch.py, CUDA graphs, torch-profiler traces of 2 decode steps)
# latency2: the same for FlashInfer FP8 and SGLang's Triton BF16
# serve:    real servers (tp_serve.py, TP 1): greedy int2 == BF16 inside the windows, int2 CUDA
#           graph == eager, capacity, bs=1 latency at 32k/100k through HTTP, job throughput at
#           8k in / 1k out with 32 concurrent requests
# throughput100k: job throughput at 100k in / 1k out with the largest batch each mode fits
# latency_cuda: int2 against FlashInfer BF16 / FP8 in one call (one_batch.py); on Hopper the int2 server runs the
#           CUDA history stage on pages of 64 by itself (nvcc build at server start); CONTEXTS, BATCH and MODES
#           override the defaults (batch >= 8 is where the CUDA history measured faster than Triton). Each mode
#           has 110 s, enough once the JIT caches are warm (an int2 mode on the CUDA stage took 131 s in all on a
#           fresh H200, 84 s of it FlashInfer's first JIT in the warmup prefill, then 1 s of graph capture and
#           1.3 s per 32k prefill): on a fresh machine run it twice (or after `latency`); a mode cut short is
#           recorded with its error.
# capacity: bench_serving.py: each mode's server at --mem-fraction-static 0.85 with the most concurrent requests it
#           fits per workload (WORKLOADS, default 32768:256), SGLang's own serving benchmark; steady decode
#           throughput, TPOT, TTFT, job throughput. MODES defaults to int2,fi_bf16,fi_fp8; CONCURRENCY (e.g. 8,max)
#           sweeps (a workload's own IN:OUT@8/22/max replaces it for that workload); RUN names the rows' run (modes
#           measured in consecutive calls of one machine share it); FLAGS adds server flags to every mode (recorded in
#           the output's settings).
# Startup timeouts are 360 s: on a fresh machine FlashInfer's JIT compile alone took 145 s (FI BF16's
# prefill CUDA graphs) and > 120 s (int2's first prefill) in call 16's session, and 240 s was cut.
# Results: $OUT/*.json, one folder per call; benchmark/serving/collect.py merges the calls into
# benchmark/results/serving_<device>.json (see docs/results/serving.md).
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh" || exit 3
M=benchmark/serving/configs/qwen3-8b
# The device returns a few files per call: logs and traces travel as one archive.
pack() { (cd "$OUT" && ls -d logs traces 2>/dev/null | xargs -r tar czf "$OUT/logs_traces_$1.tgz"; rm -rf logs traces); }
filt() { grep --line-buffered -v "^\["; }
case "${1:-}" in
  latency)
    timeout 560 python3 benchmark/serving/one_batch.py --model $M --contexts 8192,32768,65536,100000 \
      --modes int2,fi_bf16 --profile --timeout 270 --out "$OUT" 2>&1 | filt | tee "$OUT/one_batch.log"
    pack latency
    ;;
  latency2)
    timeout 540 python3 benchmark/serving/one_batch.py --model $M --contexts 8192,32768,65536,100000 \
      --modes fi_fp8,triton_bf16 --profile --timeout 200 --out "$OUT" 2>&1 | filt | tee "$OUT/one_batch.log"
    pack latency2
    ;;
  serve)
    timeout 570 python3 benchmark/serving/tp_serve.py --model $M --tp 1 --modes int2,int2_eager,fi_bf16 \
      --contexts 32768,100000 --graph-max-bs 32 --mem-fraction 0.7 --throughput 8192x1024@32 \
      --startup-timeout 360 --out "$OUT" 2>&1 | filt | tee "$OUT/tp_serve.log"
    pack serve
    ;;
  throughput100k)
    timeout 570 python3 benchmark/serving/tp_serve.py --model $M --tp 1 --modes int2,fi_bf16,fi_fp8 \
      --contexts "" --graph-max-bs 32 --mem-fraction 0.7 --throughput 100000x1024 --startup-timeout 360 \
      --out "$OUT" 2>&1 | filt | tee "$OUT/tp_serve.log"
    pack throughput100k
    ;;
  latency_cuda)
    timeout 575 python3 benchmark/serving/one_batch.py --model $M --contexts "${CONTEXTS:-32768,100000}" \
      --batch "${BATCH:-1}" --graph-max-bs "${BATCH:-1}" --modes "${MODES:-int2,fi_bf16,fi_fp8}" \
      --timeout 110 \
      --out "$OUT" 2>&1 | filt | tee "$OUT/one_batch.log"
    pack latency_cuda
    ;;
  batch_decode)
    # the decode step at batch N through a real server (tp_serve.py --batch-decode: N prompts prefilled, then
    # decoded together; chunked prefill, so no one-forward prefill runs out of memory as in one_batch). One mode
    # per call (a fresh server's JIT takes 2-4 minutes): MODES=int2, then MODES=fi_bf16. GRAPH_BS must cover
    # the largest N, or that batch runs without CUDA graphs.
    timeout 585 python3 benchmark/serving/tp_serve.py --model $M --tp 1 --modes "${MODES:-int2}" --contexts "" \
      --batch-decode "${SPECS:-32768x256@8}" --graph-max-bs "${GRAPH_BS:-8}" --mem-fraction 0.85 \
      --startup-timeout 400 --out "$OUT" 2>&1 | filt | tee "$OUT/tp_serve.log"
    pack batch_decode
    ;;
  capacity)
    timeout 595 python3 benchmark/serving/bench_serving.py --model $M --workloads "${WORKLOADS:-32768:256}" \
      --modes "${MODES:-int2,fi_bf16,fi_fp8}" --concurrency "${CONCURRENCY:-max}" --run "${RUN:-$(date +%Y%m%d-%H%M)}" \
      --time-budget "${BUDGET:-550}" --flags="${FLAGS:-}" --out "$OUT" 2>&1 | filt | tee "$OUT/bench_serving.log"
    pack capacity
    ;;
  capacity_bg)
    # capacity past one 10-minute call: the driver runs detached (its own process session outlives this call) into
    # $HOME/bg_out, with BUDGET seconds (default 1500); later calls on the warm machine run `wait_bg` to follow it and
    # bring its files back (PROFILE_STEPS=N: also a trace of N decode steps per workload once all requests decode,
    # in logs/traces; benchmark/serving/kernel_table.py summarizes it). SM clock, power and its throttle reasons are
    # logged every 500 ms beside the run (logs/gpu_clocks.csv): at batch >= 8 the H200 decodes at its power cap.
    # The 2k / 16k job on a fresh H200 with FLAGS=--incremental-streaming-output (run s58-reason): int2 240 s startup
    # + 498 s, FI BF16 108 s + 387 s (BUDGET=1400 held both). At 32k (run s52-32k): int2 264 s startup, C = 64 124 s,
    # C = 130 214 s; FI FP8 76-118 s startup + 125 s. Run s59-cap (100k at most, then 32k at 8 / 22 / most): int2 294 s
    # startup + 624 s, FI BF16 146 s + 252 s. Sourcing the runtime takes up to ~26 s of a call
    # (less once gpu_env.sh has the versions cached on the machine): keep WAIT <= 540.
    rm -rf "$HOME/bg_out"; mkdir -p "$HOME/bg_out/logs"
    setsid nohup timeout "$(( ${BUDGET:-1500} + 60 ))" nvidia-smi --format=csv,nounits -lms 500 \
      --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,clocks_event_reasons.active \
      > "$HOME/bg_out/logs/gpu_clocks.csv" 2>&1 < /dev/null &
    setsid nohup timeout "$(( ${BUDGET:-1500} + 60 ))" python3 benchmark/serving/bench_serving.py --model $M \
      --workloads "${WORKLOADS:-2048:16384}" --modes "${MODES:-int2,fi_bf16}" --concurrency "${CONCURRENCY:-max}" \
      --run "${RUN:-$(date +%Y%m%d-%H%M)}" --time-budget "${BUDGET:-1500}" --profile-steps "${PROFILE_STEPS:-0}" \
      --flags="${FLAGS:-}" \
      --out "$HOME/bg_out" \
      > "$HOME/bg_out/bench_serving.log" 2>&1 < /dev/null &
    echo "started bench_serving in the background (pid $!): follow it with serving_session.sh wait_bg"
    ;;
  wait_bg)
    # follow capacity_bg's run for up to WAIT seconds (default 540), then copy what it wrote so far to $OUT
    t0=$(date +%s)
    while pgrep -f "bench_serving.py" > /dev/null && [ $(( $(date +%s) - t0 )) -lt "${WAIT:-540}" ]; do sleep 10; done
    pgrep -f "bench_serving.py" > /dev/null && echo "still running" || { echo "finished"; pkill -f "nvidia-smi --format=csv,nounits -lms 500"; }
    grep -v "^\[" "$HOME/bg_out/bench_serving.log" | tail -20
    cp "$HOME"/bg_out/*.json "$HOME"/bg_out/*.png "$HOME/bg_out/bench_serving.log" "$OUT"/ 2>/dev/null
    (cd "$HOME/bg_out" && ls -d logs 2>/dev/null | xargs -r tar czf "$OUT/logs_bg.tgz")
    ;;
  *) echo "usage: $0 latency|latency2|serve|throughput100k|latency_cuda|batch_decode|capacity|capacity_bg|wait_bg"; exit 2 ;;
esac
