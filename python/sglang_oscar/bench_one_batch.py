"""`python -m sglang_oscar.bench_one_batch ...` = SGLang's one-batch latency benchmark with the int2 plugin.

sglang.benchmark.one_batch never calls load_plugins() (it builds the ModelRunner in-process), so
`--kv-cache-dtype int2` is unknown to it without this wrapper. TP 1 only: with TP > 1 it starts
one process per rank, which would need the plugin loaded there too (use the server instead)."""

import sys

from sglang_oscar.launch_server import require_sglang
from sglang_oscar.srt.launch import run_sglang_module

if __name__ == "__main__":
    require_sglang("python -m sglang_oscar.bench_one_batch")
    args = sys.argv[1:]
    for i, a in enumerate(args):
        tp = a.split("=", 1)[1] if a.startswith(("--tp-size=", "--tp=")) else (
            args[i + 1] if a in ("--tp-size", "--tp") and i + 1 < len(args) else None)
        if tp is not None and tp != "1":
            sys.exit("sglang_oscar.bench_one_batch runs at TP 1 only; for TP > 1 start "
                     "`python -m sglang_oscar.launch_server` and load it with sglang.bench_serving")
    run_sglang_module("sglang.benchmark.one_batch", args, load_plugins=True)
