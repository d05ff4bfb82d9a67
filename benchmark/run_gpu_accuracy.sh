#!/usr/bin/env bash
# The accuracy table's NIAH stage on the GPU machine (docs/results/accuracy.md).
#
# The GGUF of SmolLM2 (98 MB) does not fit one device call (64 MiB with the tree), so it travels in
# three parts made here by `bash benchmark/run_gpu_accuracy.sh pack` (into the ignored .acc/), and
# the bundles calibrated on CPU (`python -m sglang_oscar.eval.compare --stage calibrate --out-dir
# runs/acc_full`) travel with the last part:
#   call 1 (carry .acc/p1):               bash benchmark/run_gpu_accuracy.sh part .acc/p1
#   call 2 (carry .acc/p2):               bash benchmark/run_gpu_accuracy.sh part .acc/p2
#   call 3 (carry .acc/p3, runs/acc_full): bash benchmark/run_gpu_accuracy.sh run
# Calls 2 and 3 must follow while the machine is warm (files outside the checkout stay 30 s).
# STEPS: what `run` measures, in order (default "8192 4096 ppl 2048"); a step is ppl, LEN, LEN:TASK[+TASK] or
# LEN:TASK:FIRST:N (e.g. "8192:niah_multivalue:0:25 8192:niah_multivalue:25:25 4096 2048"); STEP_TIMEOUT (600 s)
# bounds each, and a step cut short returns the samples it finished (its JSON is rewritten after every sample). The
# NIAH files come back in one niah.tgz (unpack into runs/acc_full). ANSWER: the NIAH answer rule (first_line, the default, or whole:
# RULER's string_match_all over every line of the answer, eval/niah.ANSWER_RULES); its files are named niah_*_whole.json.
# `run` checks the GGUF's checksum, then writes niah.tgz, ppl.json and a log under $OUT; the
# report is built here: copy them into runs/acc_full and run `--stage report` (see accuracy.md).
set -euo pipefail
cd "$(dirname "$0")/.."
METHODS=${METHODS:-bf16,int2_naive,int2_hadamard_clip,int2_oscar_clip,int4_hadamard,int2_best}
ANSWER=${ANSWER:-first_line}
GG=/tmp/oscar-gguf
case "${1:-}" in
pack)
    src=$(.venv/bin/python -c "from sglang_oscar.models import smollm2_gguf_path as p; print(p())")
    rm -rf .acc && mkdir -p .acc/p1 .acc/p2 .acc/p3
    grep -qx '/.acc/' .git/info/exclude || echo /.acc/ >> .git/info/exclude
    split -n 3 -d "$src" .acc/part
    mv .acc/part00 .acc/p1/; mv .acc/part01 .acc/p2/; mv .acc/part02 .acc/p3/
    md5sum "$src" | cut -d' ' -f1 > .acc/p3/md5
    v=$(.venv/bin/python -c "import gguf, importlib.metadata as m; print(m.version('gguf'))")
    .venv/bin/python -m pip download -q --no-deps --only-binary=:all: -d .acc/p3 "gguf==$v"
    ls -la .acc/*
    ;;
part)
    mkdir -p $GG && cp "$2"/part0* $GG/ && ls $GG
    ;;
run)
    cp .acc/p3/part0* $GG/
    cat $GG/part0* > $GG/SmolLM2-135M-Instruct.Q4_1.gguf
    [ "$(md5sum $GG/SmolLM2-135M-Instruct.Q4_1.gguf | cut -d' ' -f1)" = "$(cat .acc/p3/md5)" ] \
        || { echo "GGUF checksum mismatch: run the three calls again" >&2; exit 1; }
    python3 -m pip install -q --no-index --no-deps --target /tmp/oscar-site .acc/p3/gguf-*.whl
    export PYTHONPATH=/tmp/oscar-site:$PWD/python SGLANG_OSCAR_SMOLLM2_GGUF=$GG/SmolLM2-135M-Instruct.Q4_1.gguf
    export PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
    step_run() {  # one step of STEPS: ppl, LEN, LEN:TASK[+TASK...] (a subset of the NIAH tasks at that length), or
        # LEN:TASK:FIRST:N (samples FIRST .. FIRST+N-1 of that cell; the report merges the parts)
        local step=$1 len tasks="" tag
        if [ "$step" = ppl ]; then
            python3 -m sglang_oscar.eval.compare --stage ppl --device cuda --out-dir runs/acc_full \
                --methods "$METHODS" --quiet 2>&1 | grep -v -i "warn\|de-quantizing\|Loading weights" \
                | tee -a "$OUT/run.log"
            cp runs/acc_full/ppl.json "$OUT/"
            return
        fi
        local tk first n part=""
        IFS=: read -r len tk first n <<< "$step"
        tag="_$len"
        if [ -n "$tk" ]; then tasks="--niah-tasks ${tk//+/,}"; tag="${tag}_${tk//+/_}"; fi
        if [ -n "$first" ]; then part="--niah-first $first --niah-per-task $n"; tag="${tag}_from$first"; fi
        if [ "$ANSWER" != first_line ]; then tag="${tag}_$ANSWER"; fi
        timeout "${STEP_TIMEOUT:-600}" python3 -m sglang_oscar.eval.compare --stage niah --device cuda --out-dir runs/acc_full \
            --methods "$METHODS" --niah-lengths "$len" $tasks $part --niah-answer "$ANSWER" --niah-tag "$tag" --quiet 2>&1 \
            | grep -v -i "warn\|de-quantizing\|Loading weights" | tee -a "$OUT/run.log" || true
    }
    # the longest contexts first, so a run cut short still has them; PPL (4 x 8k windows) before 2k. PARALLEL=1 runs the
    # NIAH steps as concurrent processes (one small model leaves the GPU and the CPU cores mostly idle: 16 steps of
    # 12-25 samples finish in about 300 s where one process does about 13 multivalue samples).
    for step in ${STEPS:-8192 4096 ppl 2048}; do
        if [ "${PARALLEL:-0}" = 1 ] && [ "$step" != ppl ]; then step_run "$step" & else step_run "$step"; fi
    done
    wait
    (cd runs/acc_full && tar czf "$OUT/niah.tgz" niah_*.json) || true
    ;;
*)
    echo "usage: bash benchmark/run_gpu_accuracy.sh pack | part DIR | run" >&2; exit 2
    ;;
esac
