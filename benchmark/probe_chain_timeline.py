"""Where a decode step's layer chain spends its time at small batch: the kernels of each call (q's GEMM where there
is one, the KV write, the CUDA history kernel, the merge) from CUDA-graph replays under torch.profiler, as
offsets from the call's first kernel start: when each one starts and ends. Why: the chained layer (the history
kernel as the write's programmatic dependent) costs about the write's time over the decode alone at batch 1
(64k: 35.5 vs 30.2 + 4.7 us), and neither q rotated in the history CTAs nor a q handoff from the write's q
programs moved it (benchmark/NOTES.md): the timeline says what the history kernel is waiting for.

Writes $OUT/probe_chain_timeline_<device>.json: per (impl, context, batch) the median over calls of each kernel's
start and end offset (us), the span (first start to last end) and us per call in the graph.

    python benchmark/probe_chain_timeline.py --contexts 65536,131072 --batches 1,8
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(__file__))
from bench_decode import MODELS, bench, capture_graph, make_oscar, n_copies, oscar_bytes, oscar_fns  # noqa: E402
from bench_write import git_commit, write_json  # noqa: E402
from bench_write_decode import OSCAR_PAGE, oscar_chain_fns  # noqa: E402
from probe_decode_fixed_cost import kernel_records  # noqa: E402

IMPLS = {  # name: (after_write, fuse_q); "alone": the decode only (q already rotated)
    "fused_q_after_write": (True, True),  # the server's chain at small batch
    "fused_q": (False, True),
    "gemm_after_write": (True, False),
    "alone": None,
}


def short(name: str) -> str:
    for key, tag in (("write", "write"), ("history", "history"), ("merge", "merge"), ("stage1", "stage1")):
        if key in name:
            return tag
    return "other"  # q's GEMM (cuBLAS / CUTLASS names vary)


def per_call(records):
    """Split kernel records (name, start, dur), in launch order, into calls: each ends with its merge."""
    calls, cur = [], []
    for name, t0, dur in records:
        tag = short(name)
        cur.append((tag, t0, t0 + dur))
        if tag == "merge":
            calls.append(cur)
            cur = []
    return calls


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-8b", choices=sorted(MODELS))
    ap.add_argument("--contexts", default="65536,131072")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    hq, hkv, d = MODELS[args.model]
    dev = torch.cuda.get_device_name()
    rows = []
    for ctx in (int(v) for v in args.contexts.split(",")):
        for b in (int(v) for v in args.batches.split(",")):
            copies = n_copies(oscar_bytes(b, hq, hkv, d, ctx))
            for impl in args.impls.split(","):
                if IMPLS[impl] is None:
                    q = torch.randn(b, hq, d, dtype=torch.bfloat16, device="cuda")
                    cache, r2t, seq, ring_start = make_oscar(b, hkv, d, ctx, copies, page=OSCAR_PAGE)
                    fns, keep = oscar_fns(q, cache, r2t, seq, ring_start, b, copies, d, history_kernel="cuda"), cache
                else:
                    after_write, fuse_q = IMPLS[impl]
                    fns, _, keep = oscar_chain_fns(b, hq, hkv, d, ctx, copies, after_write=after_write, fuse_q=fuse_q)
                us = 1e3 * bench(fns)
                calls = per_call(kernel_records(capture_graph(fns)))
                kernels = {}
                for call in calls:
                    base = min(t0 for _, t0, _ in call)
                    for tag, t0, t1 in call:
                        kernels.setdefault(tag, []).append((t0 - base, t1 - base))
                    kernels.setdefault("span", []).append((0.0, max(t1 for _, _, t1 in call) - base))
                timeline = {tag: dict(start=statistics.median(s for s, _ in v), end=statistics.median(e for _, e in v))
                            for tag, v in kernels.items()}
                rows.append(dict(impl=impl, model=args.model, context=ctx, batch=b, us=us, calls=len(calls),
                                 timeline=timeline))
                print(f"{impl:20s} ctx {ctx:6d} b {b:2d}: {us:6.1f} us/call | " + "  ".join(
                    f"{tag} {t['start']:5.1f}-{t['end']:5.1f}" for tag, t in timeline.items()), flush=True)
                del fns, keep
                torch.cuda.empty_cache()
    out = dict(device=dev, model=args.model, versions=dict(torch=torch.__version__, triton=triton.__version__,
                                                             git_commit=git_commit()), rows=rows)
    write_json(args.out, "probe_chain_timeline", dev, out)


if __name__ == "__main__":
    main()
