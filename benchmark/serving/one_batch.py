"""bs=1 (or small-batch) prefill + decode latency per KV mode: one subprocess per mode, every
context in it (SGLang's one_batch sweeps --input-len, so model load, CUDA-graph capture and JIT are
paid once per mode; the first, smallest context is the warmup).

Runs `sglang.benchmark.one_batch` (stock modes) or `python -m sglang_oscar.bench_one_batch`
(int2) with dummy weights, reads its result jsonl (and what it prints), and writes rows
{mode, model, context, batch, metric, value, unit} to $OUT/one_batch_<device>.json.

    python benchmark/serving/one_batch.py --model benchmark/serving/configs/qwen3-8b \
        --contexts 8192,32768,65536,100000 --modes int2,fi_bf16,fi_fp8,triton_bf16 [--profile]

The served default against the general path and the baselines, in one call:

    python benchmark/serving/one_batch.py --contexts 32768,65536,100000 --modes int2,int2_page1,fi_bf16,fi_fp8

--profile adds a torch-profiler trace (GPU kernels only) of two decode steps per context, taken
after half the steps (the median over the other steps is unaffected), to $OUT/traces/; summarize
with benchmark/serving/kernel_table.py. Every mode of one invocation runs on the same GPU in the
same call, so the ratios compare like with like. A mode that fails is recorded with its error (rc
and log tail), never silently dropped.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from served_bundle import int2_bundle  # noqa: E402

_INT2 = ["--max-running-requests", "16"]
MODES = {
    # name: (attention backend, kv-cache dtype, extra flags, extra env)
    # int2: the served default (groups of 64, 2.5 bits/element; on Hopper the server itself picks pages of 64 and
    # the CUDA history stage and logs the choice), R = 16 requests' windows reserved; rotations from
    # $SGLANG_OSCAR_BUNDLE, by default the served format's INT4-key share without calibration (served_bundle.py)
    "int2": ("oscar_int2", "int2", _INT2, {}),
    # the general path: --page-size 1 (the Triton history stage), for comparison
    "int2_page1": ("oscar_int2", "int2", [*_INT2, "--page-size", "1"], {}),
    "fi_bf16": ("flashinfer", "auto", [], {}),
    "fi_fp8": ("flashinfer", "fp8_e4m3", [], {}),
    "triton_bf16": ("triton", "auto", [], {}),
    "torch_native": ("torch_native", "auto", [], {}),  # the CPU harness's stock backend (checks this script)
}

FLOAT = r"([0-9.]+(?:e[-+]?\d+)?)"


def parse(log: str) -> dict:
    """What one_batch prints outside the per-context results: capacity and the plugin's line."""
    out = {}
    tok = re.findall(r"max_total_num_tokens=(\d+)", log) or re.findall(r"#tokens: (\d+)", log)
    if tok:
        out["max_total_num_tokens"] = int(tok[-1])
    m = re.search(r"int2 ([\d,]+) tokens \(([\d,]+) B/token\) vs bf16 ([\d,]+) .*?= ([0-9.]+)x", log)
    if m:
        out["int2_tokens_reported"] = int(m.group(1).replace(",", ""))
        out["bf16_tokens_same_budget"] = int(m.group(3).replace(",", ""))
        out["capacity_ratio_same_budget"] = float(m.group(4))
    return out


def per_context(log: str, jsonl: Path, contexts: list) -> dict:
    """{context: {prefill_latency_s, decode_median_latency_s}} from the result jsonl, else from the
    printed lines (warmup first, then one block per context in order)."""
    res = {}
    if jsonl.exists():
        for line in jsonl.read_text().splitlines():
            r = json.loads(line)
            c = int(r.get("input_len", -1))
            res[c] = dict(prefill_latency_s=r.get("prefill_latency"), decode_median_latency_s=r.get("median_decode_latency"))
    if res:
        return res
    pre = re.findall(r"Prefill\. latency: " + FLOAT + r" s", log)[1:]
    dec = re.findall(r"Decode\.\s+median latency: " + FLOAT + r" s", log)[1:]
    for i, c in enumerate(contexts):
        res[c] = dict(prefill_latency_s=float(pre[i]) if i < len(pre) else None,
                      decode_median_latency_s=float(dec[i]) if i < len(dec) else None)
    return res


