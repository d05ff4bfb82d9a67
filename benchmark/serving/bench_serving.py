"""Serving throughput at capacity, measured the way SGLang users measure it: a real server per KV mode and
SGLang's own serving benchmark against it.

For each mode a `python -m sglang.launch_server` starts with dummy weights; the driver reads the server's
max_total_num_tokens and max_running_requests (/server_info), and for each workload IN:OUT runs
`python -m sglang.benchmark.serving` (what `python -m sglang.bench_serving` runs) with C requests of exactly IN
random token ids and OUT output tokens, all sent at once (--num-prompts C --max-concurrency C). C is the largest
concurrency the server holds, min(max_running_requests, tokens // (IN + OUT) in whole pages), unless
--concurrency (or the workload's own @C/C.. list) names others. From the per-request details (--output-details) it
computes

  decode_throughput      output tokens produced while every request decodes (after the last first token, before
                         the first completion), per second of that window: the steady decode rate at batch C
  tpot_median, ttft_median, ttft_p99, job_output_throughput (all output tokens / the whole job, prefill included)
  scheduler_decode_throughput  the server's own generation rate while all C requests run (its "Decode batch" log
                         lines), per bin of the per-request context (at_context): what the server produced whether
                         or not the one-process streaming client kept up with it; kept for a run cut short;
                         its mean over the run (scheduler_mean_tok_s) is printed beside the client's figures

--profile-steps N also has the server trace N decode steps (GPU kernels, /start_profile) once all C requests decode,
into $OUT/logs/traces (benchmark/serving/kernel_table.py makes the per-kernel table); those steps run in the steady
window, slowed by the profiler.

It writes rows {mode, model, context, output_len, batch, metric, value, unit, run} to
$OUT/bench_serving_<device>.json after every workload (a call cut short keeps what it measured; a mode or workload
that fails is recorded with its error, never dropped), and the plot $OUT/serving_capacity_<device>.png.
`python benchmark/serving/collect.py --add $OUT --run callN` adds the rows to benchmark/results/serving_<device>.json.

    python benchmark/serving/bench_serving.py --workloads 32768:256,100000:256 --modes int2,fi_bf16,fi_fp8

Modes: int2 is the served default (`--kv-cache-dtype int2` and no other flag), its dummy-weight model given the served
format's bundle without calibration (served_bundle.py: INT4 keys on a quarter of the (layer, KV head) pairs, as a
calibrated bundle has; $SGLANG_OSCAR_BUNDLE overrides it), fi_bf16 / fi_fp8 are FlashInfer with a BF16 /
FP8 (e4m3) cache. The model directory needs only config.json: bench_serving needs a tokenizer, so the driver
writes a synthetic one (a WordLevel vocabulary "t0".."t{V-1}" over the model's vocab_size, whitespace split) into a
temporary copy of the directory, which servers and benchmark both use; random ids round-trip exactly through it.
--time-budget bounds the whole run (a device call is <= 10 minutes): a mode or workload that would start past it
is recorded as skipped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from server_proc import ServerProcess, free_port  # noqa: E402
from served_bundle import int2_bundle  # noqa: E402

MODES = {
    # name: (server flags, environment)
    "int2": (["--kv-cache-dtype", "int2"], {}),
    "fi_bf16": (["--attention-backend", "flashinfer"], {}),
    "fi_fp8": (["--attention-backend", "flashinfer", "--kv-cache-dtype", "fp8_e4m3"], {}),
    "torch_native": (["--attention-backend", "torch_native"], {}),  # the CPU harness's stock backend (checks the script)
}
BENCH_MODULE = "sglang.benchmark.serving"
UNK = "t0"  # WordLevel needs an unknown token; id 0's own word, so every id in [0, vocab) round-trips


# ---- pure parts (test/test_serving_tools.py) -------------------------------------------------------------------

CONCURRENCY = r"\d+|max"  # one concurrency: a request count, or the most that fit


def parse_workloads(text: str) -> list:
    """"32768:256@8/max,2048:16384" -> [(32768, 256, ["8", "max"]), (2048, 16384, [])]: IN:OUT, optionally
    @ with this workload's own concurrencies ('/'-separated; none: --concurrency's)."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(rf"(\d+):(\d+)(?:@((?:{CONCURRENCY})(?:/(?:{CONCURRENCY}))*))?", part)
        if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
            raise SystemExit(f"--workloads: {part!r} is not IN:OUT or IN:OUT@C/C.. (positive token counts, "
                             "concurrencies as numbers or 'max', e.g. 32768:256@8/max)")
        out.append((int(m.group(1)), int(m.group(2)), m.group(3).split("/") if m.group(3) else []))
    if not out:
        raise SystemExit("--workloads is empty")
    return out


