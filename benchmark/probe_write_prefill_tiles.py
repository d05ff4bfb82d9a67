"""The prefill write's tile (block_t x num_warps) at head_dim 128, with the compiled kernel's registers and spills.

Why: bench_write.py on H100 and H200 timed a Qwen3-8B prefill write with V absorbed into the weights (no V transform,
less work) at ~2x the time of the write with a V transform when the transform's dot runs in IEEE fp32 (the default
precision): 6.38 vs 3.28 ms per layer at 100k tokens on H200 (results/write_kernel_NVIDIA_H200.json). This times
oscar_write_kv for both at each tile and reads n_regs / n_spills of the Triton kernel each tile compiled to.

    python benchmark/probe_write_prefill_tiles.py [--tokens 100000] [--precisions ieee,tf32x3]
Writes $OUT/probe_write_prefill_tiles_<device>.json.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_write import MODELS, bench, git_commit, make_inputs, write_json  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--precisions", default="ieee,tf32x3")
    ap.add_argument("--tiles", default="16:4,16:8,32:4,32:8,64:4,64:8",
                    help="block_t:num_warps pairs; 'default': oscar_write_kv's own choice (default_block_t, "
                         "default_num_warps)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    from sglang_oscar.kernels.write import _oscar_write_kv_kernel, default_block_t, default_num_warps, oscar_write_kv

    m = MODELS["Qwen3-8B"]
    rows = []
    for precision in args.precisions.split(","):
        for v_absorbed in (False, True):
            inputs, kw, nbytes = make_inputs(m, args.tokens, False, gk=64, gv=64, v_absorbed=v_absorbed)
            for tile in args.tiles.split(","):
                own = tile == "default"
                if own:
                    bt = default_block_t(args.tokens, m["head_dim"])
                    nw = default_num_warps(args.tokens, m["head_dim"], bt, precision)
                else:
                    bt, nw = (int(x) for x in tile.split(":"))
                call = lambda: oscar_write_kv(*inputs, **kw, precision=precision, validate=False,  # noqa: E731
                                              **({} if own else dict(block_t=bt, num_warps=nw)))
                cached = [c for d in _oscar_write_kv_kernel.device_caches.values() for c in d[0].values()]
                call()
                torch.cuda.synchronize()
                # the variant this call compiled (a tile already compiled in this process, e.g. 'default' and the
                # same block_t:num_warps, adds none: its registers are in that earlier row)
                new = [c for d in _oscar_write_kv_kernel.device_caches.values() for c in d[0].values()
                       if not any(c is x for x in cached)]
                n_regs, n_spills = (new[-1].n_regs, new[-1].n_spills) if new else (None, None)
                ms = bench(call, False)
                row = dict(precision=precision, v_absorbed=v_absorbed, block_t=bt, num_warps=nw,
                           default=own or (bt == default_block_t(args.tokens, m["head_dim"])
                                           and nw == default_num_warps(args.tokens, m["head_dim"], bt, precision)),
                           layer_call_us=ms * 1e3, gbps=nbytes / (ms * 1e-3) / 1e9, n_regs=n_regs, n_spills=n_spills)
                rows.append(row)
                print(f"{precision:7s} v_abs={int(v_absorbed)} bt={bt:3d} warps={nw}  {ms * 1e3:8.1f} us  "
                      f"regs {n_regs} spills {n_spills}" + ("  (default)" if row["default"] else ""), flush=True)
            del inputs
            torch.cuda.empty_cache()
    dev = torch.cuda.get_device_name()
    write_json(args.out, "probe_write_prefill_tiles", dev,
               dict(device=dev, tokens=args.tokens, git_commit=git_commit(), torch=torch.__version__, rows=rows))


if __name__ == "__main__":
    main()
