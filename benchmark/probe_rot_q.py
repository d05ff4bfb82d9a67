"""Probe: q rotated in the CUDA history kernel's CTAs (history_cuda.ROTATE_Q) against q rotated before it, the
decode alone (no write), Qwen3-8B layer shapes, pool pages of 64.

Why: the layer benchmark (bench_write_decode.py, results/decode_step_layer_fca5740_*) measured the decode 1.3-1.45x
slower with the rotation in the kernel at batch 1, growing with the context, i.e. in the streaming loop rather than
in a fixed prologue. The rotation's buffer adds 10 KB of dynamic shared memory per CTA (90 KB instead of 80), which
can change the L1 / shared-memory carveout the driver picks and with it the CTAs resident per SM. This times, per
point and in one process:
  pre_rotated   q . T_q by transform_query's GEMM outside the timed calls, the kernel without rotation
  in_kernel     the raw q and T_q (rotate_q in every CTA)
  in_kernel_ns2 the same at half the split count (if only one CTA per SM fits, fewer splits cost nothing)
each at the driver's carveout and then with history_cuda.SMEM_CARVEOUT = 100 (max shared memory; the attribute
stays set for the rest of the process, so that order). Rows -> $OUT/probe_rot_q_<device>.json.

    python benchmark/probe_rot_q.py --contexts 32768,65536 --batches 1,8
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
from sglang_oscar.kernels import history_cuda  # noqa: E402
from sglang_oscar.kernels.decode import oscar_decode, transform_query  # noqa: E402
from bench_decode import MODELS, SINK, WINDOW, bench, make_oscar, n_copies, oscar_bytes, versions  # noqa: E402
from bench_write import write_json  # noqa: E402


def decode_fns(b, hq, hkv, d, ctx, mode, num_splits=None):
    history_cuda.ROTATE_Q = mode != "pre_rotated"  # off by default (measured slower)
    copies = n_copies(oscar_bytes(b, hq, hkv, d, ctx))
    cache, r2t, seq, ring_start = make_oscar(b, hkv, d, ctx, copies, page=64)
    g = torch.Generator(device="cuda").manual_seed(0)
    t_q = torch.linalg.qr(torch.randn(hkv, d, d, generator=g, device="cuda"))[0].to(torch.bfloat16).contiguous()
    q_raw = torch.randn(b, hq, d, generator=g, device="cuda").to(torch.bfloat16)
    q_rot = transform_query(q_raw, t_q, hkv).contiguous()
    out = torch.empty_like(q_raw)
    q, t = (q_rot, None) if mode == "pre_rotated" else (q_raw, t_q)
    fns = []
    for c in range(copies):
        idx = torch.arange(c * b, (c + 1) * b, dtype=torch.int32, device="cuda")
        fns.append(lambda idx=idx: oscar_decode(q, cache, r2t, idx, seq, ring_start, sink=SINK, window=WINDOW,
                                                sm_scale=1 / math.sqrt(d), out=out, history_kernel="cuda",
                                                q_transform=t, num_splits=num_splits))
    return fns, (cache, r2t)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--contexts", default="32768,65536,131072")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--carveouts", default="none,100", help="comma list, in this order: none (the driver's) or %")
    ap.add_argument("--ncu-driver", default="", help="pre_rotated or in_kernel: only run 4 eager rounds of the "
                    "first context / batch (for Nsight Compute, launch-skip 3), no timing")
    args = ap.parse_args()
    hq, hkv, d = MODELS[args.model]
    if args.ncu_driver:
        ctx, b = int(args.contexts.split(",")[0]), int(args.batches.split(",")[0])
        fns, keep = decode_fns(b, hq, hkv, d, ctx, args.ncu_driver)
        for _ in range(4):
            fns[0]()
            torch.cuda.synchronize()
        return
    dev = torch.cuda.get_device_name()
    rows = []
    for cv in args.carveouts.split(","):
        history_cuda.SMEM_CARVEOUT = None if cv == "none" else int(cv)
        occ = history_cuda.occupancy(heads=history_cuda.cta_heads(hq // hkv))
        print(f"carveout {cv}: occupancy() {occ} CTAs per SM", flush=True)
        for ctx in (int(x) for x in args.contexts.split(",")):
            for b in (int(x) for x in args.batches.split(",")):
                ns = history_cuda.default_num_splits(b * hkv, hq // hkv, ctx, torch.cuda.get_device_properties(0)
                                                     .multi_processor_count)
                for mode, nsp in (("pre_rotated", None), ("in_kernel", None), ("in_kernel_ns2", max(1, ns // 2))):
                    fns, keep = decode_fns(b, hq, hkv, d, ctx, "pre_rotated" if mode == "pre_rotated" else "rot",
                                           num_splits=nsp)
                    us = 1e3 * bench(fns)
                    del fns, keep
                    rows.append(dict(carveout=cv, occupancy=occ, mode=mode, context=ctx, batch=b,
                                     num_splits=nsp or ns, us=us))
                    print(f"carveout {cv:4s} ctx={ctx:6d} b={b:2d} {mode:14s} splits {nsp or ns:3d}: {us:8.2f} us",
                          flush=True)
    write_json(args.out, "probe_rot_q", dev, dict(device=dev, versions=versions(), model=args.model, rows=rows))


if __name__ == "__main__":
    main()
