"""Where the time of one decode layer-call goes at small batch: stage 1, the merge, and the gaps.

bench_decode times whole calls (CUDA-graph replay); at batch 1 the call costs ~10 us more than its
INT2 loop streams at the batch-32 rate (benchmark/NOTES.md "Fixed cost at small batch"). This probe
replays the same graphs under torch.profiler (CUPTI kernel records are kept for graph launches) and
splits each call into stage-1 time, merge time and the gaps between kernels, next to the graph of two
empty Triton kernels per call (the floor of a two-kernel call). Writes $OUT/probe_decode_fixed_cost_<device>.json.

    python benchmark/probe_decode_fixed_cost.py [--contexts 8192,32768,65536,131072] [--batches 1,8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import torch
import triton

sys.path.insert(0, os.path.dirname(__file__))
from bench_write import git_commit  # noqa: E402
from bench_decode import MODELS, bench, capture_graph, make_oscar, n_copies, oscar_bytes, oscar_fns  # noqa: E402
from bench_write import write_json  # noqa: E402
from sglang_oscar.kernels import decode  # noqa: E402


@triton.jit
def _empty(x):
    pass


def kernel_records(graph, replays=20):
    """Kernel (name, start_us, dur_us) of `replays` graph replays, in launch order."""
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    prof.export_chrome_trace(path)
    with open(path) as f:
        trace = json.load(f)
    os.unlink(path)
    ev = [(e["name"], float(e["ts"]), float(e["dur"])) for e in trace["traceEvents"]
          if e.get("cat") == "kernel" and "dur" in e]
    return sorted(ev, key=lambda e: e[1])


def split_calls(ev):
    """Per call (a stage-1 kernel, with history_kernel="cuda" also the CUDA history kernel, in either order, then
    the merge): stage-1 us, history us (None without it), how long the two ran at once (PDL), merge us, the
    merge's overlap with the producers before it, span us (first start to merge end), and the gap to the next
    call's start. Kernels of anything else between them end the candidate call."""
    calls = []
    pending = []
    for k, e in enumerate(ev):
        name = e[0]
        if "merge" in name:
            s = next((x for x in pending if "stage1" in x[0]), None)
            hist = next((x for x in pending if "int2_history" in x[0]), None)
            if s is not None or hist is not None:  # the fused CUDA kernel (window CTAs inside) has no stage 1
                first = min(x[1] for x in pending)
                produced = max(x[1] + x[2] for x in pending)
                nxt = ev[k + 1][1] if k + 1 < len(ev) else None
                both = (max(0.0, min(s[1] + s[2], hist[1] + hist[2]) - max(s[1], hist[1])) if hist and s else None)
                calls.append(dict(stage1=s[2] if s else None, history=hist[2] if hist else None,
                                  history_overlap=both if s else None, merge=e[2],
                                  overlap=max(0.0, produced - e[1]), span=e[1] + e[2] - first,
                                  gap_next=None if nxt is None else nxt - (e[1] + e[2])))
            pending = []
        elif "stage1" in name or "int2_history" in name:
            pending = pending + [e] if len(pending) < 2 else [e]
        else:
            pending = []
    if not calls:  # history_cuda.FUSED_MERGE: a call is the CUDA kernel alone
        hist = [(k, e) for k, e in enumerate(ev) if "int2_history" in e[0]]
        for k, e in hist:
            nxt = ev[k + 1][1] if k + 1 < len(ev) else None
            calls.append(dict(stage1=None, history=e[2], history_overlap=None, merge=None, overlap=None, span=e[2],
                              gap_next=None if nxt is None else nxt - (e[1] + e[2])))
    return calls


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-8b", choices=sorted(MODELS))
    ap.add_argument("--contexts", default="8192,32768,65536,131072")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--splits", default="", help="extra explicit split counts to time at batch 1 (comma list)")
    ap.add_argument("--variants", default="",
                    help="extra oscar_decode keyword sets at every point, 'name:key=int,key=int;name2:...'")
    ap.add_argument("--history-kernel", default="triton", choices=("triton", "cuda"))
    ap.add_argument("--page", type=int, default=1, help="pool page size (kernels/records.py)")
    ap.add_argument("--cuda-configs", default="",
                    help="extra CUDA history (stages:warps) per CTA to time at every point, e.g. 3:4,4:4")
    ap.add_argument("--cuda-windows", default="",
                    help="with --history-kernel cuda, other ways to read the window to time at every point: 'triton' "
                         "(the Triton window programs after the kernel, history_cuda.FUSED_WINDOW off), "
                         "'triton_merge' / 'fused_merge' (the window CTAs, then the Triton merge / the merge in the "
                         "kernel: history_cuda.FUSED_MERGE off / on) or "
                         "'first:ROWS' / 'last:ROWS' (window CTAs before / after the history CTAs, ROWS positions "
                         "per warp), e.g. triton,first:16,last:32")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tag", default="", help="suffix of the output file name")
    args = ap.parse_args()
    hq, hkv, d = MODELS[args.model]
    dev = torch.cuda.get_device_name()
    rows = []

    # floor: two empty kernels per call, same number of calls per graph as the decode graphs use
    x = torch.empty(1, device="cuda")
    for copies in (1, 8):
        us = 1e3 * bench([lambda: (_empty[(1,)](x), _empty[(1,)](x))] * copies)
        rows.append(dict(kind="two_empty_kernels", copies=copies, us_per_call=us))
        print(f"two empty kernels, {copies} calls per graph: {us:.2f} us per call", flush=True)

    for b in [int(v) for v in args.batches.split(",")]:
        for ctx in [int(v) for v in args.contexts.split(",")]:
            q = torch.randn(b, hq, d, dtype=torch.bfloat16, device="cuda")
            copies = n_copies(oscar_bytes(b, hq, hkv, d, ctx))
            cache, r2t, seq, ring_start = make_oscar(b, hkv, d, ctx, copies, page=args.page)
            variants = [("default", {})]
            if b == 1:
                variants.append(("no_pdl", dict(pdl=False)))
                variants += [(f"ns{n}", dict(num_splits=n)) for n in (int(v) for v in args.splits.split(",") if v)]
            for spec in filter(None, args.variants.split(";")):
                name, _, kws = spec.partition(":")
                variants.append((name, {k: int(v) for k, v in (kv.split("=") for kv in kws.split(",") if kv)}))
            if args.history_kernel == "cuda":
                variants += [(f"cfg{c}", {"cuda_config": c}) for c in args.cuda_configs.split(",") if c]
                for w in filter(None, args.cuda_windows.split(",")):  # other ways to read the window, same run
                    variants.append((f"window_{w.replace(':', '')}", {"cuda_window": w}))
            for name, kw in variants:
                kw = dict(kw)
                config = kw.pop("cuda_config", None)
                window = kw.pop("cuda_window", None)
                if args.history_kernel == "cuda":
                    kw = dict(kw, history_kernel="cuda")
                    from sglang_oscar.kernels import history_cuda
                    knobs = ("STAGES", "WARPS", "FUSED_WINDOW", "WINDOW_LAST", "WINDOW_ROWS_PER_WARP", "FUSED_MERGE")
                    default = {k: getattr(history_cuda, k) for k in knobs}
                    if window == "triton":
                        history_cuda.FUSED_WINDOW = False
                    elif window in ("triton_merge", "fused_merge"):
                        history_cuda.FUSED_MERGE = window == "fused_merge"
                    elif window:
                        place, per_warp = window.split(":")
                        history_cuda.FUSED_WINDOW, history_cuda.WINDOW_LAST = True, place == "last"
                        history_cuda.WINDOW_ROWS_PER_WARP = int(per_warp)
                    if config:
                        history_cuda.STAGES, history_cuda.WARPS = (int(v) for v in config.split(":"))
                fns = oscar_fns(q, cache, r2t, seq, ring_start, b, copies, d, **kw)
                us = 1e3 * bench(fns)
                calls = split_calls(kernel_records(capture_graph(fns)))  # the copies' calls once, for the profiler
                if args.history_kernel == "cuda":
                    for k, v in default.items():
                        setattr(history_cuda, k, v)
                r = dict(kind="decode", model=args.model, batch=b, context=ctx, variant=name, copies=copies,
                         history_kernel=args.history_kernel, page=args.page, us_per_call=us,
                         calls_profiled=len(calls),
                         **{k: med(c[k] for c in calls) for k in ("stage1", "history", "history_overlap", "merge",
                                                                  "overlap", "span", "gap_next")})
                rows.append(r)
                print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
            del cache, r2t
            torch.cuda.empty_cache()

    out = dict(device=dev, versions=dict(torch=torch.__version__, triton=triton.__version__, git_commit=git_commit()), rows=rows,
               splits_rule=dict(fold_fill_min_rows=decode.FOLD_FILL_MIN_ROWS))
    write_json(args.out, "probe_decode_fixed_cost" + (f"_{args.tag}" if args.tag else ""), dev, out)


if __name__ == "__main__":
    main()
