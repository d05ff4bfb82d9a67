"""Probe: a hand-written CUDA history loop (benchmark/cuda/int2_history_probe.cu) against the Triton decode.

Question (benchmark/NOTES.md "Instruction budget of the loop"): the Triton INT2 loop spends ~1206 SASS
instructions per warp and 64 tokens and runs at 0.65-0.75 of a read of its bytes at batch >= 8; a
hand-scheduled loop was estimated at about half the instructions. Does one reach the read ceiling?

The probe kernel covers the history rows only (Qwen3-8B layer shapes: D 128, GQA 4, groups of 64, uniform
levels), one split per warp, partials merged here in torch. Steps, in one device call:
1. build the .so with nvcc (sm_90), print registers / spills;
2. check it against a float64 torch reference of the history attention on fresh random pools: scattered
   slots, odd lengths, a request with no history, batch 1 and 33, outputs poisoned before the launch;
3. time it (CUDA graphs, copies rotated past L2, like bench_decode.py) next to the production oscar_decode
   call on the same pool and a streaming read of the probe's bytes, with the copy bandwidth of the run.

    python benchmark/probe_cuda_history.py --out $OUT [--configs 4:3,4:2,8:2] [--contexts ...] [--batches ...]

Results: $OUT/probe_cuda_history_<device>.json. Not a kernel of the package: an experiment.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
sys.path.insert(0, HERE)
from bench_decode import (GK, GV, SINK, WINDOW, bench, copy_bandwidth, make_oscar, n_copies,  # noqa: E402
                          oscar_bytes, oscar_fns)
from bench_write import git_commit, write_json  # noqa: E402
from sglang_oscar.kernels.decode import oscar_decode  # noqa: E402
from read_roofline import read_fns  # noqa: E402

LOG2E = 1.4426950408889634
HQ, HKV, D, GQA = 32, 8, 128, 4
SRC = os.path.join(HERE, "cuda", "int2_history_probe.cu")


# ------------------------------------------------------------------------------------------ build


def build(out_dir: str) -> tuple[ctypes.CDLL, str]:
    so = os.path.join(out_dir, "int2_history_probe.so")
    cmd = ["nvcc", "-O3", "-gencode=arch=compute_90,code=sm_90", "-shared", "-Xcompiler", "-fPIC",
           "-Xptxas", "-v", "-lineinfo", "-o", so, SRC]
    res = subprocess.run(cmd, capture_output=True, text=True)
    log = res.stdout + res.stderr
    if res.returncode:
        raise RuntimeError(f"nvcc failed:\n{log}")
    lib = ctypes.CDLL(so)
    i, p = ctypes.c_int, ctypes.c_void_p
    ll = ctypes.c_longlong
    lib.probe_launch.argtypes = [i, i, i, i, p, p, p, p, p, p, p, i, p, p, i, i, i, p, p, p, ll, ll, ll, ll, i, p]
    lib.probe_launch.restype = i
    for f in (lib.probe_prepare, lib.probe_occupancy):
        f.argtypes, f.restype = [i, i], i
    lib.probe_attributes.argtypes, lib.probe_attributes.restype = [i, ctypes.POINTER(i), ctypes.POINTER(i)], i
    return lib, log


# ------------------------------------------------------------------------------------------ query


def _lane_dims():
    """[32 lanes, 16 regs, 2] dims and [32] heads of each lane's B fragments (the .cu file's K dot):
    reg 2ks + w of k-step ks = (plane p, half hh) holds dims p*32 + t*8 + 4hh + 2w + (0, 1), head g & 3."""
    dims = torch.empty(32, 16, 2, dtype=torch.long)
    for lane in range(32):
        t = lane & 3
        for ks in range(8):
            p, hh = ks // 2, ks % 2
            for w in range(2):
                byte = t * 8 + 4 * hh + 2 * w
                dims[lane, 2 * ks + w] = torch.tensor([p * 32 + byte, p * 32 + byte + 1])
    heads = torch.tensor([(lane >> 2) & 3 for lane in range(32)])
    return dims, heads


_DIMS, _HEADS = _lane_dims()


def query_operands(q: torch.Tensor, sm_scale: float):
    """q [B, Hq, D] -> qb [B*Hkv, 32, 16] int32 (fp16 pairs of q' = c0 q 4^(2g-p), c0 = sm_scale log2 e) and
    qs [B*Hkv, 2, 4] fp32 (c0 times the group sums of q, times 2^-24)."""
    b = q.shape[0]
    qf = q.float().reshape(b * HKV, GQA, D) * (sm_scale * LOG2E)
    plane = torch.arange(D, device=q.device) // 32
    fac = 4.0 ** (2 * (plane // 2) - plane).float()
    qp = (qf * fac).to(torch.float16)  # [BH, 4, D]
    dims, heads = _DIMS.to(q.device), _HEADS.to(q.device)
    pairs = qp[:, heads[:, None, None].expand(32, 16, 2), dims]  # [BH, 32, 16, 2]
    qb = pairs.contiguous().view(torch.int32).reshape(b * HKV, 32, 16).contiguous()
    qs = torch.stack([qf[..., :64].sum(-1), qf[..., 64:].sum(-1)], 1) * 2.0 ** -24  # [BH, 2, 4]
    return qb, qs.contiguous()


# ------------------------------------------------------------------------------------------ run


class Probe:
    def __init__(self, lib, nstage: int, warps: int):
        self.lib, self.nstage, self.warps = lib, nstage, warps
        rc = lib.probe_prepare(nstage, warps)
        if rc:
            raise RuntimeError(f"probe_prepare({nstage}, {warps}) -> cuda error {rc}")
        self.ctas_per_sm = lib.probe_occupancy(nstage, warps)
        regs, local = ctypes.c_int(), ctypes.c_int()
        lib.probe_attributes(nstage, ctypes.byref(regs), ctypes.byref(local))
        self.regs, self.local_bytes = regs.value, local.value

    def grid_y(self, bh: int, ctx: int, rounds: int = 1, sms: int = 132) -> int:
        """CTAs per (request, KV head): `rounds` full waves of resident CTAs, >= 256 rows per warp."""
        hist = max(ctx - SINK - WINDOW, 1)
        want = max(1, round(rounds * sms * self.ctas_per_sm / bh))
        return max(1, min(want, hist // (256 * self.warps)))

    def partials(self, bh: int, grid_y: int):
        nsw = grid_y * self.warps
        dev = "cuda"
        return (torch.empty(bh, nsw, GQA, D, device=dev), torch.empty(bh, nsw, GQA, device=dev),
                torch.empty(bh, nsw, GQA, device=dev))

    def launch(self, qb, qs, pool, r2t, req_idx, seq, parts, grid_y, load_only=False):
        o, m, l = parts
        bh = qb.shape[0]
        kc, vc, kp, vp, strides = pool
        rc = self.lib.probe_launch(
            self.nstage, self.warps, bh, grid_y, qb.data_ptr(), qs.data_ptr(), kc.data_ptr(), vc.data_ptr(),
            kp.data_ptr(), vp.data_ptr(), r2t.data_ptr(), r2t.stride(0), req_idx.data_ptr(), seq.data_ptr(), HKV,
            SINK, WINDOW, o.data_ptr(), m.data_ptr(), l.data_ptr(), *strides, int(load_only),
            torch.cuda.current_stream().cuda_stream)
        if rc:
            raise RuntimeError(f"probe_launch -> cuda error {rc}")


LAYOUTS = ("pool", "head_major")


def pool_buffers(cache, layout):
    """(k codes, v codes, k params, v params, strides) as the kernel reads them: the pool's own
    [slot, Hkv, .] buffers, or head-major [Hkv, slot, .] copies of them (a layout experiment)."""
    n = cache.num_slots
    if layout == "pool":
        return cache.k_codes, cache.v_codes, cache.k_params, cache.v_params, (HKV * 32, 32, HKV, 1)
    hm = [t.transpose(0, 1).contiguous() for t in (cache.k_codes, cache.v_codes, cache.k_params, cache.v_params)]
    return (*hm, (32, n * 32, 1, n))


def head_major_oscar_fns(q, cache, r2t, seq, rs, b, copies, req_pool_indices=None, **kw):
    """The production Triton call on head-major copies of the pool, unchanged kernel: each (request, KV head)
    becomes a request of a one-KV-head cache whose slots are h * S + slot, so the kernel's row (slot * 1 + 0)
    walks [Hkv, S, .] buffers. Same bytes and work as oscar_fns; only the addresses differ (an experiment:
    does the Triton loop gain from the layout alone?). req_pool_indices: per copy (default: rows c*b ..)."""
    import dataclasses

    n, nsr, w, dev = cache.num_slots, cache.sink_k.shape[0], WINDOW, cache.k_codes.device
    hm = lambda t: t.transpose(0, 1).contiguous().view(HKV * t.shape[0], 1, *t.shape[2:])  # noqa: E731
    rows = cache.ring_k.shape[0] // w

    def ring(t):
        return t.view(rows, w, HKV, D).permute(0, 2, 1, 3).reshape(rows * HKV * w, 1, D).contiguous()

    heads = torch.arange(HKV, device=dev, dtype=torch.int32)
    st = cache.sink_table
    table = torch.where(st[None, :] >= 0, heads[:, None] * nsr + st[None, :], -1).flatten().to(torch.int32)
    fake = dataclasses.replace(cache, k_codes=hm(cache.k_codes), v_codes=hm(cache.v_codes), k_params=hm(cache.k_params),
                               v_params=hm(cache.v_params), sink_k=hm(cache.sink_k), sink_v=hm(cache.sink_v),
                               ring_k=ring(cache.ring_k), ring_v=ring(cache.ring_v), sink_table=table)
    r2t_f = (heads[None, :, None] * n + r2t[:, None, :]).reshape(r2t.shape[0] * HKV, r2t.shape[1]).contiguous()
    seq_f = seq.repeat_interleave(HKV)
    rs_f = rs.repeat_interleave(HKV)
    q_f = q.reshape(b * HKV, GQA, D)
    out = torch.empty_like(q_f)
    fns = []
    for c in range(copies):
        req = req_pool_indices[c] if req_pool_indices else torch.arange(c * b, (c + 1) * b, device=dev, dtype=torch.int32)
        idx = (req[:, None].to(torch.int32) * HKV + heads).flatten()
        fns.append(lambda idx=idx: oscar_decode(q_f, fake, r2t_f, idx, seq_f, rs_f, sink=SINK, window=WINDOW,
                                                sm_scale=1 / math.sqrt(D), out=out, **kw))
    return fns, (fake, r2t_f, q_f, out, seq_f, rs_f)


def merge(parts, b):
    """[B, Hq, D] from the per-warp partials (m, l in log2 units; an empty split has l = 0)."""
    o, m, l = parts
    mx = m.max(1, keepdim=True).values
    w = torch.exp2(m - mx) * (l > 0)
    out = (o * w[..., None]).sum(1) / (l * w).sum(1)[..., None]
    return out.reshape(b, HKV * GQA, D)


def reference(q, cache, r2t, req_idx, seq, sm_scale):
    """float64 attention over each request's history rows [SINK, L - WINDOW); zeros where there are none."""
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)

    def deq(codes, params, g):
        c = torch.stack([(codes.long() >> (2 * p)) & 3 for p in range(4)], -2).flatten(-2)  # dims p*32 + j
        prm = params.double()
        return prm[..., 1].repeat_interleave(g, -1) + prm[..., 0].repeat_interleave(g, -1) * c.double()

    for i in range(q.shape[0]):
        L = int(seq[i])
        lo, hi = SINK, max(SINK, L - WINDOW)
        if hi <= lo:
            continue
        slots = r2t[int(req_idx[i]), lo:hi].long()
        k = deq(cache.k_codes[slots], cache.k_params[slots], GK)  # [n, Hkv, D]
        v = deq(cache.v_codes[slots], cache.v_params[slots], GV)
        qh = q[i].double().view(HKV, GQA, D)
        s = torch.einsum("hgd,nhd->hgn", qh, k) * sm_scale
        out[i] = torch.einsum("hgn,nhd->hgd", torch.softmax(s, -1), v).reshape(HKV * GQA, D)
    return out


