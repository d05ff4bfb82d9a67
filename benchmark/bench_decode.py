"""Decode attention per layer-call on CUDA: OSCAR mixed INT2/BF16 vs FlashInfer BF16 / FP8 and
SGLang's Triton BF16 decode kernel, same shapes, same run.

Rows {impl, model, context, batch, head_dim, ms, bytes, gbps, pct_copy_bw} plus device, versions
and git commit → $OUT/decode_kernel_<device>.json, and a PNG plot. Bytes are what each kernel must
read (+ write q/o): KV payload, params, window rows and the int32 token indices. The impl
read_same_bytes is a streaming read of exactly the bytes of the oscar call at each point
(read_fns below) and copy_same_traffic a plain device copy moving them: the share of
copy bandwidth that a kernel of that size reaches at all (launch, ramp-up and tail included).
The oscar impls run oscar_decode's defaults, i.e. what the server runs.

    python benchmark/bench_decode.py [--out DIR] [--models ...] [--contexts ...] [--batches ...] [--impls ...]
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
from sglang_oscar.kernels.decode import _num_sms, oscar_decode  # noqa: E402
from sglang_oscar.kernels.layout import LayerCache  # noqa: E402
from bench_write import device_tag, git_commit, write_json  # noqa: E402  (benchmark/, next to this script)

# layer shapes per GPU (q heads, KV heads, head_dim); the default table runs the first two. qwen3-32b: GQA 8
# (the unfolded kernel, NP = 8); qwen3-14b: GQA 5; glm-4.7-tp8 / -tp4: 96 q / 8 KV heads split over 8 / 4 GPUs, GQA 12
# (NP = 16)
MODELS = {"qwen3-8b": (32, 8, 128), "smollm2": (9, 3, 64), "qwen3-32b": (64, 8, 128), "glm-4.7-tp8": (12, 1, 128),
          "glm-4.7-tp4": (24, 2, 128), "qwen3-14b": (40, 8, 128)}
SINK, WINDOW, GK, GV = 64, 256, 64, 64
L2_BYTES = 50 * 2**20
MEM_CAP = 24 * 2**30  # per implementation's KV buffers


def copy_bandwidth():
    x = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=50, rep=300, return_mode="median")
    return 2 * x.numel() / (ms * 1e-3)


def n_copies(bytes_one):
    return max(1, min(8, math.ceil(4 * L2_BYTES / max(bytes_one, 1))))


# Calls per timed graph replay, at least: do_bench's per-replay cost (the graph's launch, and the write-back
# of the 256 MB L2 flush it runs between replays) lands on the replay's first call. With one call per replay
# it added ~9 us per call on H100 (Qwen3 64k batch 8: 185.5 us per call vs 176.2 us from the first kernel's
# start to the merge's end in a profiler trace); a served decode step replays one graph for all layers.
MIN_CALLS_PER_REPLAY = 8


def capture_graph(fns):
    """A CUDA graph of the calls fns (already compiled), after one warm-up run on a side stream."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    return g


