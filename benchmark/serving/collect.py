"""Merge the per-call outputs of serving_session.sh into benchmark/results/serving_<device>.json
(rows {mode, model, context, batch, metric, value, unit, run}) and plot docs/results/serving_*_<device>.png.

    python benchmark/serving/collect.py benchmark/results/serving_h100 --out benchmark/results \
        --plots docs/results

--add adds one call's output (bench_serving.py's bench_serving_<device>.json, rows with output_len, or one_batch.py's
one_batch_<device>.json, bs=1 rows) to the device's existing serving_<device>.json under the run name given,
replacing that run's rows of the same source and modes, so the committed rows of earlier calls stay (--server-logs DIR
also reads the servers' logs/<mode>.log for the scheduler's own decode rate, where bench_serving.py did not record it):

    python benchmark/serving/collect.py --add /path/to/call_out --run call3 --out benchmark/results \
        --plots docs/results

Each call's folder (callN/) holds what one device call wrote: one_batch_*.json (bs=1 latency, one
process per mode), serving_tp1_*.json (real servers: greedy checks, HTTP latency, throughput) and
kernel_table.json (per-kernel GPU time of one decode step). `run` names the call, so ratios are
only formed between rows of the same call (same machine, same run).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

BENCH_SERVING_SOURCE = "bench_serving (sglang.benchmark.serving against a real server, dummy weights)"


def load_calls(root: Path) -> list:
    calls = []
    for d in sorted(root.glob("call*"), key=lambda p: int(re.sub(r"\D", "", p.name) or 0)):
        docs = {p.name: json.loads(p.read_text()) for p in d.glob("*.json")}
        calls.append((d.name, docs))
    return calls


def rows_of(calls) -> tuple:
    rows, meta = [], {}
    for run, docs in calls:
        for name, doc in docs.items():
            if name.startswith(("one_batch_", "serving_tp", "bench_serving_")):
                meta.setdefault("device", doc.get("device"))
                meta.setdefault("versions", doc.get("versions"))
                meta.setdefault("commits", {})[run] = doc.get("commit")
                source = "one_batch (in-process, CUDA graphs, bs=1)" if name.startswith("one_batch") \
                    else BENCH_SERVING_SOURCE if name.startswith("bench_serving_") \
                    else "server (sglang.launch_server, HTTP streaming)"
                for r in doc["rows"]:
                    rows.append(dict(r, run=run, source=source))
            elif name == "kernel_table.json":
                for t in doc:
                    m = re.match(r"(.+)_batch(\d+)_input(\d+)_", t["trace"])
                    if not m:
                        continue
                    for group, ms in t["groups_ms_per_step"].items():
                        rows.append(dict(mode=m.group(1), model="qwen3-8b", context=int(m.group(3)),
                                         batch=int(m.group(2)), metric=f"gpu_ms_per_step: {group}", value=ms,
                                         unit="ms", run=run, source="torch profiler, 2 decode steps"))
                    rows.append(dict(mode=m.group(1), model="qwen3-8b", context=int(m.group(3)), batch=int(m.group(2)),
                                     metric="gpu_busy_ms_per_step", value=t["busy_ms_per_step"], unit="ms", run=run,
                                     source="torch profiler, 2 decode steps"))
    return rows, meta


ADDABLE = ("bench_serving_", "one_batch_")  # the outputs --add takes, by file-name prefix


def add_call(doc_path: Path, output: dict, run: str, kind: str = "bench_serving_") -> dict:
    """serving_<device>.json (doc_path, if it exists) with one call's output (`kind`: a prefix of ADDABLE) added as
    `run`; rows of the same run, source and mode are replaced (adding a call twice keeps one copy; modes measured
    in consecutive calls of one machine can share a run). Extra server flags go to server_flags[run][mode]."""
    if kind not in ADDABLE:
        raise SystemExit(f"--add takes {' or '.join(k + '<device>.json' for k in ADDABLE)} outputs, not {kind}*")
    doc = json.loads(doc_path.read_text()) if doc_path.exists() else dict(
        device=output["device"], versions=output.get("versions"), commits={}, note="", rows=[])
    if doc.get("device") != output["device"]:
        raise SystemExit(f"{doc_path} holds {doc.get('device')} rows; this output is from {output['device']}")
    new, _ = rows_of([(run, {f"{kind}.json": output})])  # the rows as the merge path labels them
    keys = {(r["source"], r["mode"]) for r in new}
    doc["rows"] = [r for r in doc["rows"] if not (r.get("run") == run and (r.get("source"), r["mode"]) in keys)]
    doc["rows"] += new
    doc.setdefault("commits", {})[run] = output.get("commit")
    flags = (output.get("settings") or {}).get("flags")  # bench_serving.py --flags: every mode of this call had them
    modes = {mode for _, mode in keys}
    every = doc.pop("server_flags", {})
    run_flags = {m: f for m, f in every.pop(run, {}).items() if m not in modes}
    if flags:
        run_flags.update(dict.fromkeys(modes, flags))
    if run_flags:
        every[run] = dict(sorted(run_flags.items()))
    if every:
        doc["server_flags"] = every
    return doc


LATEST_RUNS = 4  # calls per model in the bs=1 latency plot


def _call_number(run: str) -> int:
    digits = "".join(ch for ch in run if ch.isdigit())
    return int(digits) if digits else -1


def _tag(device: str) -> str:
    """The device name as a file-name part ("NVIDIA H100 80GB HBM3" -> "NVIDIA_H100_80GB_HBM3")."""
    return re.sub(r"[^A-Za-z0-9]+", "_", device).strip("_")


def plot(rows, out: Path, device: str) -> list:
    """The bs=1 decode-latency plot and the job-throughput plot of one device's calls, named after the device
    (serving_decode_latency_<device>.png, serving_throughput_<device>.png), so that one device's collect does not
    replace another's plots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    lat = [r for r in rows if r["metric"] == "decode_latency" and r["source"].startswith("one_batch")
           and r.get("batch", 1) == 1]
    models = sorted({r["model"] for r in lat})
    if lat:
        # one row of panels per model; the latest LATEST_RUNS calls of each (older ones stay in the JSON)
        fig, axes = plt.subplots(len(models), 2, figsize=(11, 4 * len(models)), squeeze=False)
        for (ax_ms, ax_sp), model in zip(axes, models):
            mine = [r for r in lat if r["model"] == model]
            runs = sorted({r["run"] for r in mine}, key=_call_number)[-LATEST_RUNS:]
            for run in runs:
                for mode in sorted({r["mode"] for r in mine if r["run"] == run}):
                    pts = sorted((r["context"], r["value"]) for r in mine if r["run"] == run and r["mode"] == mode)
                    ax_ms.plot([p[0] / 1024 for p in pts], [p[1] for p in pts], "o-", label=f"{mode} ({run})")
                    base = {r["context"]: r["value"] for r in mine if r["run"] == run and r["mode"] == "fi_bf16"}
                    if base and mode != "fi_bf16":
                        sp = [(c, base[c] / v) for c, v in pts if c in base]
                        ax_sp.plot([p[0] / 1024 for p in sp], [p[1] for p in sp], "o-", label=f"{mode} ({run})")
            ax_ms.set(xlabel="context (k tokens)", ylabel="ms / token", title=f"bs=1 decode, {model} shapes, {device}")
            ax_sp.axhline(1.0, color="gray", lw=0.8)
            ax_sp.set(xlabel="context (k tokens)", ylabel="speedup vs FlashInfer BF16 (same run)",
                      title=f"{model}: decode speedup over FlashInfer BF16")
            for a in (ax_ms, ax_sp):
                a.grid(alpha=0.3)
                a.legend(fontsize=7)
        fig.tight_layout()
        p = out / f"serving_decode_latency_{_tag(device)}.png"
        fig.savefig(p, dpi=110)
        paths.append(p)
    # the latest run of each (workload, mode): older runs stay in the JSON, the plot shows the current code
    latest = {}
    for r in rows:
        if r["metric"] == "job_output_throughput":
            latest[(r["context"], r.get("output_len"), r["mode"])] = r
    thr = sorted(latest.values(), key=lambda r: (r["context"], r["mode"]))
    if thr:
        fig, ax = plt.subplots(figsize=(1.3 * len(thr) + 1.5, 4))
        labels = [f"{r['mode']}\n{r['context'] // 1000}k/{r.get('output_len', '')} ×{r['batch']}\n({r['run']})"
                  for r in thr]
        ax.bar(range(len(thr)), [r["value"] for r in thr], color=["C0" if r["mode"].startswith("int2") else "C1" for r in thr])
        ax.set_xticks(range(len(thr)), labels, fontsize=7)
        ax.set(ylabel="output tok/s per GPU (prefill included)", title=f"job throughput, Qwen3-8B shapes, {device}")
        fig.tight_layout()
        p = out / f"serving_throughput_{_tag(device)}.png"
        fig.savefig(p, dpi=110)
        paths.append(p)
    return paths


