#!/usr/bin/env bash
# Shared by rotation/<model>/*.sh and the generic eval drivers; sourced, never run.
#
# Phases (docs/pipeline.md):
#   1 save_qkv.sh          capture Q/K/V statistics on calibration text (DUMP_KVCACHE_TOKENS tokens)
#                          and fit the default bundle -- capture and fit are one step in this pipeline
#   2 compute_rotation.sh  fit a variant (METHOD, COMPOSITION, GROUP_SIZE, clip) into rotations/
#   3 eval_*.sh            start the int2 server with a bundle, run a benchmark, stop the server
# Output: rotation/<model>/<DATASET>/seq<T>_prompt<N>_group<G>/{qkv_dumps,rotations,_eval_*}
# Every script takes --dry-run: print the commands, run nothing.

# ---------------------------------------------------------------------------- options
DRY_RUN=0
parse_args() {
    local a
    for a in "$@"; do
        case "$a" in
            --dry-run) DRY_RUN=1 ;;
            -h|--help) sed -n '2,/^$/s/^# \{0,1\}//p' "$0"; exit 0 ;;
            *) echo "error: unknown argument $a (only --dry-run; settings are environment variables)" >&2; exit 2 ;;
        esac
    done
}

# Print a command (shell-quoted, so it can be pasted), then run it unless --dry-run.
run_cmd() {
    printf '+'
    printf ' %q' "$@"
    printf '\n'
    if [ "$DRY_RUN" = 0 ]; then "$@"; fi
}

# ---------------------------------------------------------------------------- settings
# Per-model scripts set MODEL_NAME and model defaults (MODEL, TP_SIZE, ...) before sourcing this.
: "${MODEL_NAME:?set MODEL_NAME before sourcing common.sh}"
: "${MODEL:?set MODEL (a hub id or a local model directory)}"
ROTATION_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PY=${PY:-python}
DUMP_KVCACHE_TOKENS=${DUMP_KVCACHE_TOKENS:-30000}
SEQ_LEN=${SEQ_LEN:-2048}
HELDOUT_TOKENS=${HELDOUT_TOKENS:-4096}
GROUP_SIZE=${GROUP_SIZE:-128}
DATASET=${DATASET:-stdlib}
TP_SIZE=${TP_SIZE:-1}
GPU=${GPU:-0}
METHOD=${METHOD:-oscar}
COMPOSITION=${COMPOSITION:-u_h}
DEVICE=${DEVICE:-cuda}
EXTRA_CALIB_ARGS=${EXTRA_CALIB_ARGS:-}
if [ -n "${HF_HOME:-}" ]; then export HF_HOME; fi

# Calibration must never see an evaluation set (the seed calibrated on GPQA and evaluated on GPQA).
check_dataset() {
    local lower
    lower=$(printf '%s' "$DATASET" | tr '[:upper:]' '[:lower:]')
    case "$lower" in
        *gpqa*|*aime*|*math500*|*math-500*|*humaneval*|*livecodebench*|*lcb*|*ruler*|*niah*)
            echo "error: DATASET=$DATASET looks like an evaluation set; calibrate on other text" \
                 "(default: stdlib docstrings, or DATASET=/path/to/text.txt)" >&2
            exit 2 ;;
    esac
    if [ "$DATASET" = stdlib ]; then
        DATASET_NAME=stdlib
        TEXT_ARGS=()
    else
        if [ ! -f "$DATASET" ] && [ "$DRY_RUN" = 0 ]; then
            echo "error: DATASET=$DATASET is neither 'stdlib' nor a readable text file" >&2
            exit 2
        fi
        DATASET_NAME=$(basename "${DATASET%.*}")
        TEXT_ARGS=(--text-file "$DATASET")
    fi
}

# seq<T>_prompt<N>_group<G>: T statistics tokens, N calibration windows of SEQ_LEN (the seed's
# "prompts"), G the quantization group.
calib_dir() {
    local n=$(( DUMP_KVCACHE_TOKENS / SEQ_LEN ))
    if [ "$n" -lt 1 ]; then n=1; fi
    CALIB_DIR=${CALIB_DIR:-$ROTATION_ROOT/$MODEL_NAME/$DATASET_NAME/seq${DUMP_KVCACHE_TOKENS}_prompt${n}_group${GROUP_SIZE}}
}

