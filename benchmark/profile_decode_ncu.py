"""Launch the decode kernel on one benchmark shape, for Nsight Compute (benchmark/run_gpu_ncu_decode.sh).

    ncu --kernel-name regex:_oscar_decode_stage1 --launch-skip 2 --launch-count 1 \
        python benchmark/profile_decode_ncu.py --model qwen3-8b --batch 32 --context 131072 [--config 128:2:3]

    ncu --kernel-name regex:int2_history_kernel --launch-skip 2 --launch-count 1 \
        python benchmark/profile_decode_ncu.py --model qwen3-8b --batch 8 --context 65536 --config cuda

Three launches (two to compile and warm up, the third one profiled); no timing here (bench_decode.py times).
--config cuda: the CUDA history stage (kernels/history_cuda.py) on a pool in pages of 64, its default plan."""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_decode import MODELS, SINK, WINDOW, make_oscar, parse_oscar_config  # noqa: E402
from sglang_oscar.kernels.decode import oscar_decode  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-8b", choices=sorted(MODELS))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--config", default="128:2:3", help="as bench_decode.py --oscar-configs (one), or cuda")
    args = ap.parse_args()
    hq, hkv, d = MODELS[args.model]
    cuda = args.config == "cuda"
    cache, r2t, seq, ring_start = make_oscar(args.batch, hkv, d, args.context, 1, page=64 if cuda else 1)
    q = torch.randn(args.batch, hq, d, dtype=torch.bfloat16, device="cuda")
    idx = torch.arange(args.batch, dtype=torch.int32, device="cuda")
    kw = {"history_kernel": "cuda"} if cuda else parse_oscar_config(args.config)[1]
    for _ in range(3):
        oscar_decode(q, cache, r2t, idx, seq, ring_start, sink=SINK, window=WINDOW, sm_scale=1 / math.sqrt(d), **kw)
    torch.cuda.synchronize()
    print("done", args)


if __name__ == "__main__":
    main()