def _workload_panels(rows, name: str, out: Path, device: str, draw, size: tuple) -> list:
    """serving_<name>_<device>.png: one panel per workload (IN/OUT) of `rows` (one metric), drawn by
    draw(ax, {mode: (run, the mode's rows of that run)}) with the latest run of each mode, then titled and saved."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not rows:
        return []
    latest = {}
    for r in rows:  # rows come in run order: the last run of a (workload, mode) wins
        latest[(r["context"], r["output_len"], r["mode"])] = r["run"]
    loads = sorted({(c, o) for c, o, _ in latest})
    fig, axes = plt.subplots(1, len(loads), figsize=(size[0] * len(loads), size[1]), squeeze=False)
    for ax, (ctx, n_out) in zip(axes[0], loads):
        draw(ax, {mode: (run, [r for r in rows if (r["context"], r["output_len"], r["mode"], r["run"])
                               == (ctx, n_out, mode, run)])
                  for (c, o, mode), run in sorted(latest.items()) if (c, o) == (ctx, n_out)})
        ax.set(title=f"{ctx:,} in / {n_out:,} out, {device}")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    p = out / f"serving_{name}_{_tag(device)}.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return [p]


def plot_capacity(rows, out: Path, device: str) -> list:
    """serving_capacity_<device>.png: steady decode throughput (tok/s) against the concurrency, one panel per
    workload (IN/OUT), one line per mode, from bench_serving.py rows (the latest run of each workload and mode)."""

    def draw(ax, series):
        for mode, (run, rs) in series.items():
            pts = sorted((r["batch"], r["value"]) for r in rs)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{mode} ({run})")
            for b, v in pts:
                ax.annotate(f"{v:,.0f}", (b, v), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.set(xlabel="concurrent requests (the most that fit, unless swept)", ylabel="steady decode tok/s")
        ax.set_xlim(left=0)

    thr = [r for r in rows if r["metric"] == "decode_throughput" and r.get("output_len")]
    return _workload_panels(thr, "capacity", out, device, draw, (5, 4))


def bin_ratios(num: list, den: list) -> list:
    """[(at_context, ratio)] of two modes' scheduler rates [(at_context, tok/s)] paired by their 1k bin (the bins of
    scheduler_rows: a bin's median context sits anywhere in it, so two modes' medians of one bin may round apart)."""
    other = {int(a) // 1000: v for a, v in den}
    return [(a, v / other[int(a) // 1000]) for a, v in sorted(num) if int(a) // 1000 in other]


def lines_by_batch(rows: list) -> dict:
    """{batch: [(at_context, tok/s)] sorted by context} of one mode's scheduler rows, batches in increasing order:
    one line per concurrency (a run that sweeps concurrencies has rows of several at the same contexts)."""
    return {b: sorted((r["at_context"], r["value"]) for r in rows if r["batch"] == b)
            for b in sorted({r["batch"] for r in rows})}


def plot_scheduler(rows, out: Path, device: str) -> list:
    """serving_scheduler_<device>.png: the servers' own decode rate (scheduler_decode_throughput) against the
    per-request context, one panel per workload, one line per mode and concurrency (the latest run of each), with
    int2's rate at its largest concurrency over each other mode's at its largest, where both reached a context."""

    def draw(ax, series):
        top = {}  # mode -> [(at_context, tok/s)] at the mode's largest concurrency
        for mode, (run, rs) in series.items():
            for b, pts in lines_by_batch(rs).items():
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", ms=3, label=f"{mode} at {b} requests ({run})")
                top[mode] = pts  # batches come in increasing order: the last is the largest
        modes = sorted(top, key=lambda m: m != "int2")  # int2's rate over each baseline's
        for other in (m for m in modes[1:] if series[m][0] == series[modes[0]][0]):  # ratios within one run only
            paired = bin_ratios(top[modes[0]], top[other])
            rate = dict(top[modes[0]])
            for a, ratio in paired[:: max(len(paired) // 4, 1)]:
                ax.annotate(f"{ratio:.2f}x", (a, rate[a]), textcoords="offset points", xytext=(0, 6), fontsize=7,
                            ha="center")
        ax.set(xlabel="context per request (tokens)", ylabel="server decode tok/s (scheduler log)")

    sch = [r for r in rows if r["metric"] == "scheduler_decode_throughput"]
    return _workload_panels(sch, "scheduler", out, device, draw, (6, 4.2))


def add_server_logs(bench: dict, logs: Path) -> dict:
    """bench with scheduler_decode_throughput rows parsed from its servers' logs (logs/<mode>.log), for an output
    whose driver did not record them; workloads that already have them are left as they are."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from bench_serving import scheduler_rows

    have = {(r["mode"], r["context"], r["output_len"], r["batch"]) for r in bench["rows"]
            if r["metric"] == "scheduler_decode_throughput"}
    for r in bench["runs"]:
        log = logs / f"{r['mode']}.log"
        for w in r.get("workloads", []):
            key = (r["mode"], w["context"], w["output_len"], w["batch"])
            if key in have or not log.is_file():
                continue
            bench["rows"] += scheduler_rows(log.read_text(errors="replace"), r["mode"], bench["model"], w["context"],
                                            w["output_len"], w["batch"], bench["run"])
    return bench


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", type=Path, nargs="?")
    ap.add_argument("--out", type=Path, default=Path("benchmark/results"))
    ap.add_argument("--plots", type=Path, default=None)
    ap.add_argument("--add", type=Path, default=None, help="a bench_serving.py or one_batch.py output folder (or its JSON) to add")
    ap.add_argument("--run", default=None, help="with --add: the run name of its rows (e.g. call3)")
    ap.add_argument("--server-logs", type=Path, default=None,
                    help="with --add: the servers' logs (<mode>.log) to read the scheduler's decode rate from")
    args = ap.parse_args()
    if args.add is not None:
        if not args.run:
            raise SystemExit("--add needs --run NAME")
        files = [args.add] if args.add.is_file() else sorted(
            p for k in ADDABLE for p in args.add.glob(f"{k}*.json"))
        if len(files) != 1:
            raise SystemExit(f"--add {args.add}: expected one of {', '.join(k + '<device>.json' for k in ADDABLE)}, "
                             f"found {len(files)}")
        kind = next((k for k in ADDABLE if files[0].name.startswith(k)), files[0].name)
        output = json.loads(files[0].read_text())
        if args.server_logs is not None:
            if kind != "bench_serving_":
                raise SystemExit("--server-logs goes with a bench_serving.py output (one_batch.py has no server logs)")
            output = add_server_logs(output, args.server_logs)
        path = args.out / f"serving_{_tag(output['device'])}.json"
        doc = add_call(path, output, args.run, kind)
        path.write_text(json.dumps(doc, indent=1) + "\n")
        print("wrote", path, len(doc["rows"]), "rows")
        if args.plots:
            rows, device = doc["rows"], doc["device"]
            paths = plot([r for r in rows if r["source"].startswith("one_batch")], args.plots, device) \
                if kind == "one_batch_" else plot_capacity(rows, args.plots, device) + plot_scheduler(rows, args.plots, device)
            for p in paths:
                print("wrote", p)
        return
    if args.root is None:
        raise SystemExit("give the calls' folder (root) or --add")
    rows, meta = rows_of(load_calls(args.root))
    if not rows:
        raise SystemExit(f"no results under {args.root}/call*/")
    device = meta.get("device") or "unknown"
    name = f"serving_{_tag(device)}.json"
    doc = dict(device=device, versions=meta.get("versions"), commits=meta.get("commits"),
               note="ratios only within one run (call); decode_latency from one_batch is bs=1 in-process with CUDA "
                    "graphs; from the server it is the median inter-token gap of a streamed prefix-cache hit",
               rows=rows)
    (args.out / name).write_text(json.dumps(doc, indent=1) + "\n")
    print("wrote", args.out / name, len(rows), "rows")
    if args.plots:
        for p in plot(rows, args.plots, device) + plot_capacity(rows, args.plots, device) + \
                plot_scheduler(rows, args.plots, device):
            print("wrote", p)


if __name__ == "__main__":
    main()
