#!/usr/bin/env bash
# Generic gpqa driver: start `python -m sglang_oscar.launch_server ... --kv-cache-dtype int2` with a
# rotation bundle, wait until it answers, run `python -m sglang_oscar.eval.bench gpqa`, stop it.
#
#   MODEL=/models/Qwen3-8B BUNDLE=/path/bundle.safetensors bash rotation/eval_oscar_gpqa.sh [--dry-run]
#
# Environment (defaults): MODEL (required), MODEL_NAME (basename of MODEL), BUNDLE (the
# METHOD/COMPOSITION/GROUP_SIZE bundle of the calibration dir), KV_DTYPE (int2; auto = BF16
# baseline), TP_SIZE (1), GPUS (0..TP_SIZE-1), PORT (30000), MEM_FRAC (0.8), MAX_RUNNING (64),
# CUDA_GRAPH_MAX_BS (32), GROUP_SIZE (128), N_REPEATS (5), MAX_NEW_TOKENS (32768),
# TEMPERATURE (0.6), TOP_P (0.95), TOP_K (20), NUM_WORKERS (32), NUM_EXAMPLES (all),
# REASONING_PARSER, K_CLIP/V_CLIP (bundle's), ABSORB_V (0: V rotated at runtime), EVAL_DATA (task default), RUN_DIR, RUN_TAG,
# EXTRA_SERVER_ARGS, SERVER_TIMEOUT (1800 s), PY (python).
set -euo pipefail
: "${MODEL:?set MODEL to a hub id or a model directory}"
MODEL_NAME=${MODEL_NAME:-$(basename "$MODEL")}
# shellcheck source=common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
parse_args "$@"
oscar_eval gpqa