def bench(fns, graph=True, min_calls=MIN_CALLS_PER_REPLAY):
    """Median ms of one call, rotating over the copies in fns (a whole number of rounds, >= min_calls calls
    per replay, so that a copy is read again only after all the others). The calls are captured in a CUDA
    graph (as SGLang runs decode), so host-side launch overhead does not count."""
    fns = list(fns) * max(1, -(-min_calls // max(len(fns), 1)))

    def run_all():
        for f in fns:
            f()
    run_all()  # compile / plan outside the capture
    torch.cuda.synchronize()
    if graph:
        try:
            ms = triton.testing.do_bench(capture_graph(fns).replay, warmup=30, rep=200, return_mode="median")
            return ms / len(fns)
        except Exception as e:  # noqa: BLE001
            print("  graph capture failed, timing eagerly:", type(e).__name__, str(e)[:120], flush=True)
            torch.cuda.synchronize()
    ms = triton.testing.do_bench(run_all, warmup=30, rep=200, return_mode="median")
    return ms / len(fns)


# ------------------------------------------------------------------------------------ OSCAR


def oscar_bytes(b, hq, hkv, d, ctx, k_bits=2):
    hist = max(ctx - SINK - WINDOW, 0)
    # K+V codes (+ the high key planes of an INT4-key layer), float8 (scale, min)
    per_tok_head = (2 + (k_bits == 4)) * (d // 4) + (d // GK) * 2 + (d // GV) * 2
    win = min(ctx, SINK + WINDOW) * d * 2 * 2
    idx = ctx * 4 + SINK * 4  # req_to_token + sink table
    return b * (hkv * (hist * per_tok_head + win) + idx) + 2 * b * hq * d * 2


def make_oscar(b, hkv, d, ctx, copies, page=1, k_bits=2, shuffled=False):
    """A pool of `copies` batches of b requests of ctx tokens; shuffled: the pool's pages in a random order (a served
    pool after requests came and went) instead of each request's slots contiguous."""
    tokens = b * ctx
    cache = LayerCache.empty(tokens * copies, hkv, d, k_group=GK, v_group=GV, num_sink_rows=b * SINK * copies,
                             max_reqs=b * copies, window=WINDOW, sink=SINK, device="cuda", page=page, k_bits=k_bits)
    for t in (cache.k_codes, cache.v_codes) + ((cache.k_hi,) if k_bits == 4 else ()):
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, device="cuda"))
    for p in (cache.k_params, cache.v_params):
        p[..., 0].copy_(torch.rand(p.shape[:-1], device="cuda") * 0.3 + 0.05)
        p[..., 1].copy_(-torch.rand(p.shape[:-1], device="cuda"))
    for t in (cache.sink_k, cache.sink_v, cache.ring_k, cache.ring_v):
        t.normal_()
    # every request: contiguous slots (the page order does not change the bytes read), or its pages shuffled over
    # the whole pool
    r2t = torch.arange(tokens * copies, dtype=torch.int32, device="cuda").view(b * copies, ctx)
    if shuffled:
        n_pages = -(-tokens * copies // page)
        perm = torch.randperm(n_pages, generator=torch.Generator().manual_seed(0)).to("cuda", torch.int32)
        r2t = perm[r2t // page] * page + r2t % page
    cache.sink_table.copy_(-1 * torch.ones_like(cache.sink_table))
    cache.sink_table.view(b * copies, ctx)[:, :SINK] = torch.arange(b * copies * SINK, dtype=torch.int32,
                                                                     device="cuda").view(b * copies, SINK)
    seq = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
    ring_start = torch.zeros(b * copies, dtype=torch.int32, device="cuda")
    return cache, r2t, seq, ring_start


def oscar_fns(q, cache, r2t, seq, ring_start, b, copies, d, decode=oscar_decode, **kw):
    fns = []
    out = torch.empty_like(q)
    for c in range(copies):
        idx = torch.arange(c * b, (c + 1) * b, dtype=torch.int32, device="cuda")
        fns.append(lambda idx=idx: decode(q, cache, r2t, idx, seq, ring_start, sink=SINK, window=WINDOW,
                                          sm_scale=1 / math.sqrt(d), out=out, **kw))
    return fns


# ------------------------------------------------------------------------- read of the same bytes
# A read-only streaming kernel: the share of copy bandwidth that merely reading N bytes reaches (impl
# read_same_bytes, the ceiling of each point: at batch 1 launch, ramp-up and tail dominate, so no kernel of those
# bytes reaches the bandwidth of a 1 GiB copy). Each program reads a contiguous range of int32 words in 16 KB
# blocks (16-byte loads) and folds them with XOR into one stored word, so the loads cannot be optimised away.

READ_BLOCK = 4096  # int32 words per iteration (16 KB)
READ_PROGRAMS_PER_SM = 8


@triton.jit
def _read_words(X, OUT, META, ITERS: tl.constexpr, BLOCK: tl.constexpr):
    # ITERS blocks per program (a constexpr: one compile per size, fine for a benchmark); META = [n]
    n = tl.load(META)
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.int32)
    offs = tl.arange(0, BLOCK)
    for i in range(ITERS):
        idx = (pid * ITERS + i) * BLOCK + offs
        acc ^= tl.load(X + idx, mask=idx < n, other=0)
    tl.store(OUT + pid, tl.xor_sum(acc, 0))


def read_plan(n: int, sms: int):
    """(programs, blocks per program, meta) for n words: up to READ_PROGRAMS_PER_SM programs per SM."""
    blocks = triton.cdiv(n, READ_BLOCK)
    programs = min(sms * READ_PROGRAMS_PER_SM, max(1, blocks))
    iters = triton.cdiv(blocks, programs)
    return triton.cdiv(blocks, iters), iters, torch.tensor([n], dtype=torch.int32)


def read_all(x: torch.Tensor, out: torch.Tensor, sms: int, plan=None) -> torch.Tensor:
    """XOR of each program's range of the int32 words of x into out[program]; returns those words."""
    programs, iters, meta = plan or read_plan(x.numel(), sms)
    _read_words[(programs,)](x, out, meta.to(x.device), ITERS=iters, BLOCK=READ_BLOCK, num_warps=8)
    return out[:programs]


def read_fns(nbytes: int, copies: int, sms: int):
    """One read of nbytes per copy (rotated to defeat L2), as callables for bench."""
    words = max(nbytes // 4, 1)
    programs, iters, meta = read_plan(words, sms)
    plan = (programs, iters, meta.cuda())  # on the device before the graph capture
    bufs = [(torch.ones(words, dtype=torch.int32, device="cuda"),
             torch.empty(sms * READ_PROGRAMS_PER_SM, dtype=torch.int32, device="cuda")) for _ in range(copies)]
    return [lambda x=x, o=o: read_all(x, o, sms, plan) for x, o in bufs], (bufs, plan)


# ------------------------------------------------------------------------------- FlashInfer


def copy_fns(nbytes, copies):
    """A device-to-device copy that moves nbytes (nbytes/2 read + nbytes/2 written), one per copy: the
    same traffic as one oscar call, so its pct_copy_bw is what a plain copy reaches at this size (launch,
    ramp-up and tail included), the ceiling a kernel of these bytes can be held to."""
    half = max(nbytes // 2, 1)
    bufs = [(torch.empty(half, dtype=torch.uint8, device="cuda"), torch.empty(half, dtype=torch.uint8, device="cuda"))
            for _ in range(copies)]
    return [lambda s=s, d=d: d.copy_(s) for s, d in bufs], bufs


def flashinfer_fns(q, b, hq, hkv, d, ctx, kv_dtype, page, copies, enable_pdl=False):
    """FlashInfer paged decode over `copies` caches; enable_pdl: run(..., enable_pdl=True) where the installed
    FlashInfer takes it (bench_write_decode.py: after a PDL-enabled write)."""
    import inspect

    import flashinfer

    pages_per = ctx // page
    npages = b * pages_per * copies
    shape = (npages, page, hkv, d)
    k = torch.empty(shape, dtype=torch.bfloat16, device="cuda").normal_().to(kv_dtype)
    v = torch.empty(shape, dtype=torch.bfloat16, device="cuda").normal_().to(kv_dtype)
    fns = []
    for c in range(copies):
        ws = torch.empty(128 * 2**20, dtype=torch.uint8, device="cuda")
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
        indptr = torch.arange(b + 1, dtype=torch.int32, device="cuda") * pages_per
        indices = torch.arange(c * b * pages_per, (c + 1) * b * pages_per, dtype=torch.int32, device="cuda")
        last = torch.full((b,), page, dtype=torch.int32, device="cuda")
        w.plan(indptr, indices, last, hq, hkv, d, page, q_data_type=torch.bfloat16, kv_data_type=kv_dtype,
               sm_scale=1 / math.sqrt(d))
        kw = dict(k_scale=1.0, v_scale=1.0) if kv_dtype != torch.bfloat16 else {}
        if enable_pdl and "enable_pdl" in inspect.signature(w.run).parameters:
            kw["enable_pdl"] = True
        fns.append(lambda w=w, kw=kw: w.run(q, (k, v), **kw))
    return fns, (k, v)


def fi_bytes(b, hq, hkv, d, ctx, elt, page):
    return b * (hkv * ctx * d * 2 * elt + (ctx // page) * 4) + 2 * b * hq * d * 2


# ------------------------------------------------------------------------------ SGLang Triton


def sglang_triton_fns(q, b, hq, hkv, d, ctx, copies):
    from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd

    k = torch.empty(b * ctx * copies, hkv, d, dtype=torch.bfloat16, device="cuda").normal_()
    v = torch.empty_like(k).normal_()
    max_splits = 16
    logits = torch.empty(b, hq, max_splits, d, dtype=torch.float32, device="cuda")
    lse = torch.empty(b, hq, max_splits, dtype=torch.float32, device="cuda")
    nsplit = torch.full((b,), max_splits, dtype=torch.int32, device="cuda")
    o = torch.empty_like(q)
    indptr = torch.arange(b + 1, dtype=torch.int32, device="cuda") * ctx
    fns = []
    for c in range(copies):
        indices = torch.arange(c * b * ctx, (c + 1) * b * ctx, dtype=torch.int32, device="cuda")
        fns.append(lambda indices=indices: decode_attention_fwd(q, k, v, o, indptr, indices, logits, lse, nsplit,
                                                                max_splits, 1 / math.sqrt(d), 1.0, 1.0))
    return fns, (k, v)


# ------------------------------------------------------------------------------------- main


IMPL_RE = re.compile(r"oscar(_cuda)?(_page\d+)?(_k4)?|read_same_bytes|copy_same_traffic|flashinfer_(bf16|fp8)|"
                     r"sglang_triton_bf16")


def correctness_check():
    """A small case against the float64 oracle (bf16 on GPU)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "test"))
    from test_decode import make_case
    from sglang_oscar.quant.attention import mixed_decode_reference

    errs = {}
    for gqa, d in ((4, 128), (3, 64)):
        case = make_case([3000, 777, 40], hkv=2, gqa=gqa, d=d, sink=SINK, window=WINDOW, ring_starts=[0, 700, 0])
        out = oscar_decode(**case)
        ref = mixed_decode_reference(**case)
        errs[f"gqa{gqa}_d{d}"] = float((out.double().cpu() - ref).norm() / ref.norm())
        case = make_case([3000, 777, 40], hkv=2, gqa=gqa, d=d, sink=SINK, window=WINDOW, ring_starts=[0, 700, 0],
                         pool_page=64)
        out = oscar_decode(**case)
        ref = mixed_decode_reference(**case)
        errs[f"gqa{gqa}_d{d}_page64"] = float((out.double().cpu() - ref).norm() / ref.norm())
    return errs


def versions():
    v = {"torch": torch.__version__, "triton": triton.__version__}
    for name in ("flashinfer", "sglang"):
        try:
            v[name] = __import__(name).__version__
        except Exception as e:  # noqa: BLE001
            v[name] = f"unavailable: {type(e).__name__}: {e}"[:200]
    v["git_commit"] = git_commit()  # OSCAR_COMMIT where set: the device copy's git metadata can be stale
    return v


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--contexts", default="8192,32768,65536,131072")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--models", default="qwen3-8b,smollm2")
    ap.add_argument("--impls", default="oscar_cuda_page64,oscar_page64,read_same_bytes,flashinfer_bf16,flashinfer_fp8,"
                    "sglang_triton_bf16", help="oscar: the Triton path on a pool of page 1; oscar_pageN: the same on "
                    "pages of N slots (kernels/records.py); oscar_cuda[_pageN]: the CUDA history stage "
                    "(kernels/history_cuda.py), what the server runs on Hopper (it picks pages of 64 itself); a _k4 suffix: a layer with INT4 keys (the served format's quarter of the layers); "
                    "read_same_bytes / copy_same_traffic: a streaming read of the bytes of one oscar "
                    "call (INT2 keys) / a copy moving them, the ceiling of that size")
    ap.add_argument("--copies", type=int, default=0, help="buffers each impl rotates over (default: enough to "
                    "defeat the L2; more spreads the reads over a served-size pool, up to the 24 GiB cap)")
    ap.add_argument("--page-order", default="contiguous", choices=("contiguous", "shuffled"),
                    help="oscar impls: each request's slots contiguous, or the pool's pages in a random order")
    ap.add_argument("--group", type=int, default=64, choices=(32, 64, 128),
                    help="K and V group size of the oscar impls (bytes and layout follow)")
    args = ap.parse_args()
    global GK, GV
    GK = GV = args.group
    dev = torch.cuda.get_device_name()
    t0 = time.time()
    copy_bw = copy_bandwidth()
    print(f"device {dev}, copy bandwidth {copy_bw / 1e9:.0f} GB/s", flush=True)
    errs = correctness_check()
    print("correctness (rel err vs float64 oracle):", errs, flush=True)
    rows = []
    impls = args.impls.split(",")
    unknown = [i for i in impls if not IMPL_RE.fullmatch(i)]
    if unknown:
        raise SystemExit(f"unknown impls {unknown} (see --help)")
    for model in args.models.split(","):
        hq, hkv, d = MODELS[model]
        for ctx in (int(x) for x in args.contexts.split(",")):
            for b in (int(x) for x in args.batches.split(",")):
                q = torch.randn(b, hq, d, dtype=torch.bfloat16, device="cuda")
                for impl in impls:
                    try:
                        k_bits = 4 if impl.endswith("_k4") else 2
                        if impl.startswith("oscar") or impl in ("read_same_bytes", "copy_same_traffic"):
                            nbytes = oscar_bytes(b, hq, hkv, d, ctx, k_bits)  # the ceilings: the INT2 call's bytes
                            if nbytes > MEM_CAP:
                                continue
                            copies = n_copies(nbytes)
                            if args.copies:
                                copies = max(1, min(args.copies, MEM_CAP // nbytes))
                        if impl.startswith("oscar"):
                            # oscar[_cuda][_pageN][_k4]: the Triton or the CUDA history on a pool in pages of N slots
                            page = int(impl.removesuffix("_k4").rsplit("page", 1)[1]) if "page" in impl else 1
                            kernel = "cuda" if impl.startswith("oscar_cuda") else "triton"
                            shuffled = args.page_order == "shuffled"
                            cache, r2t, seq, rs = make_oscar(b, hkv, d, ctx, copies, page=page, k_bits=k_bits,
                                                             shuffled=shuffled)
                            ms = bench(oscar_fns(q, cache, r2t, seq, rs, b, copies, d, history_kernel=kernel))
                            cfg = f"{kernel}:page{page}:k{k_bits}" + (":shuffled" if shuffled else "")
                            del cache, r2t
                        elif impl == "read_same_bytes":
                            fns, keep = read_fns(nbytes, copies, _num_sms(q.device))
                            ms, cfg = bench(fns), "read_all"
                            del fns, keep
                        elif impl == "copy_same_traffic":
                            fns, keep = copy_fns(nbytes, copies)
                            ms, cfg = bench(fns), "torch copy_"
                            del fns, keep
                        elif impl.startswith("flashinfer"):
                            fp8 = impl.endswith("fp8")
                            elt = 1 if fp8 else 2
                            page = 16
                            nbytes = fi_bytes(b, hq, hkv, d, ctx, elt, page)
                            if nbytes > MEM_CAP:
                                continue
                            copies = n_copies(nbytes)
                            fns, keep = flashinfer_fns(q, b, hq, hkv, d, ctx,
                                                       torch.float8_e4m3fn if fp8 else torch.bfloat16, page, copies)
                            ms, cfg = bench(fns), f"page{page},tc"
                            del fns, keep
                        elif impl == "sglang_triton_bf16":
                            nbytes = fi_bytes(b, hq, hkv, d, ctx, 2, 1)
                            if nbytes > MEM_CAP or b * ctx * hkv * d >= 2**31:
                                continue  # its int32 offsets overflow past 2^31 elements (illegal address seen)
                            copies = n_copies(nbytes)
                            fns, keep = sglang_triton_fns(q, b, hq, hkv, d, ctx, copies)
                            ms, cfg = bench(fns), "splits16"
                            del fns, keep
                        else:
                            raise AssertionError(impl)  # IMPL_RE admits no other name
                    except Exception as e:  # noqa: BLE001
                        print(f"{impl} {model} ctx={ctx} b={b}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                        continue
                    torch.cuda.empty_cache()
                    gbps = nbytes / (ms * 1e-3) / 1e9
                    row = dict(impl=impl, model=model, context=ctx, batch=b, head_dim=d, q_heads=hq, kv_heads=hkv,
                               ms=ms, bytes=nbytes, gbps=gbps, pct_copy_bw=100 * gbps * 1e9 / copy_bw, config=cfg,
                               copies=copies)
                    rows.append(row)
                    print(f"{impl:20s} {model:9s} ctx={ctx:6d} b={b:3d}  {ms:8.4f} ms  {gbps:7.0f} GB/s  "
                          f"{row['pct_copy_bw']:5.1f}% copy", flush=True)
    tag = device_tag(dev)
    res = dict(device=dev, copy_bandwidth_gbps=copy_bw / 1e9, versions=versions(), correctness_rel_err=errs,
               sink=SINK, window=WINDOW, k_group=GK, v_group=GV, rows=rows, wall_s=time.time() - t0)
    write_json(args.out, "decode_kernel", dev, res)
    try:
        plot(res, os.path.join(args.out, f"decode_kernel_{tag}.png"))
    except Exception as e:  # noqa: BLE001
        print("plot failed:", e)
    # summary table
    print("\nimpl                 model     ctx     b      ms   %copy")
    for r in rows:
        print(f"{r['impl']:20s} {r['model']:9s} {r['context']:6d} {r['batch']:3d} {r['ms']:8.4f} {r['pct_copy_bw']:5.1f}")


def plot(res, path):
    try:  # the SGLang runtime bundle ships a 5-line IPython stand-in (no get_ipython, no version_info) that
        # matplotlib would take for IPython: hide it, so that matplotlib sees no IPython at all
        import IPython

        if not hasattr(IPython, "version_info"):
            sys.modules["IPython"] = None
    except ImportError:
        pass
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    models = sorted({r["model"] for r in rows})
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(len(models), len(batches), figsize=(4 * len(batches), 3.5 * len(models)), squeeze=False)
    impls = sorted({r["impl"] for r in rows})
    # one colour per impl across panels (a panel without some impl, e.g. no CUDA history at D 64, keeps the others')
    colour = {impl: f"C{k % 10}" for k, impl in enumerate(impls)}
    for i, m in enumerate(models):
        for j, b in enumerate(batches):
            ax = axes[i][j]
            for impl in impls:
                pts = sorted((r["context"], r["ms"]) for r in rows if r["model"] == m and r["batch"] == b and r["impl"] == impl)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl, color=colour[impl])
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{m}, batch {b}")
            ax.set_xlabel("context")
            ax.set_ylabel("ms / layer-call")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"decode attention, {res['device']} (copy {res['copy_bandwidth_gbps']:.0f} GB/s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
