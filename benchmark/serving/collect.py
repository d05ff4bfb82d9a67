"""Merge the per-call outputs of serving_session.sh into benchmark/results/serving_<device>.json
(rows {mode, model, context, batch, metric, value, unit, run}) and plot docs/results/serving_*_<device>.png.

    python benchmark/serving/collect.py benchmark/results/serving_h100 --out benchmark/results \
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
            if name.startswith(("one_batch_", "serving_tp")):
                meta.setdefault("device", doc.get("device"))
                meta.setdefault("versions", doc.get("versions"))
                meta.setdefault("commits", {})[run] = doc.get("commit")
                source = "one_batch (in-process, CUDA graphs, bs=1)" if name.startswith("one_batch") \
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", type=Path)
    ap.add_argument("--out", type=Path, default=Path("benchmark/results"))
    ap.add_argument("--plots", type=Path, default=None)
    args = ap.parse_args()
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
        for p in plot(rows, args.plots, device):
            print("wrote", p)


if __name__ == "__main__":
    main()
