#!/usr/bin/env bash
# Phase 1: capture Q/K/V statistics (DUMP_KVCACHE_TOKENS=30000 tokens of calibration text,
# DATASET=stdlib docstrings by default, or a text file) and fit the default bundle
# (METHOD=oscar, COMPOSITION=u_h, GROUP_SIZE=128). Capture and fit are one step here
# (python -m sglang_oscar.calibrate); qkv_dumps/ keeps the log. Options: --dry-run.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=/dev/null
. "$HERE/model.sh"
# shellcheck source=../common.sh
. "$HERE/../common.sh"
parse_args "$@"
calibrate_run save_qkv
