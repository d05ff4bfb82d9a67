"""Benchmark of the extend path's prefix rebuild: oscar_gather_prefixes (kernels/gather.py) next to
the attention it feeds, FlashInfer's ragged prefill (srt/extend_attention.py), in one run.

A chunked prefill or a radix hit with a cached prefix of P tokens runs, per layer: gather the P
rows from the int2 pool into BF16 (INT2 dequantize + sink / ring rows), then causal attention of
the chunk's C new tokens over P + C keys. This script times both per layer call for Qwen3-8B
(32 q / 8 kv heads, D 128, 36 layers) and SmolLM2-135M (9 / 3, D 64, 30 layers) shapes, at
P = 32k and 100k (+ 8k), C = 8192 (SGLang's chunk on an H100) and 512 (a radix hit with a short
new turn), and reports:

  gather_ms      median time of one gather call (one layer, one request)
  gather_gbps    bytes that must move (INT2 codes + (scale, min) read, BF16 rows written,
                 req_to_token read) / time, and its % of a device-to-device copy timed in the same run
  attn_ms        FlashInfer ragged prefill of the chunk over P + C keys (one layer), if importable
  gather_share   gather_ms / (gather_ms + attn_ms): the cost of reading the prefix through a
                 BF16 buffer instead of an attention kernel that reads INT2 directly (an upper
                 bound on what such a kernel could save, since it would still dequantize)

Slots of the prefix are a random permutation of the pool (a long-running server's free list) or
contiguous (a fresh one); both are timed. Needs torch + triton; FlashInfer optional (the staged
SGLang runtime provides it). Writes $OUT/gather_kernel_<device>.json.

    python benchmark/bench_gather.py [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_write import bench, copy_gbps, git_commit, write_json  # noqa: E402

MODELS = {
    "Qwen3-8B": dict(q_heads=32, kv_heads=8, head_dim=128, layers=36, group=128),
    "SmolLM2-135M": dict(q_heads=9, kv_heads=3, head_dim=64, layers=30, group=64),
}
SINK, WINDOW = 64, 256


def gather_bytes(p: int, h: int, d: int, gk: int, gv: int) -> int:
    """What one gather call must move for a P-token prefix (both K and V)."""
    return (2 * p * h * d // 4  # INT2 codes
            + p * h * (d // gk + d // gv) * 2 * 2  # (scale, min) bf16
            + 2 * p * h * d * 2  # BF16 rows written
            + p * 4)  # req_to_token


def make_cache(m: dict, p: int, shuffled: bool, device="cuda"):
    from sglang_oscar.kernels.layout import LayerCache

    h, d, g = m["kv_heads"], m["head_dim"], m["group"]
    num_slots = p + 1024
    cache = LayerCache.empty(num_slots, h, d, k_group=g, v_group=g, num_sink_rows=SINK, max_reqs=1, window=WINDOW,
                             sink=SINK, window_dtype=torch.bfloat16, device=device)
    cache.k_codes.random_(0, 256)
    cache.v_codes.random_(0, 256)
    for t in (cache.k_params, cache.v_params, cache.sink_k, cache.sink_v, cache.ring_k, cache.ring_v):
        t.normal_()
    slots = (torch.randperm(num_slots, device=device) if shuffled else torch.arange(num_slots, device=device))[:p]
    cache.sink_table[slots[:SINK].long()] = torch.arange(SINK, dtype=torch.int32, device=device)
    req_to_token = torch.zeros(1, p + 16, dtype=torch.int32, device=device)
    req_to_token[0, :p] = slots.int()
    return cache, req_to_token


def time_gather(m: dict, p: int, shuffled: bool, quick: bool, block_n: int = 64) -> tuple:
    from sglang_oscar.kernels.gather import oscar_gather_prefixes

    cache, r2t = make_cache(m, p, shuffled)
    h, d = m["kv_heads"], m["head_dim"]
    i32 = dict(dtype=torch.int32, device="cuda")
    rows, indptr, starts = torch.zeros(1, **i32), torch.tensor([0, p], **i32), torch.zeros(1, **i32)
    out_k = torch.empty(p, h, d, dtype=torch.bfloat16, device="cuda")
    out_v = torch.empty_like(out_k)

    def run():
        oscar_gather_prefixes(cache, r2t, rows, indptr, starts, out_k, out_v, block_n=block_n, validate=False)

    run()
    torch.cuda.synchronize()
    return bench(run, quick), out_k, out_v


def time_attention(m: dict, p: int, c: int, keys: torch.Tensor, vals: torch.Tensor, quick: bool):
    """FlashInfer's ragged prefill of c new tokens over p cached + c new keys (one layer)."""
    try:
        from sglang_oscar.srt.extend_attention import ExtendAttention
        att = ExtendAttention("flashinfer", "cuda")
    except Exception as e:  # no flashinfer in a bare torch image: report, do not guess
        return None, f"{type(e).__name__}: {str(e)[:160]}"
    hq, h, d = m["q_heads"], m["kv_heads"], m["head_dim"]
    q = torch.randn(c, hq, d, dtype=torch.bfloat16, device="cuda")
    k = torch.cat([keys, torch.randn(c, h, d, dtype=torch.bfloat16, device="cuda")])
    v = torch.cat([vals, torch.randn(c, h, d, dtype=torch.bfloat16, device="cuda")])
    att.plan([c], [p + c], hq, h, d, torch.bfloat16, d ** -0.5)
    out = torch.empty_like(q)
    return bench(lambda: att.run(q, k, v, out=out), quick), None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="32k only, short timing")
    ap.add_argument("--out", default=os.environ.get("OUT", "./bench_out"))
    ap.add_argument("--block-n", default="64", help="comma-separated BLOCK_N values of the gather (first = default row)")
    ap.add_argument("--no-attention", action="store_true", help="skip the FlashInfer side")
    args = ap.parse_args()
    block_ns = [int(x) for x in args.block_n.split(",") if x]
    if not torch.cuda.is_available():
        print("bench_gather.py needs a CUDA device; nothing to do")
        return
    dev_name = torch.cuda.get_device_name()
    import triton

    meta = dict(device=dev_name, torch=torch.__version__, triton=triton.__version__, commit=git_commit(),
                date=time.strftime("%Y-%m-%d %H:%M"))
    try:
        import flashinfer
        meta["flashinfer"] = flashinfer.__version__
    except ImportError:
        meta["flashinfer"] = None
    d2d = copy_gbps(args.quick)
    print(f"{dev_name}: D2D copy {d2d:.0f} GB/s (read+write)")
    rows = [dict(meta, kind="reference", d2d_copy_gbps=d2d)]
    prefixes = [32768] if args.quick else [8192, 32768, 100000]
    chunks = [8192] if args.quick else [8192, 512]
    for name, m in MODELS.items():
        h, d, g = m["kv_heads"], m["head_dim"], m["group"]
        for p in prefixes:
            for shuffled in (True, False):
                ms, keys, vals = time_gather(m, p, shuffled, args.quick, block_ns[0])
                sweep = {b: round(time_gather(m, p, shuffled, args.quick, b)[0], 4) for b in block_ns[1:]}
                nbytes = gather_bytes(p, h, d, g, g)
                gbps = nbytes / (ms * 1e-3) / 1e9
                row = dict(meta, kind="gather", model=name, prefix=p, slots="shuffled" if shuffled else "contiguous",
                           group=g, gather_ms=round(ms, 4), bytes=nbytes, gather_gbps=round(gbps, 1),
                           pct_of_copy=round(100 * gbps / d2d, 1), gather_ms_all_layers=round(ms * m["layers"], 3),
                           block_n=block_ns[0])
                if sweep:
                    row["gather_ms_by_block_n"] = sweep
                if shuffled and not args.no_attention:  # the attention does not depend on where the rows came from
                    for c in chunks:
                        att_ms, err = time_attention(m, p, c, keys, vals, args.quick)
                        key = f"chunk{c}"
                        if att_ms is None:
                            row[f"{key}_attn_error"] = err
                        else:
                            row[f"{key}_attn_ms"] = round(att_ms, 4)
                            row[f"{key}_gather_share_pct"] = round(100 * ms / (ms + att_ms), 1)
                rows.append(row)
                print({k: v for k, v in row.items() if k not in meta})
                del keys, vals
                torch.cuda.empty_cache()
    write_json(args.out, "gather_kernel", dev_name, rows)


if __name__ == "__main__":
    main()