def fitting_concurrency(max_running: int, max_tokens: int, in_len: int, out_len: int, page: int = 1) -> int:
    """The most requests of in_len + out_len tokens (whole pages each) the server runs at once."""
    per_request = math.ceil((in_len + out_len) / page) * page
    return min(max_running, max_tokens // per_request)


def token_times(ttft: float, itls: list, output_len: int) -> list:
    """Arrival times of one request's output tokens, from its start: the first chunk's tokens at ttft
    (output_len - len(itls) of them), then one per inter-token gap (bench_serving spreads a chunk's gap over its
    tokens)."""
    first = max(output_len - len(itls), 1)
    times = [ttft] * first
    t = ttft
    for gap in itls:
        t += gap
        times.append(t)
    return times


def steady_window(details: dict) -> dict:
    """The window in which every request decodes: from the last first token to the first completion. All requests
    start together (num_prompts == max_concurrency, request rate inf), so times from each request's start share one
    origin. Returns {start_s, end_s, window_s, tokens, decode_throughput}; decode_throughput is None when some request
    finished before the last one's first token (no such window)."""
    reqs = [token_times(t, itl, n) for t, itl, n, err in
            zip(details["ttfts"], details["itls"], details["output_lens"], details.get("errors") or
                [""] * len(details["ttfts"])) if not err and n > 0]
    if not reqs:
        return dict(start_s=None, end_s=None, window_s=0.0, tokens=0, decode_throughput=None)
    start = max(r[0] for r in reqs)
    end = min(r[-1] for r in reqs)
    if end <= start:
        return dict(start_s=start, end_s=end, window_s=0.0, tokens=0, decode_throughput=None)
    tokens = sum(1 for r in reqs for t in r if start < t <= end)
    return dict(start_s=start, end_s=end, window_s=end - start, tokens=tokens, decode_throughput=tokens / (end - start))


def concurrencies(spec: list, fits: int) -> list:
    """--concurrency values for one workload: numbers as given, "max" as the most that fit; none given: [fits]."""
    return sorted({fits if c == "max" else int(c) for c in spec}) if spec else [fits]


def rows_of(mode: str, model: str, in_len: int, out_len: int, batch: int, result: dict, run: str) -> list:
    """Rows of one benchmark run: bench_serving's result line (with --output-details) -> metrics."""
    win = steady_window(result)
    base = dict(mode=mode, model=model, context=in_len, output_len=out_len, batch=batch, run=run)
    metrics = [("decode_throughput", win["decode_throughput"], "tok/s"),
               ("steady_window", win["window_s"], "s"),
               ("tpot_median", result.get("median_tpot_ms"), "ms"),
               ("ttft_median", None if result.get("median_ttft_ms") is None else result["median_ttft_ms"] / 1e3, "s"),
               ("ttft_p99", None if result.get("p99_ttft_ms") is None else result["p99_ttft_ms"] / 1e3, "s"),
               ("job_output_throughput", result.get("output_throughput"), "tok/s"),
               ("completed_requests", result.get("completed"), "requests")]
    return [dict(base, metric=m, value=round(float(v), 4), unit=u) for m, v, u in metrics if v is not None]


DECODE_LINE = re.compile(r"Decode batch, #running-req: (\d+), #token: (\d+),.*?gen throughput \(token/s\): ([\d.]+)")


def scheduler_rows(log_text: str, mode: str, model: str, in_len: int, out_len: int, batch: int, run: str,
                   bin_tokens: int = 1000) -> list:
    """What the server generated, from its scheduler's own "Decode batch" lines (one per 40 decode steps): the
    median "gen throughput" of the lines with all `batch` requests running, one row per bin of the per-request
    context (#token / #running-req, bins of bin_tokens) with that context as `at_context`. It does not depend on
    the streaming client keeping up, and a run cut short keeps the bins it reached."""
    bins: dict = {}
    for m in DECODE_LINE.finditer(log_text):
        running, tokens, rate = int(m.group(1)), int(m.group(2)), float(m.group(3))
        if running == batch and tokens > 0:
            ctx = tokens / running
            bins.setdefault(int(ctx // bin_tokens), []).append((ctx, rate))
    out = []
    for _, pts in sorted(bins.items()):
        rates = sorted(r for _, r in pts)
        out.append(dict(mode=mode, model=model, context=in_len, output_len=out_len, batch=batch, run=run,
                        metric="scheduler_decode_throughput", value=round(rates[len(rates) // 2], 2), unit="tok/s",
                        at_context=round(sum(c for c, _ in pts) / len(pts)), lines=len(pts)))
    return out


def scheduler_mean(rows: list) -> "float | None":
    """The server's rate over the whole decode from scheduler_rows: each log line covers the same number of steps at
    the same batch, so the rate over them is the line-weighted harmonic mean. Set against the client's
    decode_throughput it shows whether the streaming client kept up."""
    sch = [r for r in rows if r["metric"] == "scheduler_decode_throughput" and r["value"] > 0]
    if not sch:
        return None
    return sum(r["lines"] for r in sch) / sum(r["lines"] / r["value"] for r in sch)


def write_tokenizer(vocab_size: int, out_dir: Path) -> None:
    """tokenizer.json + tokenizer_config.json: word "t{i}" is id i, words split on whitespace."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": UNK, "model_max_length": 1 << 30,
         "clean_up_tokenization_spaces": False}, indent=1) + "\n")


def model_with_tokenizer(model_dir: Path, work: Path) -> Path:
    """A copy of model_dir's files with the synthetic tokenizer added (model_dir itself is not touched)."""
    out = work / model_dir.name
    out.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.is_file():
            shutil.copy2(f, out / f.name)
    cfg = json.loads((model_dir / "config.json").read_text())
    vocab = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
    if not vocab:
        raise SystemExit(f"{model_dir}/config.json has no vocab_size")
    write_tokenizer(int(vocab), out)
    return out


# ---- servers and runs -----------------------------------------------------------------------------------------

class Server(ServerProcess):
    def __init__(self, mode: str, args, model: Path, log_path: Path):
        flags, env_defaults = MODES[mode]
        port = free_port()
        env = dict(os.environ, SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN="1")
        for k, v in env_defaults.items():
            env.setdefault(k, v)
        if "int2" in flags:
            env["SGLANG_OSCAR_BUNDLE"] = args.int2_bundle
        super().__init__(["--model-path", model, "--load-format", "dummy", "--mem-fraction-static", args.mem_fraction,
                          "--context-length", args.context_length, "--host", "127.0.0.1", "--port", port, *flags,
                          *args.flags.split()], env, log_path, port)

    def info(self) -> dict:
        """max_total_num_tokens, max_running_requests, page_size as the server settled them."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/server_info", timeout=60) as r:
            doc = json.loads(r.read())
        state = (doc.get("internal_states") or [{}])[0]
        out = dict(max_total_num_tokens=doc.get("max_total_num_tokens"),
                   max_running_requests=state.get("effective_max_running_requests_per_dp"),
                   page_size=doc.get("page_size") or 1)
        m = re.search(r"max_total_num_tokens=(\d+),.*?max_running_requests=(\d+)", self.text())
        if m:  # the scheduler's own line, where /server_info lacks a field
            out["max_total_num_tokens"] = out["max_total_num_tokens"] or int(m.group(1))
            out["max_running_requests"] = out["max_running_requests"] or int(m.group(2))
        line = re.search(r"sglang_oscar: (int2 KV: [\d,]+ tokens .*)", self.text())
        if line:
            out["int2_line"] = line.group(1)
        rot = re.search(r"sglang_oscar: (rotations: [^\n]*)", self.text())
        if rot:  # which rotations the server picked
            out["rotations_line"] = rot.group(1)
        return out


def client_env(work: Path) -> dict:
    """The benchmark client's environment. sglang.benchmark.serving imports Hugging Face `datasets` at module level
    (for datasets this driver does not use); where it is not installed (the GPU machine's runtime bundle), a stand-in
    package whose load_dataset raises is put on the client's PYTHONPATH, so random-ids runs and any other dataset
    fails loudly."""
    import importlib.util

    env = dict(os.environ)
    if importlib.util.find_spec("datasets") is None:
        stub = work / "datasets_stub" / "datasets"
        stub.mkdir(parents=True, exist_ok=True)
        (stub / "__init__.py").write_text(
            "def load_dataset(*a, **k):\n"
            "    raise ImportError('Hugging Face datasets is not installed: pip install datasets')\n")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(stub.parent), env.get("PYTHONPATH")]))
    return env


def profile_when_full(srv: Server, c: int, steps: int, trace_dir: Path, prefix: str, log_from: int,
                      done: threading.Event, note: dict) -> None:
    """Wait for the server's first "Decode batch" line (past log_from in its log) with all c requests running, then
    ask it (POST /start_profile) for a torch-profiler trace of the next `steps` decode steps, GPU kernels only (the
    least overhead; host time shows as the gaps between steps), written to trace_dir as <prefix>-*.trace.json.gz.
    Records when and at what context per request in note; gives up when done is set."""
    while not done.is_set():
        full = [m for m in DECODE_LINE.finditer(srv.text()[log_from:]) if int(m.group(1)) == c]
        if full:
            body = dict(output_dir=str(trace_dir), num_steps=steps, activities=["GPU"], with_stack=False,
                        record_shapes=False, profile_prefix=prefix)
            req = urllib.request.Request(f"http://127.0.0.1:{srv.port}/start_profile", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            try:
                urllib.request.urlopen(req, timeout=120).read()
                note.update(profile_prefix=prefix, profile_steps=steps,
                            profile_at_context=round(int(full[0].group(2)) / c),
                            profile_started=time.strftime("%Y-%m-%d %H:%M:%S"))  # nvidia-smi's clock, the same host
            except Exception as e:  # noqa: BLE001 - recorded with the workload; the benchmark itself goes on
                note["profile_error"] = f"{type(e).__name__}: {e}"
            return
        done.wait(2.0)


def bench(srv: Server, model: Path, in_len: int, out_len: int, c: int, out_file: Path, timeout: float,
          env: dict, profile: "dict | None" = None) -> dict:
    """One sglang.benchmark.serving run; its result line with per-request details. profile (steps, trace_dir,
    prefix, note): also trace `steps` decode steps once all c requests decode (profile_when_full)."""
    out_file.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", BENCH_MODULE, "--backend", "sglang", "--host", "127.0.0.1", "--port", str(srv.port),
           "--model", str(model), "--tokenizer", str(model), "--dataset-name", "random-ids", "--tokenize-prompt",
           "--random-input-len", str(in_len), "--random-output-len", str(out_len), "--random-range-ratio", "1",
           "--num-prompts", str(c), "--max-concurrency", str(c), "--warmup-requests", "1", "--flush-cache",
           "--output-details", "--output-file", str(out_file), "--disable-tqdm"]
    done, watcher = threading.Event(), None
    if profile:
        profile["trace_dir"].mkdir(parents=True, exist_ok=True)
        watcher = threading.Thread(target=profile_when_full, daemon=True,
                                   args=(srv, c, profile["steps"], profile["trace_dir"], profile["prefix"],
                                         len(srv.text()), done, profile["note"]))
        watcher.start()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    finally:
        done.set()
        if watcher:
            watcher.join(130)
    log = p.stdout + p.stderr
    if p.returncode != 0 or not out_file.exists():
        raise RuntimeError(f"bench_serving rc {p.returncode}: {log[-2500:]}")
    return json.loads(out_file.read_text().splitlines()[-1])


def run_mode(mode: str, args, model: Path, workloads: list, out: Path, deadline: float, doc: dict) -> None:
    log_dir = out / "logs"
    res = dict(mode=mode, workloads=[])
    doc["runs"].append(res)
    left = deadline - time.time()
    if left < args.min_mode_s:
        res["error"] = f"skipped: {left:.0f} s of the time budget left"
        return
    srv = Server(mode, args, model, log_dir / f"{mode}.log")
    res["cmd"] = srv.cmd
    try:
        res["startup_s"] = round(srv.wait_ready(min(args.startup_timeout, deadline - time.time())), 1)
        res.update(srv.info())
        print(mode, json.dumps({k: v for k, v in res.items() if k not in ("cmd", "workloads")}), flush=True)
        for in_len, out_len, own in workloads:
            fits = fitting_concurrency(res["max_running_requests"], res["max_total_num_tokens"], in_len, out_len,
                                       res["page_size"])
            for c in concurrencies(own or args.concurrency, fits):
                w = dict(context=in_len, output_len=out_len, batch=c, fits=fits)
                res["workloads"].append(w)
                left = deadline - time.time()
                if c < 1 or c > fits:
                    w["error"] = f"concurrency {c} does not fit (at most {fits} requests of {in_len}+{out_len})"
                elif left < 30:
                    w["error"] = f"skipped: {left:.0f} s of the time budget left"
                else:
                    t = time.time()
                    try:
                        prof = None if not args.profile_steps else dict(
                            steps=args.profile_steps, trace_dir=log_dir / "traces",
                            prefix=f"{mode}_{in_len}_{out_len}_{c}", note=w)
                        result = bench(srv, model, in_len, out_len, c, log_dir / f"{mode}_{in_len}_{out_len}_{c}.jsonl",
                                       left - 10, args.client_env, prof)
                        w["rows"] = rows_of(mode, args.model_name, in_len, out_len, c, result, args.run)
                        w["window"] = steady_window(result)
                        w["errors"] = sum(1 for e in result.get("errors", []) if e)
                    except Exception as e:  # noqa: BLE001 - recorded with the workload, never dropped
                        w["error"] = f"{type(e).__name__}: {e}"[-3000:]
                    w["wall_s"] = round(time.time() - t, 1)
                    w["rows"] = w.get("rows", []) + scheduler_rows(srv.text(), mode, args.model_name, in_len,
                                                                   out_len, c, args.run)
                    mean = scheduler_mean(w["rows"])
                    if mean is not None:  # printed with the workload: the client's rate beside the server's
                        w["scheduler_mean_tok_s"] = round(mean, 1)
                print(mode, json.dumps({k: v for k, v in w.items() if k != "rows"}), flush=True)
                write(args, doc, out)
    except Exception as e:  # noqa: BLE001 - recorded with the mode, never dropped
        res["error"] = f"{type(e).__name__}: {e}"
        res["log_tail"] = srv.text()[-3000:]
        print(mode, "failed:", e, "\n", srv.text()[-1500:], flush=True)
    finally:
        srv.stop()
        write(args, doc, out)


def device_and_versions() -> tuple:
    versions = {}
    for name in ("torch", "sglang", "flashinfer", "triton"):
        try:
            versions[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - not installed here
            pass
    try:
        import torch

        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001
        device = "unknown"
    return device, versions


def commit() -> str:
    """OSCAR_COMMIT where given (the device's copy of the tree can carry stale git metadata), else git HEAD."""
    if os.environ.get("OSCAR_COMMIT"):
        return os.environ["OSCAR_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, timeout=10).stdout.strip() or "unknown"
    except Exception:  # noqa: BLE001 - the device's copy of the tree may carry no .git
        return "unknown"


def rows(doc: dict) -> list:
    """Every measured row, plus each mode's capacity (max_total_num_tokens, max_running_requests) per workload."""
    out = []
    for r in doc["runs"]:
        for w in r["workloads"]:
            out += w.get("rows", [])
            for metric, unit in (("max_total_num_tokens", "tokens"), ("max_running_requests", "requests")):
                if r.get(metric) is not None:
                    out.append(dict(mode=r["mode"], model=doc["model"], context=w["context"],
                                    output_len=w["output_len"], batch=w["batch"], metric=metric,
                                    value=r[metric], unit=unit, run=doc["run"]))
    return out


def write(args, doc: dict, out: Path) -> None:
    doc["rows"] = rows(doc)
    tag = re.sub(r"[^A-Za-z0-9]+", "_", doc["device"]).strip("_")
    path = out / f"bench_serving_{tag}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    try:
        sys.path.insert(0, str(Path(__file__).parent))
        from collect import plot_capacity

        plot_capacity(doc["rows"], out, doc["device"])
    except Exception as e:  # noqa: BLE001 - a plot failure must not lose the measurements
        print("plot failed:", e, flush=True)
    print("wrote", path, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="benchmark/serving/configs/qwen3-8b", help="model directory (config.json)")
    ap.add_argument("--modes", default="int2,fi_bf16,fi_fp8")
    ap.add_argument("--workloads", default="32768:256", help="IN:OUT token counts, comma-separated; IN:OUT@C/C.. "
                    "gives that workload its own concurrencies (e.g. 100000:256,32768:256@8/22/max)")
    ap.add_argument("--concurrency", default="", help="comma-separated concurrencies, 'max' the largest that fits "
                    "(default: max)")
    ap.add_argument("--mem-fraction", type=float, default=0.85)
    ap.add_argument("--context-length", type=int, default=131072)
    ap.add_argument("--flags", default="", help="extra SGLang server flags for every mode")
    ap.add_argument("--time-budget", type=float, default=560, help="seconds for the whole run")
    ap.add_argument("--startup-timeout", type=float, default=300)
    ap.add_argument("--min-mode-s", type=float, default=90, help="do not start a mode with less budget left")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="also trace this many decode steps (GPU kernels) once all requests decode, into "
                         "OUT/logs/traces (summarize with kernel_table.py)")
    ap.add_argument("--run", default=time.strftime("%Y%m%d-%H%M"), help="the rows' run name")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    args = ap.parse_args()
    deadline = time.time() + args.time_budget
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        sys.exit(f"unknown modes {bad}; choose from {list(MODES)}")
    workloads = parse_workloads(args.workloads)
    args.concurrency = [c.strip() for c in args.concurrency.split(",") if c.strip()]
    bad = [c for c in args.concurrency if not re.fullmatch(CONCURRENCY, c)]
    if bad:
        sys.exit(f"--concurrency: {bad} are not request counts or 'max' (e.g. --concurrency 8,max)")
    src = Path(args.model)
    if not (src / "config.json").is_file():
        sys.exit(f"--model {src}: no config.json")
    args.model_name = src.name
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    device, versions = device_and_versions()
    doc = dict(device=device, versions=versions, commit=commit(), run=args.run, model=args.model_name,
               date=time.strftime("%Y-%m-%d %H:%M"),
               settings=dict(modes={m: MODES[m] for m in modes}, workloads=args.workloads, mem_fraction_static=
                             args.mem_fraction, context_length=args.context_length, flags=args.flags, weights="dummy",
                             client=f"python -m {BENCH_MODULE} --dataset-name random-ids --tokenize-prompt "
                                    "--random-range-ratio 1 --num-prompts C --max-concurrency C"),
               runs=[])
    with tempfile.TemporaryDirectory(prefix="bench_serving_") as work:
        args.client_env = client_env(Path(work))
        model = model_with_tokenizer(src, Path(work))
        if "int2" in modes:
            args.int2_bundle, doc["settings"]["int2_bundle"] = int2_bundle(src, work)
        for mode in modes:
            run_mode(mode, args, model, workloads, out, deadline, doc)
    write(args, doc, out)


if __name__ == "__main__":
    main()
