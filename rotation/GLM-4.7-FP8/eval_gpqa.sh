#!/usr/bin/env bash
# Phase 3: gpqa with this model's defaults through rotation/eval_oscar_gpqa.sh (int2 server with the
# bundle of the calibration dir; KV_DTYPE=auto for the BF16 baseline). Options: --dry-run.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=/dev/null
. "$HERE/model.sh"
exec bash "$HERE/../eval_oscar_gpqa.sh" "$@"
