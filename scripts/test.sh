#!/usr/bin/env bash
# The README's test command.
#   part 1: the whole CPU test suite in .venv (Triton kernels run in the interpreter, fp32); the
#           tests that need SGLang skip there.
#   part 2: only when .venv-serve exists (scripts/setup.sh with OSCAR_SETUP_SERVE=1; CI builds it):
#           the SGLang tests in it:
#           (a) test_srt_plugin.py, test_srt_absorb_v_sglang.py and test_srt_backend_graph.py whole
#               (their `slow` CPU-server tests included; ~13 min on 2 cores);
#           (b) the real CPU-server tests, `-m slow test/test_srt_server_sglang.py` (radix, sink rows,
#               chunked prefill, TP=1/2 over gloo, soak of 500 requests; ~20 min on 2 cores).
#   Jobs: (b) runs in the background beside part 1 and then (a) (OSCAR_TEST_JOBS=2, the default). Each
#   CPU server is one mostly single-threaded Python process (the interpreter runs its kernels), so the
#   two streams use the two cores of a CI machine: ~21 min instead of ~37 in a row. (b)'s output is
#   kept in a file and printed when it ends. OSCAR_TEST_JOBS=1 runs everything in a row, as before.
#   OSCAR_TEST_SERVE=0 skips part 2; OSCAR_SOAK_REQUESTS sets the soak's request count;
#   OSCAR_TEST_TP=2,4,8 adds TP=4/8 (one KV head per rank; ~4 min and ~12 GiB more).
# Arguments go to part 1's pytest only. Any failure fails the script.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
SGLANG_TESTS=(test/test_srt_plugin.py test/test_srt_absorb_v_sglang.py test/test_srt_backend_graph.py)
SERVER_TESTS=(test/test_srt_server_sglang.py)
JOBS=${OSCAR_TEST_JOBS:-2}
case "$JOBS" in 1|2) ;; *) echo "OSCAR_TEST_JOBS must be 1 or 2, got '$JOBS'" >&2; exit 2 ;; esac

serve=1
if [ "${OSCAR_TEST_SERVE:-1}" = "0" ]; then
    serve=0; echo "== test.sh part 2: SGLang tests skipped (OSCAR_TEST_SERVE=0)"
elif [ ! -x .venv-serve/bin/python ]; then
    serve=0; echo "== test.sh part 2: SGLang tests skipped (no .venv-serve; build it with OSCAR_SETUP_SERVE=1 bash scripts/setup.sh)"
fi

server_tests() {
    (. .venv-serve/bin/activate && OSCAR_TEST_TP=${OSCAR_TEST_TP:-2} \
        python -m pytest -q --timeout 1800 -m slow -s "${SERVER_TESTS[@]}")
}

kill_tree() {
    local pid=$1 child
    [ -n "$pid" ] || return 0
    for child in $(pgrep -P "$pid" 2>/dev/null); do kill_tree "$child"; done
    kill "$pid" 2>/dev/null || true
}

bg_pid=""
bg_log=""
if [ "$serve" = 1 ] && [ "$JOBS" = 2 ]; then
    bg_log=$(mktemp -t oscar-server-tests.XXXXXX.log)
    echo "== test.sh part 2 (b), in the background (output when it ends): real CPU-server tests (.venv-serve): -m slow ${SERVER_TESTS[*]}"
    server_tests >"$bg_log" 2>&1 &
    bg_pid=$!
    # Ctrl-C / TERM must not leave the background tests' servers running (a non-interactive shell starts
    # background jobs with SIGINT ignored): stop the whole tree, children first
    trap 'kill_tree "$bg_pid"; exit 130' INT TERM
fi

fg_rc=0
echo "== test.sh part 1: main CPU suite (.venv; tests that need SGLang skip here)"
(. .venv/bin/activate && python -m pytest -q test "$@") || fg_rc=$?

if [ "$serve" = 1 ]; then
    echo "== test.sh part 2 (a): SGLang plugin/backend tests incl. their CPU-server tests (.venv-serve): ${SGLANG_TESTS[*]}"
    (. .venv-serve/bin/activate && python -m pytest -q --timeout 1800 "${SGLANG_TESTS[@]}") || fg_rc=$?
fi

bg_rc=0
if [ -n "$bg_pid" ]; then
    echo "== test.sh part 2 (b): waiting for the real CPU-server tests"
    wait "$bg_pid" || bg_rc=$?
    bg_pid=""
    echo "== test.sh part 2 (b) output (exit status $bg_rc):"
    cat "$bg_log"
    rm -f "$bg_log"
elif [ "$serve" = 1 ]; then
    echo "== test.sh part 2 (b): real CPU-server tests (.venv-serve): -m slow ${SERVER_TESTS[*]}"
    server_tests || bg_rc=$?
fi

if [ "$fg_rc" != 0 ] || [ "$bg_rc" != 0 ]; then
    echo "test.sh: FAILED (part 1 / 2a exit status $fg_rc, part 2b exit status $bg_rc)" >&2
    exit 1
fi
echo "test.sh: all parts passed"
