"""Per-kernel GPU time of one decode step, from one_batch.py --profile traces (torch profiler,
GPU activity only, 2 decode steps per trace): the breakdown the paper gives as its Table 8.

    python benchmark/serving/kernel_table.py OUT/traces [--steps 2] [--json table.json]
    python benchmark/serving/kernel_table.py OUT/logs/traces --steps 0 --layers 36   # bench_serving --profile-steps

Kernels are summed by name, divided by the steps traced, and grouped (attention, KV write, GEMM,
norm/rope/activation, other). Kernels chained with programmatic dependent launch (PDL: the CUDA
history kernel, the window programs and the merge) overlap, so their summed durations count the
overlap twice: GPU busy time per step is therefore the union of the kernel intervals, and each
attention call is also reported as its span (first attention kernel's start to last one's end), the
time the layer actually waits for attention.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
from pathlib import Path

GROUPS = (  # first match wins; patterns are searched in the lower-cased kernel name
    ("attention: oscar decode", r"_oscar_decode|int2_history_kernel"),
    ("kv write: oscar", r"_oscar_write|oscar_write|_write_kernel"),
    ("norm / rope / activation", r"rmsnorm|norm::|qknorm|rotary|rope_kernel|silu|act_and_mul|gelu"),
    ("attention: flashinfer", r"flashinfer|batchdecode|batchprefill|persistent"),
    ("attention: sglang triton", r"_fwd_kernel_stage|_fwd_grouped_kernel|decode_attention"),
    ("kv write: stock", r"store_kvcache|set_kv_buffer|copy_kv|cache_move"),
    ("gemm", r"gemm|cutlass|sm90_xmma|nvjet|cublas|matmul|splitk"),
    ("sampling / logits", r"argmax|softmax|sample|topk|top_k"),
)


def group_of(name: str) -> str:
    low = name.lower()
    for g, pat in GROUPS:
        if re.search(pat, low):
            return g
    return "other"


def summarize(path: Path, steps: int = 0, layers: int = 0) -> dict:
    """steps: decode steps in the trace; 0: attention calls / layers (a served trace's step count is not fixed)."""
    with gzip.open(path, "rt") if path.suffix == ".gz" else open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    by_name = collections.Counter()
    calls = collections.Counter()
    kernels = sorted(((float(e["ts"]), float(e.get("dur", 0.0)), e["name"]) for e in events
                      if e.get("ph") == "X" and e.get("cat") == "kernel"))
    if not kernels:
        raise SystemExit(f"{path}: no GPU kernel events (was the trace taken with GPU activity?)")
    for _, dur, name in kernels:
        by_name[name] += dur
        calls[name] += 1
    # the attention kernel that runs once per layer (the others of a call, e.g. a merge, as often or less)
    att = max((name for name in calls if group_of(name).startswith("attention")), key=lambda n: calls[n],
              default=None)
    if not steps:
        if not layers:
            raise SystemExit(f"{path}: give --steps, or --layers to count steps as attention calls / layers")
        n = calls[att] if att is not None else 0
        steps = n // layers
        if steps < 1 or n != steps * layers:
            raise SystemExit(f"{path}: {n} calls of the attention kernel are not a whole number of {layers}-layer "
                             "steps")
    # what a step took on the GPU's clock, and the part of it no kernel ran (host time: scheduling, launches, that
    # the GPU waited for): with the layer count, between the first layer's attention call of the first and of the
    # last step (a served trace starts and ends mid-step), per step; else from the first kernel's start to the last
    # one's end
    window = [kernels[0][0], max(ts + dur for ts, dur, _ in kernels)]
    per = steps
    if layers and steps >= 2 and att is not None:
        starts = [ts for ts, _, name in kernels if name == att]
        window, per = [starts[0], starts[(steps - 1) * layers]], steps - 1
    inside = [(max(ts, window[0]), min(ts + dur, window[1]) - max(ts, window[0]), n) for ts, dur, n in kernels
              if ts < window[1] and ts + dur > window[0]]
    wall, busy_in = window[1] - window[0], union_us(inside)
    groups = collections.Counter()
    for n, us in by_name.items():
        groups[group_of(n)] += us
    spans = attention_spans(kernels)
    busy = union_us(kernels)
    return dict(trace=path.name, steps=steps,
                wall_ms_per_step=round(wall / per / 1e3, 4),
                busy_ms_per_step=round(busy / steps / 1e3, 4),
                idle_ms_per_step=round((wall - busy_in) / per / 1e3, 4),
                summed_ms_per_step=round(sum(by_name.values()) / steps / 1e3, 4),
                attention_calls_per_step=len(spans) / steps,
                attention_span_us_mean=round(sum(spans) / max(len(spans), 1), 2),
                attention_span_ms_per_step=round(sum(spans) / steps / 1e3, 4),
                groups_ms_per_step={g: round(us / steps / 1e3, 4) for g, us in groups.most_common()},
                kernels=[dict(name=n[:120], group=group_of(n), calls_per_step=calls[n] / steps,
                              ms_per_step=round(us / steps / 1e3, 4)) for n, us in by_name.most_common(25)])


def union_us(kernels: list) -> float:
    """Length of the union of [ts, ts + dur) over kernels sorted by start (overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for ts, dur, _ in kernels:
        if ts + dur > end:
            total += ts + dur - max(ts, end)
            end = ts + dur
    return total


def attention_spans(kernels: list) -> list:
    """One span per attention call: a maximal run of consecutive (by start) attention kernels, from the
    first start to the last end."""
    spans, start, end = [], None, None
    for ts, dur, name in kernels:
        if group_of(name).startswith("attention"):
            start = ts if start is None else start
            end = ts + dur if end is None else max(end, ts + dur)
        elif start is not None:
            spans.append(end - start)
            start = end = None
    if start is not None:
        spans.append(end - start)
    return spans


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", type=Path, help="a trace file or a folder of *.trace.json.gz")
    ap.add_argument("--steps", type=int, default=2, help="decode steps in each trace (one_batch.py: 2); 0: from "
                    "--layers")
    ap.add_argument("--layers", type=int, default=0, help="the model's layers: steps = attention calls / layers "
                    "(bench_serving.py --profile-steps traces; Qwen3-8B: 36)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    files = sorted(args.traces.glob("*.trace.json*")) if args.traces.is_dir() else [args.traces]
    if not files:
        raise SystemExit(f"no *.trace.json[.gz] under {args.traces}")
    tables = [summarize(p, args.steps, args.layers) for p in files]
    for t in tables:
        print(f"\n{t['trace']}: {t['steps']} steps, {t['wall_ms_per_step']:.3f} ms/step on the GPU's clock, busy "
              f"{t['busy_ms_per_step']:.3f} (idle {t['idle_ms_per_step']:.3f}; kernels summed "
              f"{t['summed_ms_per_step']:.3f}); attention {t['attention_calls_per_step']:.0f} calls/step, "
              f"span {t['attention_span_us_mean']:.1f} us each, {t['attention_span_ms_per_step']:.3f} ms/step")
        for g, ms in t["groups_ms_per_step"].items():
            print(f"  {g:28s} {ms:8.3f} ms")
    if args.json:
        args.json.write_text(json.dumps(tables, indent=1) + "\n")


if __name__ == "__main__":
    main()
