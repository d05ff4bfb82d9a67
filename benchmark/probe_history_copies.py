"""How long the CUDA history kernel's copies alone take: the shipped kernel against a build of the same source with
OSCAR_PROBE_COPIES=1 (the loop issues and waits for every copy, the slots' loads included, and skips the tiles'
math), on the same grid (the split plan pinned to the shipped build's occupancy), beside a streaming read of the
same bytes (read_roofline.py), in one process with interleaved rounds, CUDA graphs, the paged pool of
bench_decode.py.

Why: at head_dim 64 (SmolLM2) the kernel moves ~2.0-2.1 TB/s at batch 64 where a read of its bytes takes 0.46x the
time, and neither 0.68x the instructions (the folded tile) nor deeper pipelines moved it (benchmark/NOTES.md). If
the copies alone take about as long as the kernel, their pattern is the bound (four small copies per token from four
arrays); if they take about as long as the read, the loop's math is.

    python benchmark/probe_history_copies.py --out $OUT [--points smollm2:65536:8,...] [--copy-stages 2,4]

Rows {model, context, batch, impl, ms, rounds_ms, gbps, pct_copy_bw}: impl shipped, copies_sN (copies only, N
stages; the shipped kernel runs 2), read_same_bytes. Since f4f029d the D-64 launches run 64-token stages at 2-3 stages
(history_cuda.block_tokens) in both builds, and 32-token ones at 4: copies_s4 at D 64 then copies in 32-token blocks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_decode as bd  # noqa: E402
from bench_write import git_commit  # noqa: E402
from read_roofline import read_fns  # noqa: E402
from sglang_oscar.kernels import history_cuda  # noqa: E402

DEFAULT_POINTS = ("smollm2:65536:1,smollm2:65536:8,smollm2:131072:8,smollm2:32768:64,smollm2:131072:64,"
                  "qwen3-8b:65536:1,qwen3-8b:65536:8,qwen3-8b:131072:8,qwen3-8b:65536:32")


def parse_points(text: str) -> list:
    out = []
    for item in text.split(","):
        model, ctx, batch = item.split(":")
        if model not in bd.MODELS:
            raise SystemExit(f"unknown model {model!r} in --points (one of {sorted(bd.MODELS)})")
        out.append((model, int(ctx), int(batch)))
    return out


class PinnedOccupancy:
    """history_cuda.occupancy that still prepares the library in use (its shared-memory limit) but returns what the
    shipped build returned for that configuration: the copies-only build needs fewer registers, so it would get
    more CTAs per SM and with them another split count, i.e. another grid."""

    def __init__(self):
        self.orig = history_cuda.occupancy
        self.shipped = {}
        self.recording = True

    def __call__(self, stages=None, warps=None, heads=4, head_dim=128, wide=False):
        v = self.orig(stages, warps, heads, head_dim, wide)
        key = (stages or history_cuda.STAGES, warps or history_cuda.WARPS, heads, head_dim, bool(wide))
        if self.recording:
            self.shipped[key] = v
            return v
        if key not in self.shipped:  # main() copies the shipped 2-stage counts to the copies-only build's depth
            raise RuntimeError(f"no shipped occupancy recorded for {key}: time the shipped kernel first")
        return self.shipped[key]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--points", default=DEFAULT_POINTS, help="model:context:batch,...")
    ap.add_argument("--copy-stages", default="2,4", help="pipeline depths of the copies-only build")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    points = parse_points(args.points)
    copy_stages = [int(s) for s in args.copy_stages.split(",")]

    shipped_lib = history_cuda.library()
    copies_lib = history_cuda.load(history_cuda.build(("OSCAR_PROBE_COPIES=1",)))
    pinned = PinnedOccupancy()
    history_cuda.occupancy = pinned
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    copy_gbps = bd.copy_bandwidth() / 1e9  # bytes/s -> GB/s
    print(f"copy bandwidth {copy_gbps:.0f} GB/s, {sms} SMs", flush=True)
    rows = []
    try:
        for model, ctx, b in points:
            hq, hkv, d = bd.MODELS[model]
            stages_ok = [s for s in copy_stages if d != 64 or s in history_cuda.D64_STAGES]
            q = torch.randn(b, hq, d, dtype=torch.bfloat16, device="cuda")
            nbytes = bd.oscar_bytes(b, hq, hkv, d, ctx)
            copies = bd.n_copies(nbytes)
            cache, r2t, seq, rs = bd.make_oscar(b, hkv, d, ctx, copies, page=64)
            reads, _keep = read_fns(nbytes, copies, sms)
            impls = ["shipped"] + [f"copies_s{s}" for s in stages_ok] + ["read_same_bytes"]
            times = {i: [] for i in impls}
            for _ in range(args.rounds):
                for impl in impls:
                    if impl == "read_same_bytes":
                        times[impl].append(bd.bench(reads))
                        continue
                    copies_only = impl != "shipped"
                    history_cuda.use_library(copies_lib if copies_only else shipped_lib)
                    history_cuda.STAGES = int(impl[len("copies_s"):]) if copies_only else 2
                    pinned.recording = not copies_only
                    if copies_only:  # the same split count as the shipped kernel at its 2 stages
                        for key in [k for k in pinned.shipped if k[0] == 2]:
                            pinned.shipped[(history_cuda.STAGES,) + key[1:]] = pinned.shipped[key]
                    try:
                        times[impl].append(bd.bench(bd.oscar_fns(q, cache, r2t, seq, rs, b, copies, d,
                                                                 history_kernel="cuda")))
                    finally:
                        history_cuda.use_library(shipped_lib)
                        history_cuda.STAGES = 2
                        pinned.recording = True
            for impl, ts in times.items():
                ms = min(ts)
                gbps = nbytes / ms / 1e6
                row = dict(model=model, context=ctx, batch=b, head_dim=d, impl=impl, ms=ms, rounds_ms=ts,
                           bytes=nbytes, gbps=gbps, pct_copy_bw=100 * gbps / copy_gbps)
                rows.append(row)
                print(f"{model:9s} ctx {ctx:6d} b {b:2d} {impl:15s} {ms * 1e3:8.1f} us "
                      f"(rounds {[round(t * 1e3, 1) for t in ts]}) {gbps:6.0f} GB/s {row['pct_copy_bw']:5.1f}% copy",
                      flush=True)
            del cache, r2t, reads, _keep
            torch.cuda.empty_cache()
    finally:
        history_cuda.occupancy = pinned.orig
    res = dict(device=torch.cuda.get_device_name(), versions=bd.versions(), commit=git_commit(),
               copy_gbps=copy_gbps, rows=rows)
    name = torch.cuda.get_device_name().replace(" ", "_")
    path = os.path.join(args.out, f"probe_history_copies_{name}.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
