"""Benchmark of oscar_write_kv (kernels/write.py): one launch per layer call, K and V together.

Cases, for SmolLM2-135M (Hkv 3, D 64, 30 layers) and Qwen3-8B (Hkv 8, D 128, 36 layers) shapes:
  decode  batch 1/8/32/64, one token per request (ring row per token, no sink rows)
  prefill 8k and 100k tokens (sink rows for the first 64 positions, ring rows for the last 256)
Each row reports the median time of one layer call (triton.testing.do_bench), the bytes the
call must move, the achieved GB/s, and, for prefill, the write time of all layers next to an
estimate of the prefill itself: model FLOPs (dense GEMMs + causal attention) / a measured BF16
GEMM rate, an optimistic (short) estimate, so the ratio is an upper bound. Target: <= 10 %.
A device-to-device copy is timed in the same run as the bandwidth reference.

    python benchmark/bench_write.py            # full
    python benchmark/bench_write.py --quick    # a few cases
    python benchmark/bench_write.py --decode-only
Decode calls are timed as CUDA-graph replays (GPU time, as in the server's decode graphs; do_bench
would mostly time the host launch). Every call runs the kernel's default tiles and warps.
Writes $OUT/write_kernel_<device>.json (default ./bench_out). Needs torch + triton only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

MODELS = {
    # name: kv_heads, head_dim, layers, hidden, q_heads, intermediate, vocab
    "SmolLM2-135M": dict(kv_heads=3, head_dim=64, layers=30, hidden=576, q_heads=9, inter=1536, vocab=49152),
    "Qwen3-8B": dict(kv_heads=8, head_dim=128, layers=36, hidden=4096, q_heads=32, inter=12288, vocab=151936),
}
SINK, WINDOW = 64, 256


def git_commit() -> str:
    # The device machine's copy of the tree may carry other git metadata than the commit that ran:
    # the staging scripts pass the real one.
    if os.environ.get("OSCAR_COMMIT"):
        return os.environ["OSCAR_COMMIT"]
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.check_output(["git", "-C", here, "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


def device_tag(name: str) -> str:
    """The device name as a file-name part ("NVIDIA H100 80GB HBM3" -> "NVIDIA_H100_80GB_HBM3")."""
    return "".join(c if c.isalnum() else "_" for c in name)


def write_json(out_dir: str, stem: str, device: str, obj) -> str:
    """Write obj to OUT_DIR/<stem>_<device tag>.json (the results file of a benchmark run) and say where."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{stem}_{device_tag(device)}.json")
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
    print("wrote", path)
    return path


def prefill_flops(m: dict, n: int) -> float:
    """Dense GEMM FLOPs (q,k,v,o projections, SwiGLU MLP, LM head on the last token) + causal attention."""
    h, d, hq, hkv = m["hidden"], m["head_dim"], m["q_heads"], m["kv_heads"]
    per_layer_params = h * (hq * d) * 2 + h * (hkv * d) * 2 + 3 * h * m["inter"]
    dense = 2.0 * n * per_layer_params * m["layers"] + 2.0 * h * m["vocab"]
    attn = 2.0 * 2.0 * (n * n / 2) * hq * d * m["layers"]  # QK^T and PV, causal half
    return dense + attn


def bench(fn, quick: bool) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=10 if quick else 25, rep=30 if quick else 100, return_mode="median")  # ms


def bench_graph(fn, quick: bool) -> float:
    """GPU time of one call replayed from a CUDA graph (ms), as the server's decode graphs run it:
    without the host launch cost that dominates do_bench for microsecond kernels."""
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(fn, rep=30 if quick else 100, return_mode="median")


def gemm_tflops(quick: bool) -> float:
    n = 4096 if quick else 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = bench(lambda: a @ b, quick)
    return 2.0 * n**3 / (ms * 1e-3) / 1e12


def copy_gbps(quick: bool) -> float:
    nbytes = (256 if quick else 1024) * 2**20
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src), quick)
    return 2.0 * nbytes / (ms * 1e-3) / 1e9


