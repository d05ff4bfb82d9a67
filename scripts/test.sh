#!/usr/bin/env bash
# The README's test command.
#   part 1: the whole CPU test suite in .venv (Triton kernels run in the interpreter, fp32); the
#           tests that need SGLang skip there.
#   part 2: only when .venv-serve exists, or OSCAR_SETUP_SERVE=1 (CI sets it) asks for it to be built here: the SGLang
#           tests in it:
#           (a) test_srt_plugin.py, test_srt_absorb_v_sglang.py and test_srt_backend_graph.py whole (their `slow`
#               CPU-server tests included), and four of the real CPU-server tests (radix hits, sink rows, chunked
#               prefill, page 64) to balance the two streams;
#           (b) the other real CPU-server tests, `-m slow test/test_srt_server_sglang.py` (TP=1/2 over gloo, the soak
#               of 500 requests, admission behind a chunked prefill, the eval drivers).
#   Jobs: (b) runs in the background beside part 1 and then (a) (OSCAR_TEST_JOBS=2, the default). Each CPU server is
#   one mostly single-threaded Python process (the interpreter runs its kernels), so the two streams use the two cores
#   of a CI machine. With OSCAR_SETUP_SERVE=1 and no .venv-serve yet, the background stream first builds it
#   (scripts/setup_serve.sh, mostly downloads) while part 1 runs; (a) waits for it. (b)'s output is kept in a file and
#   printed when it ends. OSCAR_TEST_JOBS=1 runs everything in a row. Measured: a fresh clone's `.ci/run` took 19.9 min on
#   a 2-core machine with nothing else running (28.6 min beside other CPU jobs; the build ran beside part 1).
#   OSCAR_TEST_SERVE=0 skips part 2; OSCAR_SOAK_REQUESTS sets the soak's request count;
#   OSCAR_TEST_TP=2,4,8 adds TP=4/8 (one KV head per rank; ~4 min and ~12 GiB more).
# Arguments go to part 1's pytest only. Any failure fails the script.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
SERVER=test/test_srt_server_sglang.py
MOVED=(test_radix_hits_follow_the_window_rules test_sink_rows_taken_by_the_radix_cache_are_read_as_int2
       test_chunked_prefill_follows_the_window_rules test_page_size_64_serves_the_tokens_of_page_size_1)
SGLANG_TESTS=(test/test_srt_plugin.py test/test_srt_absorb_v_sglang.py test/test_srt_backend_graph.py)
DESELECT=()
for t in "${MOVED[@]}"; do DESELECT+=(--deselect "$SERVER::$t"); done
JOBS=${OSCAR_TEST_JOBS:-2}
case "$JOBS" in 1|2) ;; *) echo "OSCAR_TEST_JOBS must be 1 or 2, got '$JOBS'" >&2; exit 2 ;; esac

serve_ok() { [ -x .venv-serve/bin/python ] && .venv-serve/bin/python -c "import sglang, sglang_oscar" 2>/dev/null; }
serve=1
build=0
if [ "${OSCAR_TEST_SERVE:-1}" = "0" ]; then
    serve=0; echo "== test.sh part 2: SGLang tests skipped (OSCAR_TEST_SERVE=0)"
elif ! serve_ok; then
    if [ "${OSCAR_SETUP_SERVE:-0}" = "1" ]; then
        build=1; echo "== test.sh part 2: .venv-serve is built first (OSCAR_SETUP_SERVE=1), beside part 1"
    else
        serve=0; echo "== test.sh part 2: SGLang tests skipped (no .venv-serve; build it with OSCAR_SETUP_SERVE=1 bash scripts/setup.sh)"
    fi
fi
marks=$(mktemp -d -t oscar-test.XXXXXX)
build_serve() {
    if [ "$build" = 1 ]; then
        if bash scripts/setup_serve.sh > "$marks/setup.log" 2>&1; then touch "$marks/built"
        else touch "$marks/failed"; echo "test.sh: building .venv-serve failed:"; tail -30 "$marks/setup.log"; return 1; fi
        tail -2 "$marks/setup.log"
    fi
}
wait_serve() {  # the foreground stream, before (a): the background stream's build has finished
    [ "$build" = 1 ] || return 0
    while [ ! -e "$marks/built" ] && [ ! -e "$marks/failed" ]; do sleep 5; done
    [ -e "$marks/built" ]
}

server_tests() {
    (. .venv-serve/bin/activate && OSCAR_TEST_TP=${OSCAR_TEST_TP:-2} \
        python -m pytest -q --timeout 1800 -m slow -s "$SERVER" "${DESELECT[@]}")
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
    echo "== test.sh part 2 (b), in the background (output when it ends): real CPU-server tests (.venv-serve): -m slow $SERVER, but ${MOVED[*]}"
    (build_serve && server_tests) >"$bg_log" 2>&1 &
    bg_pid=$!
    # Ctrl-C / TERM must not leave the background tests' servers running (a non-interactive shell starts
    # background jobs with SIGINT ignored): stop the whole tree, children first
    trap 'kill_tree "$bg_pid"; exit 130' INT TERM
fi

fg_rc=0
echo "== test.sh part 1: main CPU suite (.venv; tests that need SGLang skip here)"
(. .venv/bin/activate && python -m pytest -q test "$@") || fg_rc=$?

if [ "$serve" = 1 ] && [ "$JOBS" = 1 ]; then
    build_serve || fg_rc=1
fi
if [ "$serve" = 1 ]; then
    if wait_serve; then
        echo "== test.sh part 2 (a): SGLang plugin/backend tests incl. their CPU-server tests, and ${MOVED[*]} (.venv-serve)"
        (. .venv-serve/bin/activate && python -m pytest -q --timeout 1800 "${SGLANG_TESTS[@]}") || fg_rc=$?
        (. .venv-serve/bin/activate && python -m pytest -q --timeout 1800 -m slow -s "${MOVED[@]/#/$SERVER::}") || fg_rc=$?
    else
        fg_rc=1; echo "test.sh: part 2 (a) not run: building .venv-serve failed (its log: part 2 (b)'s output)"
    fi
fi

bg_rc=0
if [ -n "$bg_pid" ]; then
    echo "== test.sh part 2 (b): waiting for the real CPU-server tests"
    wait "$bg_pid" || bg_rc=$?
    bg_pid=""
    echo "== test.sh part 2 (b) output (exit status $bg_rc):"
    cat "$bg_log"
    rm -f "$bg_log"
elif [ "$serve" = 1 ] && [ -z "$(ls "$marks"/failed 2>/dev/null)" ]; then
    echo "== test.sh part 2 (b): real CPU-server tests (.venv-serve): -m slow $SERVER, but ${MOVED[*]}"
    server_tests || bg_rc=$?
fi
rm -rf "$marks"

if [ "$fg_rc" != 0 ] || [ "$bg_rc" != 0 ]; then
    echo "test.sh: FAILED (part 1 / 2a exit status $fg_rc, part 2b exit status $bg_rc)" >&2
    exit 1
fi
echo "test.sh: all parts passed"
