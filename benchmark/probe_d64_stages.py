"""The CUDA history kernel at head_dim 64 (SmolLM2's 9 / 3 heads) against its pipeline depth: history_cuda.STAGES 2 /
3 / 4 in one process (interleaved rounds), the paged pool of bench_decode.py, CUDA graphs. Why: the folded D-64 tile
(e789060) cut the instructions per 32 tokens to 0.68x and the time did not move (128k batch 64: 510.8 vs 512.0 us), so
the loop waits on memory: a D-64 stage holds 48 bytes per token (D 128: 80), i.e. fewer bytes in flight per warp.

    python benchmark/probe_d64_stages.py --out $OUT [--contexts 32768,131072] [--batches 1,8,64] [--stages 2,3,4]
        [--narrow]

Since f4f029d a plain launch at D 64 runs 64-token stages where they are built (history_cuda.D64_WIDE_STAGES: 2 and 3
stages) and 32-token ones at 4 stages; --narrow times 32-token stages at every depth (D64_WIDE_BLOCKS off), as the
sweep of d8adc5c did.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_decode as bd  # noqa: E402
from sglang_oscar.kernels import history_cuda  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--contexts", default="32768,131072")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--stages", default="2,3,4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--narrow", action="store_true", help="32-token stages at every depth (D64_WIDE_BLOCKS off)")
    args = ap.parse_args(argv)
    if args.narrow:
        history_cuda.D64_WIDE_BLOCKS = False
    hq, hkv, d = bd.MODELS["smollm2"]
    rows = []
    for ctx in map(int, args.contexts.split(",")):
        for b in map(int, args.batches.split(",")):
            q = torch.randn(b, hq, d, dtype=torch.bfloat16, device="cuda")
            nbytes = bd.oscar_bytes(b, hq, hkv, d, ctx)
            copies = bd.n_copies(nbytes)
            cache, r2t, seq, rs = bd.make_oscar(b, hkv, d, ctx, copies, page=64)
            times = {s: [] for s in map(int, args.stages.split(","))}
            for _ in range(args.rounds):
                for s in times:
                    history_cuda.STAGES = s
                    times[s].append(bd.bench(bd.oscar_fns(q, cache, r2t, seq, rs, b, copies, d,
                                                          history_kernel="cuda")))
            history_cuda.STAGES = 2
            for s, ts in times.items():
                ms = min(ts)
                wide = history_cuda.D64_WIDE_BLOCKS and s in history_cuda.D64_WIDE_STAGES
                row = dict(context=ctx, batch=b, stages=s, ms=ms, rounds_ms=ts, gbps=nbytes / ms / 1e6,
                           block_tokens=64 if wide else 32,
                           ctas_per_sm=history_cuda.occupancy(stages=s, heads=4, head_dim=64, wide=wide))
                rows.append(row)
                print(f"ctx {ctx:6d} b {b:2d} stages {s}: {ms * 1e3:7.1f} us (rounds {[round(t * 1e3, 1) for t in ts]}) "
                      f"{row['gbps']:.0f} GB/s, {row['ctas_per_sm']} CTAs/SM", flush=True)
            del cache, r2t
    res = dict(device=torch.cuda.get_device_name(), versions=bd.versions(), rows=rows)
    name = torch.cuda.get_device_name().replace(" ", "_")
    with open(os.path.join(args.out, f"probe_d64_stages_{name}.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
