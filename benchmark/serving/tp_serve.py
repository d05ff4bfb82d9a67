"""Tensor-parallel serving check and bs=1 latency, int2 vs stock KV modes, through real servers.

One `python -m sglang.launch_server` per mode (the plugin comes in through SGLang's entry point, so
every TP rank loads it), dummy weights, CUDA graphs on. Per mode:

  1. greedy:   short prompts whose prompt + output fit in sink + recent window (64 + 256), so int2
               attends to exact BF16 rows only: its greedy tokens should equal the BF16 server's.
               Dummy weights give nearly flat logits, so a flipped near-tie is possible; we record
               the matching prefix and the logprob gap, not only equal/unequal.
  2. capacity: max_total_num_tokens from /get_server_info, and the plugin's own int2-vs-bf16 line.
  3. latency:  per context, a prefill request (timed), then the same prompt again with streaming
               (prefix-cache hit: decode steps only), inter-token latency median = decode ms/token.
  4. batch decode (--batch-decode INxOUT@N): N prompts of IN tokens prefilled (one token each, so they
               sit in the prefix cache), then all N again at once, streamed: the median gap per token
               while all N decode together (steady_gaps) = the decode step at batch N.

Modes run concurrently on the GPU sets of --gpu-sets (8-GPU machine: TP4 on 0-3 and TP4 on 4-7), each
set taking the next mode in --modes order when it is free. `int2_eager` (no CUDA graphs) runs the greedy
prompts only and is compared token for token with `int2`. Rows {mode, model, tp, context, batch, metric, value,
unit} go to $OUT/serving_tp_<device>.json after every mode, so a call cut short keeps what it measured.

    python benchmark/serving/tp_serve.py --model benchmark/serving/configs/qwen3-32b --tp 4 \
        --modes int2,fi_bf16 --gpu-sets 0,1,2,3:4,5,6,7 --contexts 32768,100000
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from server_proc import ServerProcess  # noqa: E402
from served_bundle import int2_bundle  # noqa: E402

MODES = {
    # name: (attention backend or None, kv-cache dtype, extra flags). int2 is the served command, nothing else: the
    # server selects oscar_int2, sizes the running-request limit from the KV budget, and picks the decode kernels and
    # the page size (the CUDA history stage on pages of 64 on Hopper, docs/serving.md "Which decode path").
    "int2": (None, "int2", []),
    "int2_eager": (None, "int2", ["--disable-cuda-graph"]),  # greedy only: CUDA graph == eager check
    "fi_bf16": ("flashinfer", "auto", []),
    "fi_fp8": ("flashinfer", "fp8_e4m3", []),
    "triton_bf16": ("triton", "auto", []),
    "torch_native": ("torch_native", "auto", []),  # the CPU harness's stock backend (checks this script)
}
GREEDY_PROMPTS = (16, 100, 200, 250)  # + GREEDY_NEW <= 64 + 256: inside the int2 windows
GREEDY_NEW = 32
PLUGIN_CAPACITY = re.compile(r"int2 ([\d,]+) tokens \(([\d,]+) B/token\) vs bf16 ([\d,]+) .*?= ([0-9.]+)x")


def post(port: int, body: dict, timeout: float):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


def generate(port: int, ids: list, n: int, timeout: float = 600, logprobs: bool = False) -> dict:
    body = {"input_ids": ids, "return_logprob": logprobs,
            "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    with post(port, body, timeout) as r:
        return json.loads(r.read())


def stream_times(port: int, ids: list, n: int, timeout: float = 600) -> tuple:
    """Arrival time of every streamed chunk and the completion-token count it reports."""
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    events, meta = [], {}
    with post(port, body, timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            d = json.loads(line[5:])
            meta = d.get("meta_info", meta)
            events.append((time.perf_counter(), meta.get("completion_tokens", len(events) + 1)))
    return events, meta


def throughput(port: int, n_in: int, n_out: int, concurrency: int, max_id: int, seed: int) -> dict:
    """`concurrency` requests of n_in random token ids (distinct: no prefix-cache hits) and n_out
    forced output tokens, all sent at once, each streamed. Output tok/s over the whole job (prefill
    included) and the median per-user decode rate (tokens after the first / time after the first)."""
    rnd = random.Random(seed)
    prompts = [[rnd.randrange(1000, max_id) for _ in range(n_in)] for _ in range(concurrency)]
    done = [None] * concurrency

    def one(i):
        t0 = time.perf_counter()
        try:
            events, _ = stream_times(port, prompts[i], n_out, timeout=3600)
            done[i] = dict(t0=t0, first=events[0][0], last=events[-1][0], tokens=events[-1][1])
        except Exception as e:  # noqa: BLE001
            done[i] = dict(error=f"{type(e).__name__}: {e}")

    t = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(concurrency)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t
    ok = [d for d in done if d and "error" not in d]
    errors = [d["error"] for d in done if d and "error" in d]
    users = [(d["tokens"] - 1) / (d["last"] - d["first"]) for d in ok if d["tokens"] > 1 and d["last"] > d["first"]]
    out_tokens = sum(d["tokens"] for d in ok)
    return dict(input_len=n_in, output_len=n_out, concurrency=concurrency, completed=len(ok), errors=errors[:3],
                wall_s=round(wall, 2), output_tok_s=round(out_tokens / wall, 2),
                median_user_tok_s=round(statistics.median(users), 2) if users else None,
                median_ttft_s=round(statistics.median(d["first"] - d["t0"] for d in ok), 2) if ok else None)


def gap_stats(gaps: list) -> dict:
    """decode_ms_median / decode_ms_p90 of per-token gaps in seconds (non-empty)."""
    return dict(decode_ms_median=round(1e3 * statistics.median(gaps), 3),
                decode_ms_p90=round(1e3 * sorted(gaps)[int(0.9 * (len(gaps) - 1))], 3))


def steady_gaps(streams: list) -> tuple:
    """Per-token gaps (s) while every stream is decoding: streams are [(arrival time, completion tokens so far)]
    per request; the window runs from the last request's first chunk to the first request's last chunk, and a
    gap counts where both of its chunks lie inside it (a chunk may carry several tokens). Returns (gaps, window s)."""
    streams = [ev for ev in streams if len(ev) >= 2]
    if not streams:
        return [], 0.0
    lo, hi = max(ev[0][0] for ev in streams), min(ev[-1][0] for ev in streams)
    gaps = [(b[0] - a[0]) / max(1, b[1] - a[1]) for ev in streams for a, b in zip(ev, ev[1:])
            if lo <= a[0] and b[0] <= hi]
    return gaps, max(0.0, hi - lo)


def batch_decode(port: int, n_in: int, n_out: int, n: int, max_id: int, seed: int) -> dict:
    """The decode step at batch n through HTTP: n distinct prompts of n_in tokens are prefilled first (one output
    token each, so that they sit in the prefix cache), then sent again all at once, streamed, so that they start
    decoding together; the median gap per token inside the window where all n decode (steady_gaps)."""
    rnd = random.Random(seed)
    prompts = [[rnd.randrange(1000, max_id) for _ in range(n_in)] for _ in range(n)]
    t = time.perf_counter()
    for ids in prompts:
        generate(port, ids, 1, timeout=3600)
    prefill_s = time.perf_counter() - t
    streams, errors = [None] * n, []

    def one(i):
        try:
            streams[i] = stream_times(port, prompts[i], n_out, timeout=3600)[0]
        except Exception as e:  # noqa: BLE001
            errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    ok = [ev for ev in streams if ev]
    gaps, window = steady_gaps(ok)
    row = dict(input_len=n_in, output_len=n_out, batch=n, completed=len(ok), errors=errors[:3],
               prefill_all_s=round(prefill_s, 2), steady_window_s=round(window, 3), steady_gaps=len(gaps))
    if gaps:
        row.update(gap_stats(gaps))
    return row


def find_key(obj, key):
    if isinstance(obj, dict):
        if key in obj:
            return obj[key]
        obj = list(obj.values())
    if isinstance(obj, list):
        for v in obj:
            r = find_key(v, key)
            if r is not None:
                return r
    return None


class Server(ServerProcess):
    def __init__(self, mode: str, args, gpus: str, port: int, log_path: Path, model: str):
        backend, kv, extra = MODES[mode]
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpus, SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN="1",
                   NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
        if kv == "int2":
            env["SGLANG_OSCAR_BUNDLE"] = args.int2_bundles[model][0]
            for kv_pair in args.int2_env:
                k, v = kv_pair.split("=", 1)
                env[k] = v
        super().__init__(["--model-path", model, "--load-format", "dummy", "--skip-tokenizer-init", "--tp", args.tp,
                          "--host", "127.0.0.1", "--port", port, "--mem-fraction-static", args.mem_fraction,
                          "--context-length", args.context_length,
                          *(["--attention-backend", backend] if backend else []), "--kv-cache-dtype", kv,
                          "--cuda-graph-max-bs", args.graph_max_bs, *extra, *args.flags.split(),
                          *(args.int2_flags.split() if kv == "int2" else [])], env, log_path, port)

    def info(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/get_server_info", timeout=60) as r:
            return json.loads(r.read())


def start(mode: str, args, gpus: str, port: int, log_dir: Path, res: dict) -> Server:
    """The server of this mode, on --fallback-model if --model does not start (both recorded)."""
    models = [args.model] + ([args.fallback_model] if args.fallback_model else [])
    for i, model in enumerate(models):
        srv = Server(mode, args, gpus, port + i, log_dir / f"{mode}_tp{args.tp}_{Path(model).name}.log", model)
        res.update(cmd=srv.cmd, model=Path(model).name)
        try:
            res["startup_s"] = round(srv.wait_ready(args.startup_timeout), 1)
            return srv
        except RuntimeError as e:
            srv.stop()
            res.setdefault("startup_errors", []).append(dict(model=Path(model).name, error=str(e),
                                                            log_tail=srv.text()[-3000:]))
            print(mode, "did not start on", model, ":", e, "\n", srv.text()[-1500:], flush=True)
    raise RuntimeError("no model started: " + "; ".join(x["error"] for x in res["startup_errors"]))


def run_mode(mode: str, args, gpus: str, port: int, log_dir: Path) -> dict:
    res = dict(mode=mode, tp=args.tp, gpus=gpus)
    srv = None
    try:
        srv = start(mode, args, gpus, port, log_dir, res)
        m = PLUGIN_CAPACITY.search(srv.text())
        if m:
            res["int2_tokens_reported"] = int(m.group(1).replace(",", ""))
            res["bf16_tokens_same_budget"] = int(m.group(3).replace(",", ""))
            res["capacity_ratio_same_budget"] = float(m.group(4))
        info = srv.info()
        res["max_total_num_tokens"] = find_key(info, "max_total_num_tokens")
        # the scheduler's limit (int2: the requests its windows are reserved for); the server-args field is None
        # when --max-running-requests was not given
        res["max_running_requests"] = (find_key(info, "effective_max_running_requests_per_dp")
                                       or find_key(info, "max_running_requests"))
        rnd = random.Random(0)
        res["greedy"] = []
        for n in GREEDY_PROMPTS:
            ids = [rnd.randrange(1000, args.max_id) for _ in range(n)]
            out = generate(srv.port, ids, GREEDY_NEW, logprobs=True)
            lps = [x[0] for x in out["meta_info"]["output_token_logprobs"]]
            res["greedy"].append(dict(prompt_len=n, output_ids=out["output_ids"], logprobs=[round(x, 5) for x in lps]))
        res["latency"] = []
        for ctx in ([] if mode.endswith("_eager") else args.contexts):
            ids = [rnd.randrange(1000, args.max_id) for _ in range(ctx)]
            t = time.perf_counter()
            generate(srv.port, ids, 1)
            prefill_s = time.perf_counter() - t
            t = time.perf_counter()
            events, meta = stream_times(srv.port, ids, args.decode_tokens)
            # gaps between consecutive chunks, per token (a chunk may carry more than one)
            gaps = [(b[0] - a[0]) / max(1, b[1] - a[1]) for a, b in zip(events[1:], events[2:])]
            row = dict(context=ctx, prefill_s=round(prefill_s, 3), cached_tokens=meta.get("cached_tokens"),
                       ttft_cached_s=round(events[0][0] - t, 4) if events else None, tokens=len(events))
            if gaps:
                row.update(gap_stats(gaps))
            res["latency"].append(row)
            print(json.dumps(dict(mode=mode, tp=args.tp, **row)), flush=True)
        res["throughput"] = []
        for spec in ([] if mode.endswith("_eager") else args.throughput):
            n_in, n_out, conc = spec
            fit = res["max_total_num_tokens"] // (n_in + n_out)
            if conc is None:  # the largest batch this mode fits (int2: also its window slots)
                conc = min(fit, res["max_running_requests"] or fit)
            if conc < 1:
                res["throughput"].append(dict(input_len=n_in, output_len=n_out, concurrency=0, error="does not fit"))
                continue
            row = throughput(srv.port, n_in, n_out, conc, args.max_id, seed=n_in + conc)
            row["fits"] = fit
            res["throughput"].append(row)
            print(json.dumps(dict(mode=mode, tp=args.tp, **row)), flush=True)
        res["batch_decode"] = []
        for n_in, n_out, n in ([] if mode.endswith("_eager") else args.batch_decode):
            row = batch_decode(srv.port, n_in, n_out, n, args.max_id, seed=7 * n_in + n)
            res["batch_decode"].append(row)
            print(json.dumps(dict(mode=mode, tp=args.tp, **row)), flush=True)
    except Exception as e:  # noqa: BLE001  -- recorded, never dropped
        res["error"] = f"{type(e).__name__}: {e}"
        res["log_tail"] = srv.text()[-3000:] if srv else ""
        print(mode, "FAILED:", res["error"], "\n", res["log_tail"][-1500:], flush=True)
    finally:
        if srv:
            srv.stop()
    return res


def _compare(a_run: dict, b_run: dict) -> list:
    out = []
    for a, b in zip(a_run["greedy"], b_run["greedy"]):
        same = 0
        for x, y in zip(a["output_ids"], b["output_ids"]):
            if x != y:
                break
            same += 1
        gap = max(abs(x - y) for x, y in zip(a["logprobs"][:same + 1], b["logprobs"][:same + 1]))
        out.append(dict(mode=a_run["mode"], ref=b_run["mode"], prompt_len=a["prompt_len"], tokens=len(a["output_ids"]),
                        equal=a["output_ids"] == b["output_ids"], matching_prefix=same,
                        max_logprob_gap_on_prefix=round(gap, 5)))
    return out


def compare_greedy(results: list) -> list:
    """Every int2 mode against the first stock mode (matching prefix, max logprob gap), and the
    eager int2 server against the CUDA-graph one (these should agree exactly)."""
    done = {r["mode"]: r for r in results if "greedy" in r}
    ref = next((r for r in done.values() if not r["mode"].startswith("int2")), None)
    out = []
    for r in done.values():
        if ref is not None and r is not ref:
            out += _compare(r, ref)
    if "int2" in done and "int2_eager" in done:
        out += _compare(done["int2_eager"], done["int2"])
    return out


def write(args, results: list, out: Path) -> None:
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    rows = []
    model = Path(args.model).name
    for r in results:
        base = dict(mode=r["mode"], model=r.get("model", model), tp=args.tp)
        for key, unit in (("max_total_num_tokens", "tokens"), ("startup_s", "s")):
            if r.get(key) is not None:
                rows.append(dict(base, context=None, batch=None, metric=key, value=r[key], unit=unit))
        for lat in r.get("latency", []):
            for metric, key, unit in (("decode_latency", "decode_ms_median", "ms/token"),
                                      ("prefill_latency", "prefill_s", "s")):
                if lat.get(key) is not None:
                    rows.append(dict(base, context=lat["context"], batch=1, metric=metric, value=lat[key], unit=unit))
        for bd in r.get("batch_decode", []):
            if bd.get("decode_ms_median") is not None:
                rows.append(dict(base, context=bd["input_len"], batch=bd["batch"], metric="decode_latency",
                                 value=bd["decode_ms_median"], unit="ms/token", source_detail="batch_decode"))
        for th in r.get("throughput", []):
            if th.get("completed"):
                for metric, key, unit in (("job_output_throughput", "output_tok_s", "tok/s/gpu"),
                                          ("median_user_decode_rate", "median_user_tok_s", "tok/s"),
                                          ("median_ttft", "median_ttft_s", "s")):
                    if th.get(key) is not None:
                        value = th[key] / args.tp if unit == "tok/s/gpu" else th[key]
                        rows.append(dict(base, context=th["input_len"], output_len=th["output_len"],
                                         batch=th["concurrency"], metric=metric, value=round(value, 3), unit=unit))
        if r.get("max_total_num_tokens"):
            for ctx in args.contexts:
                fit = r["max_total_num_tokens"] // (ctx + args.decode_tokens)
                fit = min(fit, r.get("max_running_requests") or fit)  # int2: one window slot per request
                rows.append(dict(base, context=ctx, batch=None, metric="max_concurrency", value=fit, unit="requests"))
    try:
        import sglang
        import triton

        versions = dict(torch=torch.__version__, sglang=sglang.__version__, triton=triton.__version__)
    except Exception as e:  # noqa: BLE001
        versions = dict(torch=torch.__version__, error=str(e))
    doc = dict(device=device, gpus=torch.cuda.device_count() if torch.cuda.is_available() else 0, versions=versions,
               commit=args.commit, date=time.strftime("%Y-%m-%d %H:%M"),
               settings=dict(tp=args.tp, flags=args.flags, mem_fraction_static=args.mem_fraction, weights="dummy",
                             graph_max_bs=args.graph_max_bs, int2_flags=args.int2_flags, throughput=args.throughput, decode_tokens=args.decode_tokens, int2_env=args.int2_env,
                             batch_decode=args.batch_decode,
                             int2_bundle=args.int2_bundle_label,
                             decode_latency="median inter-chunk gap of a streamed request whose prompt is a "
                                            "prefix-cache hit (HTTP streaming included, same for every mode)"),
               greedy_vs_bf16=compare_greedy(results), rows=rows, runs=results)
    name = f"serving_tp{args.tp}_{model}_" + re.sub(r"[^A-Za-z0-9]+", "_", device).strip("_") + ".json"
    (out / name).write_text(json.dumps(doc, indent=1) + "\n")
    print("wrote", out / name, flush=True)


def parse_spec(text: str) -> tuple:
    m = re.fullmatch(r"(\d+)x(\d+)(?:@(\d+))?", text.strip())
    if not m:
        sys.exit(f"--throughput {text!r}: use INxOUT or INxOUT@CONCURRENCY, e.g. 8192x1024@32")
    return int(m.group(1)), int(m.group(2)), int(m.group(3)) if m.group(3) else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="benchmark/serving/configs/qwen3-32b")
    ap.add_argument("--fallback-model", default=None, help="config dir to use for a mode whose server does not start on --model")
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--modes", default="int2,fi_bf16")
    ap.add_argument("--gpu-sets", default=None, help="colon-separated GPU lists, one per concurrent mode (default: 0..tp-1, sequential)")
    ap.add_argument("--contexts", default="32768,100000")
    ap.add_argument("--context-length", type=int, default=131072)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--throughput", default="", help="job-throughput runs, comma list of INxOUT[@CONCURRENCY] "
                    "(no @: the largest batch the mode fits), e.g. 100000x1024,8192x1024@32")
    ap.add_argument("--batch-decode", default="", help="decode step at batch N, comma list of INxOUT@N, e.g. "
                    "32768x256@8 (batch_decode: prompts prefilled first, then decoded together)")
    ap.add_argument("--max-id", type=int, default=50000, help="prompt token ids are drawn from [1000, max-id)")
    ap.add_argument("--graph-max-bs", type=int, default=8)
    ap.add_argument("--mem-fraction", type=float, default=0.85)
    ap.add_argument("--flags", default="", help="extra SGLang flags for every mode")
    ap.add_argument("--int2-flags", default="", help="extra SGLang flags for the int2 server only")
    ap.add_argument("--int2-env", action="append", default=[], help="KEY=VALUE for the int2 server (repeatable)")
    ap.add_argument("--startup-timeout", type=float, default=420)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--commit", default=os.environ.get("OSCAR_COMMIT", "unknown"))
    args = ap.parse_args()
    args.contexts = [int(x) for x in args.contexts.split(",") if x]
    args.throughput = [parse_spec(x) for x in args.throughput.split(",") if x]
    args.batch_decode = [parse_spec(x) for x in args.batch_decode.split(",") if x]
    if any(n is None for _, _, n in args.batch_decode):
        sys.exit("--batch-decode: give the batch, INxOUT@N, e.g. 32768x256@8")
    bundle_dir = tempfile.mkdtemp(prefix="oscar_bundle_")
    args.int2_bundles = {m: int2_bundle(m, bundle_dir) for m in filter(None, [args.model, args.fallback_model])}
    args.int2_bundle_label = args.int2_bundles[args.model][1]
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        sys.exit(f"unknown modes {bad}; choose from {list(MODES)}")
    sets = args.gpu_sets.split(":") if args.gpu_sets else [",".join(str(i) for i in range(args.tp))]
    for s in sets:
        if len(s.split(",")) != args.tp:
            sys.exit(f"GPU set {s!r} does not have --tp {args.tp} GPUs")
    out = Path(args.out)
    log_dir = out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    results: list = []
    lock = threading.Lock()

    def job(mode, gpus, port):
        r = run_mode(mode, args, gpus, port, log_dir)
        with lock:
            results.append(r)
            write(args, results, out)

    # one worker per GPU set takes the next mode from the queue (modes in --modes order)
    todo = list(enumerate(modes))

    def worker(gpus: str):
        while True:
            with lock:
                if not todo:
                    return
                i, m = todo.pop(0)
            job(m, gpus, 30000 + 1000 * i)

    threads = [threading.Thread(target=worker, args=(g,)) for g in sets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results.sort(key=lambda r: modes.index(r["mode"]))
    write(args, results, out)
    for g in compare_greedy(results):
        print(json.dumps(g), flush=True)


if __name__ == "__main__":
    main()
