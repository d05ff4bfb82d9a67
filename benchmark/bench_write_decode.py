"""One layer of a decode step on CUDA: the KV write of the step's tokens and the decode attention, together, as a
served step runs them. OSCAR against SGLang's BF16 / FP8 path, same shapes, same run.

Why a chain: oscar_decode(follows_write=True) launches the CUDA history kernel as the write's programmatic
dependent (kernels/cuda/int2_history.cu kPdlAfterWrite), so its history CTAs stream the old INT2 rows while the write
runs. That gain exists only beside the write, so it is measured with the write, against FlashInfer with its own
write and PDL.

Impls (per layer call; each also timed without its decode, "<impl>:write", so that the decode's share of the chain,
chain - write, is reported):
  oscar_cuda             q transform (bf16 GEMM, as srt/backend.py) + oscar_write_kv + oscar_decode(history_kernel=
                         "cuda"), pool pages of 64, plain launches
  oscar_cuda_after_write the same kernels, the history kernel as the write's programmatic dependent: the write
                         triggers its dependents at once (follows_write)
  oscar_cuda_fused_q     q rotated by the write's own launch (oscar_write_kv q_out) instead of the GEMM, plain
  oscar_cuda_fused_q_after_write  both: the server's decode at small batch on sm_90+ before the CUDA write; the
                         history CTAs issue their first copies, then wait for the write's q (q_from_write)
  oscar_cuda_write_fused_q_after_write  the same with the CUDA write (oscar_write_kv kernel="cuda",
                         kernels/write_cuda.py): the server's decode at batch <= 32 with SGLANG_OSCAR_HISTORY_KERNEL=cuda
                         (srt/backend.py CUDA_DECODE_WRITE); any impl with "cuda_write" in its name uses it
  flashinfer_bf16        SGLang's write (store_cache, its JIT kernel, PDL-enabled as SGLang builds it) + FlashInfer
                         BF16 paged decode (tensor cores, enable_pdl=True where the API takes it), pages of 16
  flashinfer_fp8         the BF16 -> FP8 casts of SGLang's set_kv_buffer + store_cache + FlashInfer FP8 decode
V is absorbed into the weights (the default for Qwen3), so the write has no V rotation and the output no un-rotation.

Rows {impl, model, context, batch, ms, write_ms, decode_share_ms, bytes, gbps, pct_copy_bw, config} plus device,
versions and commit -> $OUT/decode_step_layer_<device>.json.

    python benchmark/bench_write_decode.py --models qwen3-8b --contexts 32768,65536,131072 --batches 1,8,32
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
from sglang_oscar.kernels.decode import oscar_decode, transform_query  # noqa: E402
from sglang_oscar.kernels.write import oscar_write_kv  # noqa: E402
from bench_decode import (MEM_CAP, MODELS, SINK, WINDOW, bench, copy_bandwidth, fi_bytes, flashinfer_fns,  # noqa: E402
                          make_oscar, n_copies, oscar_bytes, versions)
from bench_write import device_tag, write_json  # noqa: E402

OSCAR_PAGE, FI_PAGE = 64, 16
CLIP = 0.95  # K and V clip ratios of the write (a fitted bundle's are of this order)


def oscar_chain_fns(b, hq, hkv, d, ctx, copies, after_write, fuse_q, write_kernel="triton"):
    """Per copy: q's transform (a GEMM, or in the write's launch with fuse_q), the write of one token per request
    (position ctx - 1, a ring row; write_kernel: oscar_write_kv's kernel) and the decode; and the same without the
    decode. Returns (chains, writes, keep)."""
    cache, r2t, seq, ring_start = make_oscar(b, hkv, d, ctx, copies, page=OSCAR_PAGE)
    g = torch.Generator(device="cuda").manual_seed(0)
    rot = torch.linalg.qr(torch.randn(hkv, d, d, generator=g, device="cuda"))[0].contiguous()
    t_q = rot.to(torch.bfloat16)  # the server keeps a bf16 copy of T_q (one GEMM, transform_query)
    q_raw = torch.randn(b, hq, d, generator=g, device="cuda").to(torch.bfloat16)
    k_new = torch.randn(b, hkv, d, generator=g, device="cuda").to(torch.bfloat16)
    v_new = torch.randn_like(k_new)
    out = torch.empty_like(q_raw)
    q_out = torch.empty_like(q_raw)
    q_kw = dict(q=q_raw, q_transform=t_q, q_out=q_out) if fuse_q else {}
    sink_dst = torch.full((b,), -1, dtype=torch.int32, device="cuda")
    chains, writes = [], []
    for c in range(copies):
        reqs = torch.arange(c * b, (c + 1) * b, device="cuda")
        slots = r2t[reqs, ctx - 1].long()
        ring_dst = (reqs * WINDOW + (ctx - 1) % WINDOW).int()
        idx = reqs.int()

        def write(slots=slots, ring_dst=ring_dst):
            oscar_write_kv(k_new, v_new, slots, sink_dst, ring_dst, cache, k_transform=rot, k_clip=CLIP, v_clip=CLIP,
                           validate=False, pdl_trigger=after_write, kernel=write_kernel, **q_kw)

        def chain(idx=idx, write=write):
            q = q_out if fuse_q else transform_query(q_raw, t_q, hkv)  # before the write, as srt/backend.py does
            write()
            oscar_decode(q, cache, r2t, idx, seq, ring_start, sink=SINK, window=WINDOW, sm_scale=1 / math.sqrt(d),
                         out=out, history_kernel="cuda", follows_write=after_write,
                         q_from_write=after_write and fuse_q, write_kernel=write_kernel)

        chains.append(chain)
        writes.append(write)
    return chains, writes, (cache, r2t)


def flashinfer_chain_fns(b, hq, hkv, d, ctx, copies, fp8):
    """Per copy: SGLang's MHA set_kv_buffer of one token per request (the last position of its last page) and the
    FlashInfer decode (flashinfer_fns' wrappers). Returns (chains, writes, keep, write_kernel)."""
    kv_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    q = torch.randn(b, hq, d, device="cuda").to(torch.bfloat16)
    decodes, (kc, vc) = flashinfer_fns(q, b, hq, hkv, d, ctx, kv_dtype, FI_PAGE, copies, enable_pdl=True)
    pages_per = ctx // FI_PAGE
    row = hkv * d
    k_rows, v_rows = (x.view(torch.uint8 if fp8 else x.dtype).view(-1, row) for x in (kc, vc))
    k_new = torch.randn(b, hkv, d, device="cuda").to(torch.bfloat16)
    v_new = torch.randn_like(k_new)
    row_bytes = row * (1 if fp8 else 2)
    try:
        from sglang.kernels.ops.kvcache.kvcache import can_use_store_cache, store_cache
        use_store = can_use_store_cache(row_bytes)
    except Exception as e:  # noqa: BLE001
        print("  store_cache unavailable:", type(e).__name__, str(e)[:200], flush=True)
        use_store = False

    def store(k, v, loc):
        if fp8:  # set_kv_buffer: cache_k.to(dtype), then viewed as the store dtype
            k, v = k.to(kv_dtype).view(torch.uint8), v.to(kv_dtype).view(torch.uint8)
        if use_store:
            store_cache(k.view(-1, row), v.view(-1, row), k_rows, v_rows, loc, row_bytes=row_bytes,
                        v_row_bytes=row_bytes, size_limit=k_rows.shape[0])
        else:
            k_rows.index_copy_(0, loc, k.reshape(-1, row))
            v_rows.index_copy_(0, loc, v.reshape(-1, row))

    chains, writes = [], []
    for c, dec in enumerate(decodes):
        first_page = c * b * pages_per + torch.arange(b, device="cuda") * pages_per
        loc = (first_page + pages_per - 1) * FI_PAGE + FI_PAGE - 1  # each request's last position
        writes.append(lambda loc=loc: store(k_new, v_new, loc))
        chains.append(lambda loc=loc, dec=dec: (store(k_new, v_new, loc), dec()))
    return chains, writes, (kc, vc), "store_cache" if use_store else "index_copy_"


def plot(res, path):
    """Chain per layer (us, log) against batch: one row of panels per model, one panel per context (several models
    in one panel mixed their points under the first model's title)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    models = list(dict.fromkeys(r["model"] for r in rows))
    ctxs = sorted({r["context"] for r in rows})
    fig, axes = plt.subplots(len(models), len(ctxs), figsize=(5 * len(ctxs), 4 * len(models)), squeeze=False)
    for axrow, model in zip(axes, models):
        for ax, ctx in zip(axrow, ctxs):
            for impl in dict.fromkeys(r["impl"] for r in rows):
                pts = sorted((r["batch"], 1e3 * r["ms"]) for r in rows
                             if r["impl"] == impl and r["context"] == ctx and r["model"] == model)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=impl, linestyle="--" if impl.startswith("flash") else "-")
            ax.set(xscale="log", yscale="log", xlabel="batch", ylabel="write + decode per layer (us)",
                   title=f"{model}, context {ctx // 1024}k")
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{res['device']}, {res['versions'].get('git_commit', '')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print("wrote", path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--models", default="qwen3-8b")
    ap.add_argument("--contexts", default="32768,65536,131072")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--impls", default="oscar_cuda,oscar_cuda_after_write,oscar_cuda_fused_q,"
                    "oscar_cuda_fused_q_after_write,oscar_cuda_write_fused_q_after_write,flashinfer_bf16,flashinfer_fp8")
    ap.add_argument("--reference", default="oscar_cuda_write_fused_q_after_write",
                    help="the impl the summary's ratios divide by")
    ap.add_argument("--plot-from", default="", help="a results JSON of this script: write its PNG next to --out "
                    "and exit (no GPU needed)")
    args = ap.parse_args()
    if args.plot_from:
        res = json.load(open(args.plot_from))
        plot(res, os.path.join(args.out, f"decode_step_layer_{device_tag(res['device'])}.png"))
        return
    dev = torch.cuda.get_device_name()
    t0 = time.time()
    copy_bw = copy_bandwidth()
    print(f"device {dev}, copy bandwidth {copy_bw / 1e9:.0f} GB/s", flush=True)
    rows = []
    for model in args.models.split(","):
        hq, hkv, d = MODELS[model]
        for ctx in (int(x) for x in args.contexts.split(",")):
            for b in (int(x) for x in args.batches.split(",")):
                for impl in args.impls.split(","):
                    try:
                        if impl.startswith("oscar"):
                            nbytes = oscar_bytes(b, hq, hkv, d, ctx)
                            if nbytes > MEM_CAP:
                                continue
                            copies = n_copies(nbytes)
                            fuse_q = "fused_q" in impl
                            wk = "cuda" if "cuda_write" in impl else "triton"
                            chains, writes, keep = oscar_chain_fns(b, hq, hkv, d, ctx, copies,
                                                                   after_write=impl.endswith("after_write"),
                                                                   fuse_q=fuse_q, write_kernel=wk)
                            cfg = f"page{OSCAR_PAGE}:cuda" + (":q_in_write" if fuse_q else ":q_gemm") + \
                                (":follows_write" if "after_write" in impl else "") + f":{wk}_write"
                        else:
                            fp8 = impl.endswith("fp8")
                            nbytes = fi_bytes(b, hq, hkv, d, ctx, 1 if fp8 else 2, FI_PAGE)
                            if nbytes > MEM_CAP:
                                continue
                            copies = n_copies(nbytes)
                            chains, writes, keep, wk = flashinfer_chain_fns(b, hq, hkv, d, ctx, copies, fp8)
                            cfg = f"page{FI_PAGE},tc,pdl:{wk}"
                        ms = bench(chains)
                        write_ms = bench(writes)
                        del chains, writes, keep
                    except Exception as e:  # noqa: BLE001
                        print(f"{impl} {model} ctx={ctx} b={b}: FAILED {type(e).__name__}: {str(e)[:300]}",
                              flush=True)
                        continue
                    torch.cuda.empty_cache()
                    gbps = nbytes / (ms * 1e-3) / 1e9
                    r = dict(impl=impl, model=model, context=ctx, batch=b, head_dim=d, q_heads=hq, kv_heads=hkv,
                             ms=ms, write_ms=write_ms, decode_share_ms=ms - write_ms, bytes=nbytes, gbps=gbps,
                             pct_copy_bw=100 * gbps * 1e9 / copy_bw, config=cfg)
                    rows.append(r)
                    print(f"{impl:24s} {model:9s} ctx={ctx:6d} b={b:3d}  chain {1e3 * ms:8.2f} us  write "
                          f"{1e3 * write_ms:6.2f} us  {r['pct_copy_bw']:5.1f}% copy", flush=True)
    res = dict(device=dev, copy_bandwidth_gbps=copy_bw / 1e9, versions=versions(), sink=SINK, window=WINDOW,
               clip=CLIP, rows=rows, wall_s=time.time() - t0)
    write_json(args.out, "decode_step_layer", dev, res)
    try:
        plot(res, os.path.join(args.out, f"decode_step_layer_{device_tag(dev)}.png"))
    except Exception as e:  # noqa: BLE001
        print("plot failed:", e)
    print(f"\nchain per layer (us) and x for {args.reference}")
    key = {(r["impl"], r["model"], r["context"], r["batch"]): r for r in rows}
    for (impl, model, ctx, b), r in key.items():
        ours = key.get((args.reference, model, ctx, b))
        ratio = f"{r['ms'] / ours['ms']:.2f}x" if ours else "-"
        print(f"{impl:24s} {model:9s} {ctx:6d} {b:3d} {1e3 * r['ms']:9.2f} {ratio}")


if __name__ == "__main__":
    main()
