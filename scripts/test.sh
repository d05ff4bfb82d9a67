#!/usr/bin/env bash
# The README's test command.
#   part 1: the whole CPU test suite in .venv (Triton kernels run in the interpreter, fp32); the
#           tests that need SGLang skip there.
#   part 2: only when .venv-serve exists (scripts/setup.sh with OSCAR_SETUP_SERVE=1; CI builds it):
#           the SGLang tests in it: test_srt_plugin.py, test_srt_absorb_v_sglang.py and
#           test_srt_backend_graph.py whole (their `slow` CPU-server tests included), then the real
#           CPU-server tests, `-m slow test/test_srt_server_sglang.py` (radix, sink rows, chunked
#           prefill, TP=1/2 over gloo, soak of 500 requests; ~16 min on 2 cores).
#           OSCAR_TEST_SERVE=0 skips part 2; OSCAR_SOAK_REQUESTS sets the soak's request count;
#           OSCAR_TEST_TP=2,4,8 adds TP=4/8 (one KV head per rank; ~4 min and ~12 GiB more).
# Arguments go to part 1's pytest only. Any failure fails the script.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
SGLANG_TESTS=(test/test_srt_plugin.py test/test_srt_absorb_v_sglang.py test/test_srt_backend_graph.py)
SERVER_TESTS=(test/test_srt_server_sglang.py)

echo "== test.sh part 1/2: main CPU suite (.venv; tests that need SGLang skip here)"
(. .venv/bin/activate && python -m pytest -q test "$@")

if [ "${OSCAR_TEST_SERVE:-1}" = "0" ]; then
    echo "== test.sh part 2/2: SGLang tests skipped (OSCAR_TEST_SERVE=0)"
elif [ ! -x .venv-serve/bin/python ]; then
    echo "== test.sh part 2/2: SGLang tests skipped (no .venv-serve; build it with OSCAR_SETUP_SERVE=1 bash scripts/setup.sh)"
else
    echo "== test.sh part 2/2 (a): SGLang plugin/backend tests incl. their CPU-server tests (.venv-serve): ${SGLANG_TESTS[*]}"
    (. .venv-serve/bin/activate && python -m pytest -q --timeout 1800 "${SGLANG_TESTS[@]}")
    echo "== test.sh part 2/2 (b): real CPU-server tests (.venv-serve): -m slow ${SERVER_TESTS[*]}"
    (. .venv-serve/bin/activate && OSCAR_TEST_TP=${OSCAR_TEST_TP:-2} \
        python -m pytest -q --timeout 1800 -m slow -s "${SERVER_TESTS[@]}")
fi
