#!/usr/bin/env bash
# Phase 2: fit a bundle variant into rotations/<METHOD>_<COMPOSITION>_g<GROUP_SIZE>.safetensors.
# METHOD (oscar; identity|hadamard|pca|oscar|balanced), COMPOSITION (u_h), GROUP_SIZE (128),
# DUMP_KVCACHE_TOKENS (30000), SEQ_LEN (2048), HELDOUT_TOKENS (4096, clip calibration),
# EXTRA_CALIB_ARGS (e.g. "--center-k --per-head" or "--clip-k 0.96 --clip-v 0.92").
# Statistics are not persisted between runs, so this re-captures. Options: --dry-run.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=/dev/null
. "$HERE/model.sh"
# shellcheck source=../common.sh
. "$HERE/../common.sh"
parse_args "$@"
calibrate_run compute_rotation