bundle_path() {  # the bundle a METHOD/COMPOSITION/GROUP_SIZE fit writes
    BUNDLE_FILE=$CALIB_DIR/rotations/${METHOD}_${COMPOSITION}_g${GROUP_SIZE}.safetensors
}

# ---------------------------------------------------------------------------- phases 1 and 2
# One calibrate run: capture statistics (DUMP_KVCACHE_TOKENS tokens, held-out windows for the
# clip ratios) and fit METHOD into rotations/. $1 = phase label for the log name.
calibrate_run() {
    local phase=$1
    check_dataset
    calib_dir
    bundle_path
    run_cmd mkdir -p "$CALIB_DIR/qkv_dumps" "$CALIB_DIR/rotations"
    local log=$CALIB_DIR/qkv_dumps/${phase}_${METHOD}_${COMPOSITION}_g${GROUP_SIZE}.log
    local -a cmd=(env CUDA_VISIBLE_DEVICES="$GPU" "$PY" -m sglang_oscar.calibrate --model "$MODEL"
                  --out "$BUNDLE_FILE" --method "$METHOD" --composition "$COMPOSITION"
                  --group-k "$GROUP_SIZE" --group-v "$GROUP_SIZE" --tokens "$DUMP_KVCACHE_TOKENS"
                  --seq-len "$SEQ_LEN" --heldout-tokens "$HELDOUT_TOKENS" --device "$DEVICE" "${TEXT_ARGS[@]}")
    # shellcheck disable=SC2206  # EXTRA_CALIB_ARGS is a user-supplied, space-separated flag list
    local -a extra=($EXTRA_CALIB_ARGS)
    cmd+=("${extra[@]}")
    echo "# $phase: $MODEL_NAME -> $BUNDLE_FILE (log $log)"
    if [ "$DRY_RUN" = 1 ]; then
        run_cmd "${cmd[@]}"
    else
        run_cmd "${cmd[@]}" 2>&1 | tee "$log"
        echo "# publish: $PY -m sglang_oscar.zoo add $BUNDLE_FILE --zoo zoo --name ${MODEL_NAME}_${METHOD}_g${GROUP_SIZE}"
    fi
}

# ---------------------------------------------------------------------------- phase 3
# Start the int2 server with a bundle, wait until it answers, run one benchmark, stop the server.
# Logs stay in $RUN_DIR (server.log, bench.log, <task>.json).
PORT=${PORT:-30000}
MEM_FRAC=${MEM_FRAC:-0.8}
MAX_RUNNING=${MAX_RUNNING:-64}
CUDA_GRAPH_MAX_BS=${CUDA_GRAPH_MAX_BS:-32}
KV_DTYPE=${KV_DTYPE:-int2}          # auto = the BF16 baseline with the same driver
N_REPEATS=${N_REPEATS:-5}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-32768}
TEMPERATURE=${TEMPERATURE:-0.6}
TOP_P=${TOP_P:-0.95}
TOP_K=${TOP_K:-20}
NUM_WORKERS=${NUM_WORKERS:-32}
NUM_EXAMPLES=${NUM_EXAMPLES:-}
REASONING_PARSER=${REASONING_PARSER:-}
K_CLIP=${K_CLIP:-}                  # empty: the bundle's calibrated per-layer clip ratios
V_CLIP=${V_CLIP:-}
ABSORB_V=${ABSORB_V:-}              # 0: V rotated at runtime (models whose weights V absorption does not cover)
SERVER_TIMEOUT=${SERVER_TIMEOUT:-1800}
EXTRA_SERVER_ARGS=${EXTRA_SERVER_ARGS:-}
GPUS=${GPUS:-$(seq -s, 0 $(( TP_SIZE - 1 )))}

if [ -z "${BENCH_ARGS+x}" ]; then BENCH_ARGS=(); fi  # drivers add task options (LCB date window)

SERVER_PID=
stop_server() {
    if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
        echo "# stopping server (pid $SERVER_PID)"
        kill "$SERVER_PID" 2>/dev/null || true
        wait "$SERVER_PID" 2>/dev/null || true
    fi
}