def run_mode(mode: str, args, contexts: list, graphs: bool, log_dir: Path) -> list:
    backend, kv, extra, extra_env = MODES[mode]
    module = "sglang_oscar.bench_one_batch" if kv == "int2" else "sglang.benchmark.one_batch"
    tag = f"{mode}{'' if graphs else '_eager'}"
    jsonl = log_dir / f"{tag}.jsonl"
    jsonl.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", module, "--model-path", args.model, "--load-format", "dummy",
           "--skip-tokenizer-init", "--batch-size", str(args.batch), "--input-len", *map(str, contexts),
           "--output-len", str(args.output_len), "--mem-fraction-static", str(args.mem_fraction),
           "--context-length", str(max(131072, max(contexts) + args.output_len + 8)),
           "--attention-backend", backend, "--kv-cache-dtype", kv, "--cuda-graph-max-bs", str(args.graph_max_bs),
           "--result-filename", str(jsonl), *extra, *args.flags.split(),
           *(args.int2_flags.split() if kv == "int2" else [])]
    if not graphs:
        cmd.append("--disable-cuda-graph")
    env = dict(os.environ, SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN="1", **extra_env)
    if args.profile:
        trace_dir = Path(args.out) / "traces"
        trace_dir.mkdir(parents=True, exist_ok=True)
        env["SGLANG_TORCH_PROFILER_DIR"] = str(trace_dir)
        cmd += ["--profile", "--profile-stage", "decode", "--profile-activities", "GPU", "--profile-steps", "2",
                "--profile-prefix", tag]
    if kv == "int2":
        env["SGLANG_OSCAR_BUNDLE"] = args.int2_bundle
    t = time.time()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        log, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="ignore") if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode(errors="ignore") if isinstance(e.stderr, bytes) else (e.stderr or "")
        log, rc = out + err, "timeout"
    (log_dir / f"{tag}.log").write_text(log)
    common = dict(mode=mode, graphs=graphs, batch=args.batch, rc=rc, wall_s=round(time.time() - t, 1),
                  cmd=" ".join(cmd[1:]), env={k: v for k, v in extra_env.items()}, **parse(log))
    runs = []
    got = per_context(log, jsonl, contexts)
    for c in contexts:
        res = dict(common, context=c, **{k: v for k, v in got.get(c, {}).items() if v is not None})
        if "decode_median_latency_s" not in res:
            res["error_tail"] = log[-2500:]
        runs.append(res)
        print(json.dumps({k: v for k, v in res.items() if k not in ("cmd", "error_tail")}), flush=True)
    if rc != 0:
        print(f"{tag}: rc {rc}\n" + log[-1500:], flush=True)
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="benchmark/serving/configs/qwen3-8b")
    ap.add_argument("--contexts", default="32768,100000")
    ap.add_argument("--modes", default="int2,fi_bf16,fi_fp8,triton_bf16")
    ap.add_argument("--eager", default="", help="modes to run without CUDA graphs (as well as with, if also in --graph-modes)")
    ap.add_argument("--graph-modes", default=None, help="modes to run with CUDA graphs (default: --modes)")
    ap.add_argument("--flags", default="", help="extra SGLang flags for every mode, e.g. --disable-prefill-cuda-graph")
    ap.add_argument("--int2-flags", default="", help="extra flags for the int2 modes only (the last value of a flag wins)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--mem-fraction", type=float, default=0.7)
    ap.add_argument("--graph-max-bs", type=int, default=8, help="--cuda-graph-max-bs (startup time only)")
    ap.add_argument("--profile", action="store_true", help="torch-profiler traces of 2 decode steps per context")
    ap.add_argument("--timeout", type=int, default=400, help="seconds per mode (all contexts)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--commit", default=os.environ.get("OSCAR_COMMIT", "unknown"))
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        sys.exit(f"unknown modes {bad}; choose from {list(MODES)}")
    graph_modes = modes if args.graph_modes is None else [m for m in args.graph_modes.split(",") if m]
    eager = [m for m in args.eager.split(",") if m]
    args.int2_bundle, args.int2_bundle_label = int2_bundle(args.model, tempfile.mkdtemp(prefix="oscar_bundle_"))
    out = Path(args.out)
    log_dir = out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    runs = []
    contexts = sorted(int(x) for x in args.contexts.split(","))
    for mode in modes:
        for graphs in ([True] if mode in graph_modes else []) + ([False] if mode in eager else []):
            runs += run_mode(mode, args, contexts, graphs, log_dir)
            write(args, device, runs, out)  # after every mode: a call cut short keeps what it measured


def write(args, device: str, runs: list, out: Path) -> None:
    import torch

    rows = []
    for r in runs:
        name = r["mode"] + ("" if r["graphs"] else "_eager")
        for metric, unit, key, scale in (("decode_latency", "ms/token", "decode_median_latency_s", 1e3),
                                         ("prefill_latency", "s", "prefill_latency_s", 1),
                                         ("max_total_num_tokens", "tokens", "max_total_num_tokens", 1)):
            if key in r:
                rows.append(dict(mode=name, model=Path(args.model).name, context=r["context"], batch=r["batch"],
                                 metric=metric, value=round(r[key] * scale, 4), unit=unit))
    try:
        import sglang
        import triton

        versions = dict(torch=torch.__version__, sglang=sglang.__version__, triton=triton.__version__)
    except Exception as e:  # noqa: BLE001
        versions = dict(torch=torch.__version__, error=str(e))
    doc = dict(device=device, versions=versions, commit=args.commit, date=time.strftime("%Y-%m-%d %H:%M"),
               settings=dict(flags=args.flags, int2_flags=args.int2_flags, batch=args.batch, graph_max_bs=args.graph_max_bs, profile=args.profile, output_len=args.output_len, mem_fraction_static=args.mem_fraction,
                             weights="dummy", int2_bundle=args.int2_bundle_label,
                             int2_absorb_v=os.environ.get("SGLANG_OSCAR_ABSORB_V_ROTATION", "default")),
               rows=rows, runs=runs)
    name = "one_batch_" + re.sub(r"[^A-Za-z0-9]+", "_", device).strip("_") + ".json"
    (out / name).write_text(json.dumps(doc, indent=1) + "\n")
    print("wrote", out / name)


if __name__ == "__main__":
    main()
