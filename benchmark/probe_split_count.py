"""The CUDA history kernel's split count at small batch, swept on the shipped path: the decode alone and the decode
step's layer chain (the write with q in its launch, the history kernel as its programmatic dependent: what the server
runs at small batch), each at the rule's count (auto) and at fixed counts, in interleaved rounds so that a count is
compared with the others of the same round.

Why: with the in-kernel q rotation (reverted) 16 splits beat the rule's 32 at 64k batch 1 (31.1 vs 37.3 us); at 32k
batch 1 an older sweep had 16 splits 20.7 us and 20-32 splits 23-26 us. The rule fills one round of resident CTAs
(2 per SM), so whether one CTA per SM is faster at batch 1-2 had not been measured for the shipped kernel.

"auto" is the count oscar_decode picks by itself in that mode (history_cuda.split_count). No SGLang or FlashInfer
needed (kernels only). Writes $OUT/probe_split_count_<tag>_<device>.json: per (mode, context, batch, splits) the
median over rounds of each round's us per call, and min / max.

    python benchmark/probe_split_count.py --contexts 32768,65536,131072 --batches 1,2 --rounds 3
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(__file__))
from bench_decode import MODELS, SINK, WINDOW, bench, make_oscar, n_copies, oscar_bytes, oscar_fns  # noqa: E402
from bench_write import git_commit, write_json  # noqa: E402
from bench_write_decode import OSCAR_PAGE, oscar_chain_fns  # noqa: E402

DEFAULT_SPLITS = {1: "8,12,16,20,24,28,32", 2: "4,6,8,10,12,16", 4: "3,4,6,8"}


def rule_splits(mode, b, hkv, gqa, d, ctx):
    """The count oscar_decode picks by itself (num_splits None) in this mode (history_cuda.plan; chain: the write
    rotates q, as the server's)."""
    from sglang_oscar.kernels import history_cuda
    from sglang_oscar.kernels.decode import _num_sms
    from sglang_oscar.kernels.write import default_block_t, write_grid

    chained = math.prod(write_grid(b, hkv, default_block_t(b, d), True)) if mode == "chain" else None
    return history_cuda.plan(b, hkv, gqa, ctx, _num_sms(torch.device("cuda")), SINK, WINDOW, chained)[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-8b", choices=sorted(MODELS))
    ap.add_argument("--contexts", default="32768,65536,131072")
    ap.add_argument("--batches", default="1,2")
    ap.add_argument("--splits", action="append", default=[],
                    help="BATCH:comma list of split counts (repeatable); default " +
                         "; ".join(f"{b}:{s}" for b, s in DEFAULT_SPLITS.items()))
    ap.add_argument("--modes", default="alone,chain", help="alone: the decode only; chain: write + decode")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    hq, hkv, d = MODELS[args.model]
    per_batch = dict(DEFAULT_SPLITS)
    for spec in args.splits:
        b, _, lst = spec.partition(":")
        per_batch[int(b)] = lst
    dev = torch.cuda.get_device_name()
    rows = []
    for ctx in (int(v) for v in args.contexts.split(",")):
        for b in (int(v) for v in args.batches.split(",")):
            copies = n_copies(oscar_bytes(b, hq, hkv, d, ctx))
            fns, auto, keep = {}, {}, []
            for mode in ("alone", "chain"):
                if mode not in args.modes:
                    continue
                auto[mode] = rule_splits(mode, b, hkv, hq // hkv, d, ctx)
                counts = [None] + [n for n in (int(v) for v in per_batch.get(b, "").split(",") if v) if n != auto[mode]]
                if mode == "alone":
                    q = torch.randn(b, hq, d, dtype=torch.bfloat16, device="cuda")
                    cache, r2t, seq, ring_start = make_oscar(b, hkv, d, ctx, copies, page=OSCAR_PAGE)
                    keep.append((q, cache, r2t, seq, ring_start))
                    for n in counts:
                        fns[(mode, n)] = oscar_fns(q, cache, r2t, seq, ring_start, b, copies, d, history_kernel="cuda",
                                                   num_splits=n)
                else:
                    for n in counts:
                        chains, _, kept = oscar_chain_fns(b, hq, hkv, d, ctx, copies, after_write=True, fuse_q=True,
                                                          num_splits=n)
                        fns[(mode, n)] = chains
                        keep.append(kept)
            times = {k: [] for k in fns}
            for r in range(args.rounds):
                order = list(fns) if r % 2 == 0 else list(fns)[::-1]  # interleaved, alternating order
                for k in order:
                    times[k].append(1e3 * bench(fns[k]))
            for (mode, n), ts in times.items():
                row = dict(impl=f"{mode}:{'auto' if n is None else n}", model=args.model, mode=mode, context=ctx,
                           batch=b, splits=n or auto[mode], rule=n is None, auto_splits=auto[mode],
                           us=statistics.median(ts), us_min=min(ts), us_max=max(ts), rounds=ts)
                rows.append(row)
            for mode in ("alone", "chain"):
                sel = [r for r in rows if r["mode"] == mode and r["context"] == ctx and r["batch"] == b]
                if not sel:
                    continue
                base = next(r["us"] for r in sel if r["rule"])
                print(f"{mode:5s} ctx {ctx:6d} b {b}: " + "  ".join(
                    f"{r['splits']}{'*' if r['rule'] else ''}={r['us']:.1f}({r['us'] / base:.2f})" for r in sel),
                    flush=True)
            del fns, keep
            torch.cuda.empty_cache()
            # after every point: a run cut short by the call's time limit keeps what it measured
            out = dict(device=dev, model=args.model, page=OSCAR_PAGE, rounds=args.rounds,
                       versions=dict(torch=torch.__version__, triton=triton.__version__, git_commit=git_commit()),
                       rows=rows)
            write_json(args.out, "probe_split_count" + (f"_{args.tag}" if args.tag else ""), dev, out)


if __name__ == "__main__":
    main()
