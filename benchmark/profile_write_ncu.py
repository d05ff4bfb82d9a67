"""Launch the decode-step write (one token per request, q rotated in its launch) on one benchmark shape, for Nsight
Compute (benchmark/run_gpu_ncu_write.sh). Three launches: two to compile and warm up, the third one profiled; no
timing here (bench_write_decode.py --write-sweep times).

    ncu --kernel-name regex:_oscar_write_kv_kernel --launch-skip 2 --launch-count 1 --set full \\
        python benchmark/profile_write_ncu.py --model qwen3-8b --batch 1
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_decode import MODELS  # noqa: E402
from bench_write_decode import oscar_chain_fns  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-8b", choices=sorted(MODELS))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--no-q", action="store_true", help="the write without q's rotation")
    args = ap.parse_args()
    hq, hkv, d = MODELS[args.model]
    _, writes, keep = oscar_chain_fns(args.batch, hq, hkv, d, ctx=4096, copies=1, after_write=False,
                                      fuse_q=not args.no_q)
    for _ in range(3):
        writes[0]()
    torch.cuda.synchronize()
    print("done", args)


if __name__ == "__main__":
    main()