wait_healthy() {  # poll /v1/models with the bench client (no curl needed)
    run_cmd "$PY" -c "import sys; from sglang_oscar.eval.openai_client import OpenAIClient as C; \
print(C(sys.argv[1]).wait_ready(float(sys.argv[2])))" "http://127.0.0.1:$PORT" "$SERVER_TIMEOUT"
}

oscar_eval() {
    local task=$1
    check_dataset
    calib_dir
    bundle_path
    BUNDLE=${BUNDLE:-$BUNDLE_FILE}
    RUN_DIR=${RUN_DIR:-$CALIB_DIR/_eval_${task}_${KV_DTYPE}${RUN_TAG:+_$RUN_TAG}}
    if [ "$KV_DTYPE" = int2 ] && [ ! -f "$BUNDLE" ] && [ "$DRY_RUN" = 0 ]; then
        echo "error: bundle $BUNDLE not found; run save_qkv.sh / compute_rotation.sh, or set BUNDLE" >&2
        exit 2
    fi
    run_cmd mkdir -p "$RUN_DIR"
    local -a env_args=(CUDA_VISIBLE_DEVICES="$GPUS")
    local -a server=("$PY" -m sglang_oscar.launch_server --model-path "$MODEL" --tp "$TP_SIZE" --port "$PORT"
                     --kv-cache-dtype "$KV_DTYPE" --mem-fraction-static "$MEM_FRAC"
                     --max-running-requests "$MAX_RUNNING" --cuda-graph-max-bs "$CUDA_GRAPH_MAX_BS")
    if [ "$KV_DTYPE" = int2 ]; then
        env_args+=(SGLANG_OSCAR_BUNDLE="$BUNDLE")
        server+=(--kv-cache-quant-group-size "$GROUP_SIZE")
        if [ -n "$K_CLIP" ]; then env_args+=(SGLANG_OSCAR_K_CLIP_RATIO="$K_CLIP"); fi
        if [ -n "$V_CLIP" ]; then env_args+=(SGLANG_OSCAR_V_CLIP_RATIO="$V_CLIP"); fi
        if [ -n "$ABSORB_V" ]; then env_args+=(SGLANG_OSCAR_ABSORB_V_ROTATION="$ABSORB_V"); fi
    fi
    if [ -n "$REASONING_PARSER" ]; then server+=(--reasoning-parser "$REASONING_PARSER"); fi
    # shellcheck disable=SC2206  # a user-supplied, space-separated flag list
    local -a extra=($EXTRA_SERVER_ARGS)
    server+=("${extra[@]}")

    local -a bench=("$PY" -m sglang_oscar.eval.bench "$task" --base-url "http://127.0.0.1:$PORT"
                    --label "$MODEL_NAME/$KV_DTYPE" --out "$RUN_DIR/$task.json" --repeats "$N_REPEATS"
                    --max-tokens "$MAX_NEW_TOKENS" --temperature "$TEMPERATURE" --top-p "$TOP_P" --top-k "$TOP_K"
                    --concurrency "$NUM_WORKERS")
    if [ -n "$NUM_EXAMPLES" ]; then bench+=(--limit "$NUM_EXAMPLES"); fi
    if [ -n "${EVAL_DATA:-}" ]; then bench+=(--data "$EVAL_DATA"); fi
    bench+=("${BENCH_ARGS[@]}")

    echo "# eval $task: $MODEL_NAME kv=$KV_DTYPE bundle=$BUNDLE -> $RUN_DIR"
    if [ "$DRY_RUN" = 1 ]; then
        run_cmd env "${env_args[@]}" "${server[@]}"
        wait_healthy
        run_cmd "${bench[@]}"
        return 0
    fi
    trap stop_server EXIT INT TERM
    printf '+ env'; printf ' %q' "${env_args[@]}" "${server[@]}"; printf ' > %q 2>&1 &\n' "$RUN_DIR/server.log"
    env "${env_args[@]}" "${server[@]}" > "$RUN_DIR/server.log" 2>&1 &
    SERVER_PID=$!
    if ! wait_healthy; then
        echo "error: server did not come up; last lines of $RUN_DIR/server.log:" >&2
        tail -n 40 "$RUN_DIR/server.log" >&2
        exit 1
    fi
    local rc=0
    run_cmd "${bench[@]}" 2>&1 | tee "$RUN_DIR/bench.log" || rc=$?
    stop_server
    trap - EXIT INT TERM
    return "$rc"
}
