#!/usr/bin/env bash
# The README's test command: the whole CPU test suite (Triton kernels run in the interpreter, fp32).
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
python -m pytest -q test "$@"