def check(probe, lens, seed, layout):
    """Max error of the merged probe output against reference(), relative to the output's max."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    b, ctx = len(lens), max(lens)
    slots = b * ctx + 7
    cache, _, _, _ = make_oscar(1, HKV, D, slots, 1)  # random codes and params, slots >= what we index
    r2t = torch.randperm(cache.num_slots, generator=g, device="cuda")[: b * ctx].to(torch.int32).view(b, ctx)
    req_idx = torch.randperm(b, generator=g, device="cuda").to(torch.int32)
    seq = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(b, HQ, D, generator=g, device="cuda").to(torch.bfloat16)
    sm_scale = 1 / math.sqrt(D)
    qb, qs = query_operands(q, sm_scale)
    gy = probe.grid_y(b * HKV, ctx, rounds=1)
    parts = probe.partials(b * HKV, gy)
    for t in parts:
        t.fill_(float("nan"))  # poisoned: every partial must be written
    probe.launch(qb, qs, pool_buffers(cache, layout), r2t, req_idx, seq, parts, gy)
    torch.cuda.synchronize()
    got = merge(parts, b).double()
    ref = reference(q, cache, r2t, req_idx, seq, sm_scale)
    has_hist = torch.tensor([L > SINK + WINDOW for L in lens], device="cuda")
    if not torch.isfinite(parts[1]).all() or not torch.isfinite(parts[2]).all():
        raise AssertionError("a partial (m or l) was left unwritten")
    if (~has_hist).any() and (parts[2].view(b, HKV, -1, GQA)[~has_hist] != 0).any():
        raise AssertionError("a request without history has l != 0")
    err = (got[has_hist] - ref[has_hist]).abs().max().item() / ref[has_hist].abs().max().item()
    return err


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--configs", default="4:2,4:3,4:4", help="warps:stages per CTA (the first also times "
                    "load_only and the scattered slot orders)")
    ap.add_argument("--rounds", default="1,2", help="waves of resident CTAs to size the splits")
    ap.add_argument("--contexts", default="32768,65536,131072")
    ap.add_argument("--batches", default="1,8,32")
    args = ap.parse_args()
    t0 = time.time()
    dev = torch.cuda.get_device_name()
    lib, log = build(args.out)
    print("\n".join(ln for ln in log.splitlines() if "registers" in ln or "spill" in ln), flush=True)
    probes = [Probe(lib, int(c.split(":")[1]), int(c.split(":")[0])) for c in args.configs.split(",")]
    for p in probes:
        print(f"config {p.warps} warps x {p.nstage} stages: {p.regs} registers, {p.local_bytes} B local, "
              f"{p.ctas_per_sm} CTAs per SM", flush=True)

    # 1. correctness: odd lengths, one request without history, batch 1 and 33, scattered slots
    cases = {"b1_odd": [5001], "b3_mixed": [3001, 97, 70000], "b33": [400 + 977 * i for i in range(33)]}
    errs = {}
    for p in probes:
        for name, lens in cases.items():
            for layout in LAYOUTS:
                errs[f"{p.warps}:{p.nstage}:{layout}:{name}"] = check(p, lens, seed=len(errs), layout=layout)
    print("max error / max |ref| against float64:", {k: f"{v:.1e}" for k, v in errs.items()}, flush=True)
    tol = 2e-2  # fp16 q' and p.scale operands (relative 2^-11 each), fp32 accumulation, ex2.approx
    bad = {k: v for k, v in errs.items() if not v < tol}
    if bad:
        raise SystemExit(f"probe output differs from the reference beyond {tol}: {bad}")

    # 2. timing
    copy_bw = copy_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"device {dev}, {sms} SMs, copy bandwidth {copy_bw / 1e9:.0f} GB/s", flush=True)
    rows = []
    for ctx in (int(x) for x in args.contexts.split(",")):
        for b in (int(x) for x in args.batches.split(",")):
            nbytes = oscar_bytes(b, HQ, HKV, D, ctx)
            copies = n_copies(nbytes)
            cache, r2t, seq, rs = make_oscar(b, HKV, D, ctx, copies)
            q = torch.randn(b, HQ, D, dtype=torch.bfloat16, device="cuda")
            hist = ctx - SINK - WINDOW
            probe_bytes = b * HKV * hist * (2 * D // 4 + (D // GK) * 4 + (D // GV) * 4) + b * hist * 4
            row = {"context": ctx, "batch": b, "copies": copies, "oscar_bytes": nbytes, "probe_bytes": probe_bytes}
            row["oscar_ms"] = bench(oscar_fns(q, cache, r2t, seq, rs, b, copies, D))
            fns, keep = head_major_oscar_fns(q, cache, r2t, seq, rs, b, copies)
            want = oscar_decode(q, cache, r2t, torch.arange(b, dtype=torch.int32, device="cuda"), seq, rs, sink=SINK,
                                window=WINDOW, sm_scale=1 / math.sqrt(D))
            got = fns[0]().view_as(want)
            row["oscar_head_major_max_diff"] = (got.float() - want.float()).abs().max().item()
            if not row["oscar_head_major_max_diff"] <= 1e-2 * want.float().abs().max().item():
                raise SystemExit(f"oscar on head-major copies differs: {row['oscar_head_major_max_diff']}")
            row["oscar_head_major_ms"] = bench(fns)
            del keep, fns
            fns, keep = read_fns(probe_bytes, copies, sms)
            row["read_probe_bytes_ms"] = bench(fns)
            del keep
            fns, keep = read_fns(nbytes, copies, sms)
            row["read_oscar_bytes_ms"] = bench(fns)
            del keep
            qb, qs = query_operands(q, 1 / math.sqrt(D))
            best = None
            idx = [torch.arange(c * b, (c + 1) * b, dtype=torch.int32, device="cuda") for c in range(copies)]
            r2t_scattered = torch.randperm(cache.num_slots, device="cuda").to(torch.int32).view(r2t.shape)
            # pages of 64 slots in a random order, contiguous inside (a paged pool, page_size 64, fragmented)
            page = 64
            perm = torch.randperm(cache.num_slots // page, device="cuda").to(torch.int32)
            pos = torch.arange(cache.num_slots, device="cuda", dtype=torch.int32)
            r2t_paged = (perm[pos // page] * page + pos % page).view(r2t.shape)
            for layout in LAYOUTS:
                pool = pool_buffers(cache, layout)
                for p in probes:
                    for rounds in (int(x) for x in args.rounds.split(",")):
                        gy = p.grid_y(b * HKV, ctx, rounds, sms)
                        parts = p.partials(b * HKV, gy)
                        for load_only in (False, True):
                            if load_only and (p is not probes[0] or rounds != 1):
                                continue  # the gather alone: one config is enough
                            fns = [lambda i=i, p=p, gy=gy, parts=parts, pool=pool, lo=load_only, r=r2t:
                                   p.launch(qb, qs, pool, r, i, seq, parts, gy, lo) for i in idx]
                            ms = bench(fns)
                            key = f"{layout}:{p.warps}:{p.nstage}:r{rounds}" + (":load_only" if load_only else "")
                            row.setdefault("probe_ms", {})[key] = ms
                            row.setdefault("probe_grid_y", {})[key] = gy
                            if not load_only and (best is None or ms < best[1]):
                                best = (key, ms)
                            if not load_only and layout == "pool":
                                row["probe_pool_best_ms"] = min(row.get("probe_pool_best_ms", 1e9), ms)
                # the same, with every request's slots scattered over the pool (a fragmented allocator)
                gy = probes[0].grid_y(b * HKV, ctx, 1, sms)
                parts = probes[0].partials(b * HKV, gy)
                fns = [lambda i=i, gy=gy, parts=parts, pool=pool, r=r2t_scattered: probes[0].launch(
                    qb, qs, pool, r, i, seq, parts, gy) for i in idx]
                row["probe_ms"][f"{layout}:{probes[0].warps}:{probes[0].nstage}:r1:scattered"] = bench(fns)
                fns = [lambda i=i, gy=gy, parts=parts, pool=pool, r=r2t_paged: probes[0].launch(
                    qb, qs, pool, r, i, seq, parts, gy) for i in idx]
                row["probe_ms"][f"{layout}:{probes[0].warps}:{probes[0].nstage}:r1:pages64_scattered"] = bench(fns)
                del pool
            row["probe_best"], row["probe_best_ms"] = best
            row["probe_pct_of_read"] = 100 * row["read_probe_bytes_ms"] / best[1]
            row["oscar_pct_of_read"] = 100 * row["read_oscar_bytes_ms"] / row["oscar_ms"]
            row["probe_pool_pct_of_read"] = 100 * row["read_probe_bytes_ms"] / row["probe_pool_best_ms"]
            row["probe_pct_copy_bw"] = 100 * probe_bytes / (best[1] * 1e-3) / copy_bw
            row["oscar_pct_copy_bw"] = 100 * nbytes / (row["oscar_ms"] * 1e-3) / copy_bw
            rows.append(row)
            print(f"ctx {ctx:6d} b {b:2d}: oscar {row['oscar_ms'] * 1e3:7.1f} us ({row['oscar_pct_of_read']:.0f}% of "
                  f"its read, {row['oscar_pct_copy_bw']:.0f}% copy bw) | probe history {best[1] * 1e3:7.1f} us "
                  f"[{best[0]}] ({row['probe_pct_of_read']:.0f}% of its read, {row['probe_pct_copy_bw']:.0f}% copy bw; "
                  f"pool layout {row['probe_pool_pct_of_read']:.0f}%) | oscar on head-major copies "
                  f"{row['oscar_head_major_ms'] * 1e3:.1f} us"
                  f" | all {', '.join(f'{k} {v * 1e3:.1f}' for k, v in row['probe_ms'].items())}", flush=True)
            del cache, r2t, r2t_scattered, r2t_paged
            torch.cuda.empty_cache()
    res = {"device": dev, "sms": sms, "copy_bw_gbps": copy_bw / 1e9, "errors": errs, "tolerance": tol,
           "configs": {f"{p.warps}:{p.nstage}": {"registers": p.regs, "local_bytes": p.local_bytes,
                                                 "ctas_per_sm": p.ctas_per_sm} for p in probes},
           "versions": {"torch": torch.__version__, "git_commit": git_commit(),
                        "nvcc": subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.strip()
                        .splitlines()[-1]},
           "rows": rows, "seconds": time.time() - t0}
    write_json(args.out, "probe_cuda_history", dev, res)


if __name__ == "__main__":
    main()