def make_inputs(m: dict, tokens: int, decode: bool, *, gk: int, gv: int, v_absorbed: bool, seed: int = 0, device="cuda"):
    from sglang_oscar.kernels.layout import LayerCache

    torch.manual_seed(seed)
    h, d = m["kv_heads"], m["head_dim"]
    batch = tokens if decode else 1
    num_slots = tokens + 64
    cache = LayerCache.empty(num_slots, h, d, k_group=gk, v_group=gv, num_sink_rows=SINK * batch, max_reqs=batch,
                             window=WINDOW, sink=SINK, window_dtype=torch.bfloat16, device=device)
    for t in cache.buffers().values():
        t.zero_()
    k = torch.randn(tokens, h, d, device=device, dtype=torch.bfloat16)
    v = torch.randn(tokens, h, d, device=device, dtype=torch.bfloat16)
    slots = torch.randperm(num_slots, device=device)[:tokens].contiguous()
    pos = torch.arange(tokens, device=device)
    if decode:  # request r at position 1000 + r: ring row only
        sink_dst = torch.full((tokens,), -1, dtype=torch.int32, device=device)
        ring_dst = (pos * WINDOW + (1000 + pos) % WINDOW).int()
    else:
        sink_dst = torch.where(pos < SINK, pos, -1).int()
        ring_dst = torch.where(pos >= tokens - WINDOW, pos % WINDOW, -1).int()
    q, _ = torch.linalg.qr(torch.randn(d, d, device=device))
    kw = dict(k_transform=q.contiguous(), k_mean=torch.randn(d, device=device),
              v_transform=None if v_absorbed else torch.linalg.qr(torch.randn(d, d, device=device))[0].contiguous(),
              k_clip=0.96, v_clip=1.0)
    window_rows = int((sink_dst >= 0).sum() + (ring_dst >= 0).sum())  # one host sync, outside the timing
    nbytes = (
        2 * tokens * h * d * 2  # read k, v (bf16)
        + 2 * tokens * h * d // 4  # write codes
        + tokens * h * (d // gk + d // gv) * 2 * 2  # write (scale, min) bf16
        + 2 * window_rows * h * d * 2  # write window rows K and V (bf16)
        + tokens * (8 + 4 + 4)  # slots, sink_dst, ring_dst
        + d * d * 4 * (1 if v_absorbed else 2) + d * 4  # transforms, mean
    )
    return (k, v, slots, sink_dst, ring_dst, cache), kw, nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="few cases, short timing")
    ap.add_argument("--out", default=os.environ.get("OUT", "./bench_out"))
    ap.add_argument("--decode-only", action="store_true", help="only the decode cases (one token per request)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_write.py needs a CUDA device; nothing to do")
        return
    import triton

    from sglang_oscar.kernels.write import default_block_t, oscar_write_kv

    dev_name = torch.cuda.get_device_name()
    meta = dict(device=dev_name, torch=torch.__version__, triton=triton.__version__, git_commit=git_commit(),
                date=time.strftime("%Y-%m-%dT%H:%M:%S"))
    tflops = gemm_tflops(args.quick)
    d2d = copy_gbps(args.quick)
    print(f"{dev_name}: bf16 GEMM {tflops:.0f} TFLOP/s, D2D copy {d2d:.0f} GB/s (read+write)")
    rows = [dict(meta, kind="reference", bf16_gemm_tflops=tflops, d2d_copy_gbps=d2d)]

    decode_batches = [1, 64] if args.quick else [1, 8, 32, 64]
    prefill_tokens = [] if args.decode_only else [8192] if args.quick else [8192, 100_000]
    for model, m in MODELS.items():
        cases = [("decode", b) for b in decode_batches] + [("prefill", n) for n in prefill_tokens]
        for kind, tokens in cases:
            for v_absorbed in (False, True):
                inputs, kw, nbytes = make_inputs(m, tokens, kind == "decode", gk=64, gv=64, v_absorbed=v_absorbed)
                oscar_write_kv(*inputs, **kw)  # compile + check it runs
                torch.cuda.synchronize()
                call = lambda: oscar_write_kv(*inputs, **kw, validate=False)  # noqa: E731
                # decode: GPU time from a CUDA-graph replay (what a decode step pays); prefill: do_bench
                ms = bench_graph(call, args.quick) if kind == "decode" else bench(call, args.quick)
                row = dict(meta, kind=kind, model=model, tokens=tokens, kv_heads=m["kv_heads"], head_dim=m["head_dim"],
                           layers=m["layers"], k_group=64, v_group=64, k_clip=0.96, v_absorbed=v_absorbed,
                           timing="cuda_graph" if kind == "decode" else "do_bench",
                           block_t=default_block_t(tokens, m["head_dim"]), layer_call_us=ms * 1e3, bytes_moved=nbytes,
                           gbps=nbytes / (ms * 1e-3) / 1e9, frac_of_d2d=nbytes / (ms * 1e-3) / 1e9 / d2d)
                if kind == "prefill":
                    est_s = prefill_flops(m, tokens) / (tflops * 1e12)
                    row.update(all_layers_ms=ms * m["layers"], prefill_estimate_ms=est_s * 1e3,
                               write_over_prefill=ms * m["layers"] * 1e-3 / est_s)
                rows.append(row)
                extra = f"  all layers {row['all_layers_ms']:.2f} ms = {100 * row['write_over_prefill']:.2f}% of est. prefill {row['prefill_estimate_ms']:.0f} ms" if kind == "prefill" else ""
                print(f"{model:13s} {kind:7s} T={tokens:6d} v_abs={int(v_absorbed)} "
                      f"{ms * 1e3:9.1f} us  {row['gbps']:7.1f} GB/s{extra}")
                del inputs
                torch.cuda.empty_cache()

    write_json(args.out, "write_kernel", dev_name, rows)


if __name__ == "__main__":
    main()
