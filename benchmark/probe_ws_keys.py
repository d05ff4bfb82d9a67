"""Probe: does warp specialisation make the INT2 key stream issue more work per cycle?

The decode kernel's Triton loop is issue- and latency-bound (benchmark/NOTES.md "Dims-major V pages": ~17
warp-instructions per token-head at ~2 per cycle, with every warp loading, converting and multiplying). This probe
answers one question before anyone ports the whole loop to Gluon: with the same consumer code, does a producer
warp that gathers the rows with cp.async into a shared-memory ring (`ws`) beat the same loop with the copies
issued by the compute warps and software-pipelined (`sr`)?

Work per (request, KV head, split): the K side of the decode loop only. Scores of GQA = 4 query heads (N padded to
8) against INT2 keys gathered through req_to_token (D 128, groups of 64, subnormal codes: the decode kernel's
format and conversion), reduced to online-softmax statistics (running max and sum per head). Both variants are
checked against a float64 torch oracle of the same statistics, then timed (CUDA graphs of `--copies` independent
caches, like bench_decode.py) next to a streaming read of the same bytes (read_roofline.py).

    python benchmark/probe_ws_keys.py --out $OUT [--ws-maxnreg 128,96] [--nb 3]   # GPU (sm_90)
    python benchmark/probe_ws_keys.py --compile-only [--dump DIR]               # no GPU: compile for sm_90, SASS counts

Measured (H100, results/probe_ws_keys_*): naive, the warp-specialised form is slower; with the req_to_token
prefetch (--prefetch-too) and 4 CTAs per SM (--ws-maxnreg 64) it is even with the tuned single-role form
(benchmark/NOTES.md "A first warp-specialised probe").

Not a kernel of the package: an experiment (gluon is experimental in triton 3.6).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.ampere import mbarrier, mma_v2

D = gl.constexpr(128)
D4 = gl.constexpr(32)  # code bytes per row (quarter planes: byte j holds dims j, j+32, j+64, j+96)
G = gl.constexpr(64)  # K group: planes 2g and 2g+1 form group g
GQA = gl.constexpr(4)
NP = gl.constexpr(8)  # the dots' N (the m16n8 layout)


@gluon.jit
def _plane(b, P: gl.constexpr):
    """Plane P of a uint8 tile as the fp16 subnormal code·2^(2P−24) (decode._codes_plane_scaled)."""
    MASK: gl.constexpr = 0x00030003 << (2 * P)
    return gl.inline_asm_elementwise(
        asm=f"""{{
        .reg .b32 t;
        prmt.b32 t, $2, 0, 0x4140;
        and.b32 $0, t, {MASK};
        prmt.b32 t, $2, 0, 0x4342;
        and.b32 $1, t, {MASK};
        }}""",
        constraints="=r,=r,r", args=[b], dtype=gl.float16, is_pure=True, pack=4,
    )


@gluon.jit
def _scores_step(kbuf, pbuf, qt0, qt1, qt2, qt3, qs0, qs1, m_i, l_i, start, hi,
                 BN: gl.constexpr, MMA: gl.constexpr, A_OP: gl.constexpr):
    """One block of BN keys from shared memory: scores [BN, NP], then the running max / sum per column."""
    codes = kbuf.load(A_OP)  # [BN, D4] int8 straight into the dots' A layout
    w64 = pbuf.load(gl.SliceLayout(1, MMA))  # [BN] (scale, min) of both groups
    pos = start + gl.arange(0, BN, gl.SliceLayout(1, MMA))
    valid = pos < hi
    s = gl.zeros([BN, NP], gl.float32, MMA)
    for g in gl.static_range(2):
        d = gl.zeros([BN, NP], gl.float32, MMA)
        if g == 0:
            d = mma_v2(_plane(codes, 0), qt0, d)
            d = mma_v2(_plane(codes, 1), qt1, d)
            qs = qs0
        else:
            d = mma_v2(_plane(codes, 2), qt2, d)
            d = mma_v2(_plane(codes, 3), qt3, d)
            qs = qs1
        w = (w64 >> (32 * g)).to(gl.int32)
        scale = (w << 16).to(gl.float32, bitcast=True) * (2.0 ** (24 - 4 * g))
        mn = ((w >> 16) << 16).to(gl.float32, bitcast=True)
        s += d * scale[:, None] + mn[:, None] * qs[None, :]
    cols = gl.arange(0, NP, gl.SliceLayout(0, MMA))
    s = gl.where(valid[:, None] & (cols < GQA)[None, :], s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 0))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    l_i = l_i * gl.exp2(m_i - m_safe) + gl.sum(gl.exp2(s - m_safe[None, :]), 0)
    return m_new, l_i


@gluon.jit
def _query(QT, QS, pid_bh, MMA: gl.constexpr, B_OP: gl.constexpr, LQ: gl.constexpr):
    """The 4 pre-scaled query planes [D4, NP] as B operands and the 2 group sums [NP]."""
    r = gl.arange(0, D4, gl.SliceLayout(1, LQ))
    c = gl.arange(0, NP, gl.SliceLayout(0, LQ))
    base = QT + pid_bh * (4 * D4 * NP) + r[:, None] * NP + c[None, :]
    qt0 = gl.convert_layout(gl.load(base), B_OP)
    qt1 = gl.convert_layout(gl.load(base + D4 * NP), B_OP)
    qt2 = gl.convert_layout(gl.load(base + 2 * D4 * NP), B_OP)
    qt3 = gl.convert_layout(gl.load(base + 3 * D4 * NP), B_OP)
    cs = gl.arange(0, NP, gl.SliceLayout(0, MMA))
    qs0 = gl.load(QS + pid_bh * (2 * NP) + cs)
    qs1 = gl.load(QS + pid_bh * (2 * NP) + NP + cs)
    return qt0, qt1, qt2, qt3, qs0, qs1


@gluon.jit
def _block_rows(r2t, h, start, hi, HKV: gl.constexpr, BN: gl.constexpr, LK: gl.constexpr, LP: gl.constexpr):
    """Pool rows (slot·Hkv + h) of one block's positions, in the layouts of its two copies (rows past hi: 0)."""
    pos_k = start + gl.arange(0, BN, gl.SliceLayout(1, LK))
    row_k = gl.load(r2t + pos_k, mask=pos_k < hi, other=0).to(gl.int64) * HKV + h
    pos_p = start + gl.arange(0, BN, LP)
    row_p = gl.load(r2t + pos_p, mask=pos_p < hi, other=0).to(gl.int64) * HKV + h
    return row_k, row_p


@gluon.jit
def _copy_codes(kbuf, KC, row_k, mk, LK: gl.constexpr):
    """cp.async of a block's code rows [BN, D4] (masked rows: zeros)."""
    byte = gl.arange(0, D4, gl.SliceLayout(0, LK))
    cp.async_copy_global_to_shared(kbuf, KC + row_k[:, None] * D4 + byte[None, :], mask=mk[:, None])


@gluon.jit
def _issue_copies(kbuf, pbuf, KC, KP, r2t, h, start, hi, HKV: gl.constexpr, BN: gl.constexpr, LK: gl.constexpr,
                  LP: gl.constexpr):
    """Rows and cp.async of one block's code rows [BN, D4] and parameter words [BN] (rows past hi: zeros), each
    index load right before its copy (the order that was measured)."""
    pos_k = start + gl.arange(0, BN, gl.SliceLayout(1, LK))
    mk = pos_k < hi
    _copy_codes(kbuf, KC, gl.load(r2t + pos_k, mask=mk, other=0).to(gl.int64) * HKV + h, mk, LK)
    pos_p = start + gl.arange(0, BN, LP)
    mp = pos_p < hi
    cp.async_copy_global_to_shared(pbuf, KP + gl.load(r2t + pos_p, mask=mp, other=0).to(gl.int64) * HKV + h,
                                   mask=mp)


@gluon.jit
def _program(SEQ, R2T, stride_r2t, HKV: gl.constexpr, NS: gl.constexpr, SINK: gl.constexpr, BN: gl.constexpr):
    """(pid_bh, split, KV head, rows [lo, hi), req_to_token row) of this program: the history [SINK, L) cut into
    NS chunks of whole blocks, as the decode kernel's splits."""
    pid_bh = gl.program_id(0)
    split = gl.program_id(1)
    b = pid_bh // HKV
    L = gl.load(SEQ + b)
    chunk = gl.cdiv(gl.cdiv(gl.maximum(L - SINK, 0), NS), BN) * BN
    lo = SINK + split * chunk
    return pid_bh, split, pid_bh % HKV, lo, gl.minimum(lo + chunk, L), R2T + b.to(gl.int64) * stride_r2t


@gluon.jit
def _store_stats(M_OUT, L_OUT, pid_bh, split, m_i, l_i, NS: gl.constexpr, MMA: gl.constexpr):
    cs = gl.arange(0, NP, gl.SliceLayout(0, MMA))
    gl.store(M_OUT + (pid_bh * NS + split) * NP + cs, m_i)
    gl.store(L_OUT + (pid_bh * NS + split) * NP + cs, l_i)


# ---------------------------------------------------------------------------------------------- ws


@gluon.jit
def _ws_consumer(kbufs, pbufs, ready, empty, QT, QS, M_OUT, L_OUT, pid_bh, split, lo, hi,
                 NS: gl.constexpr, BN: gl.constexpr, NB: gl.constexpr, NWC: gl.constexpr):
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NWC, 1], instr_shape=[16, 8])
    A_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=4)
    B_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=4)
    LQ: gl.constexpr = gl.BlockedLayout([1, 1], [4, 8], [NWC, 1], [1, 0])
    qt0, qt1, qt2, qt3, qs0, qs1 = _query(QT, QS, pid_bh, MMA, B_OP, LQ)
    m_i = gl.full([NP], float("-inf"), gl.float32, gl.SliceLayout(0, MMA))
    l_i = gl.zeros([NP], gl.float32, gl.SliceLayout(0, MMA))
    n = gl.cdiv(hi - lo, BN)
    for i in range(n):
        s = i % NB
        mbarrier.wait(ready.index(s), (i // NB) & 1)
        m_i, l_i = _scores_step(kbufs.index(s), pbufs.index(s), qt0, qt1, qt2, qt3, qs0, qs1, m_i, l_i,
                                lo + i * BN, hi, BN, MMA, A_OP)
        mbarrier.arrive(empty.index(s))
    _store_stats(M_OUT, L_OUT, pid_bh, split, m_i, l_i, NS, MMA)


@gluon.jit
def _ws_producer(kbufs, pbufs, ready, empty, KC, KP, r2t, h, lo, hi,
                 HKV: gl.constexpr, BN: gl.constexpr, NB: gl.constexpr, PREFETCH: gl.constexpr):
    LK: gl.constexpr = gl.BlockedLayout([1, 16], [16, 2], [1, 1], [1, 0])
    LP: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    n = gl.cdiv(hi - lo, BN)
    if PREFETCH:
        # the next block's req_to_token rows are loaded before this block's wait and copies: the index
        # load's latency overlaps them instead of starting each block's chain
        row_k, row_p = _block_rows(r2t, h, lo, hi, HKV, BN, LK, LP)
        for i in range(n):
            s = i % NB
            start = lo + i * BN
            nxt_k, nxt_p = _block_rows(r2t, h, start + BN, hi, HKV, BN, LK, LP)
            mbarrier.wait(empty.index(s), ((i // NB) & 1) ^ 1)
            _copy_codes(kbufs.index(s), KC, row_k, (start + gl.arange(0, BN, gl.SliceLayout(1, LK))) < hi, LK)
            cp.async_copy_global_to_shared(pbufs.index(s), KP + row_p, mask=(start + gl.arange(0, BN, LP)) < hi)
            cp.mbarrier_arrive(ready.index(s), increment_count=False)
            row_k = nxt_k
            row_p = nxt_p
    else:
        for i in range(n):
            s = i % NB
            mbarrier.wait(empty.index(s), ((i // NB) & 1) ^ 1)
            _issue_copies(kbufs.index(s), pbufs.index(s), KC, KP, r2t, h, lo + i * BN, hi, HKV, BN, LK, LP)
            cp.mbarrier_arrive(ready.index(s), increment_count=False)  # each producer thread, when its copies land


@gluon.jit
def ws_keys_kernel(QT, QS, KC, KP, R2T, SEQ, M_OUT, L_OUT, stride_r2t,
                   HKV: gl.constexpr, NS: gl.constexpr, SINK: gl.constexpr, BN: gl.constexpr, NB: gl.constexpr,
                   NWC: gl.constexpr, PREFETCH: gl.constexpr = False):
    pid_bh, split, h, lo, hi, r2t = _program(SEQ, R2T, stride_r2t, HKV, NS, SINK, BN)
    SMEM: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=4, max_phase=2, order=[1, 0])
    kbufs = gl.allocate_shared_memory(gl.int8, [NB, BN, D4], SMEM)
    pbufs = gl.allocate_shared_memory(gl.int64, [NB, BN], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ready = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NB):
        mbarrier.init(ready.index(s), count=32)  # the producer warp's threads (cp.async.mbarrier.arrive.noinc)
        mbarrier.init(empty.index(s), count=1)
    gl.warp_specialize([
        (_ws_consumer, (kbufs, pbufs, ready, empty, QT, QS, M_OUT, L_OUT, pid_bh, split, lo, hi, NS, BN, NB, NWC)),
        (_ws_producer, (kbufs, pbufs, ready, empty, KC, KP, r2t, h, lo, hi, HKV, BN, NB, PREFETCH)),
    ], [1], [48])


# ---------------------------------------------------------------------------------------------- sr


@gluon.jit
def sr_keys_kernel(QT, QS, KC, KP, R2T, SEQ, M_OUT, L_OUT, stride_r2t,
                   HKV: gl.constexpr, NS: gl.constexpr, SINK: gl.constexpr, BN: gl.constexpr, NB: gl.constexpr,
                   NWC: gl.constexpr):
    """The same consumer; the compute warps issue the copies NB − 1 blocks ahead (Triton's pipeliner shape)."""
    pid_bh, split, h, lo, hi, r2t = _program(SEQ, R2T, stride_r2t, HKV, NS, SINK, BN)
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NWC, 1], instr_shape=[16, 8])
    A_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=4)
    B_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=4)
    LQ: gl.constexpr = gl.BlockedLayout([1, 1], [4, 8], [NWC, 1], [1, 0])
    LK: gl.constexpr = gl.BlockedLayout([1, 16], [16, 2], [NWC, 1], [1, 0])
    LP: gl.constexpr = gl.BlockedLayout([1], [32], [NWC], [0])
    SMEM: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=4, max_phase=2, order=[1, 0])
    kbufs = gl.allocate_shared_memory(gl.int8, [NB, BN, D4], SMEM)
    pbufs = gl.allocate_shared_memory(gl.int64, [NB, BN], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    qt0, qt1, qt2, qt3, qs0, qs1 = _query(QT, QS, pid_bh, MMA, B_OP, LQ)
    m_i = gl.full([NP], float("-inf"), gl.float32, gl.SliceLayout(0, MMA))
    l_i = gl.zeros([NP], gl.float32, gl.SliceLayout(0, MMA))
    n = gl.cdiv(hi - lo, BN)
    for j in gl.static_range(NB - 1):  # blocks past the end copy nothing (masked)
        _issue_copies(kbufs.index(j), pbufs.index(j), KC, KP, r2t, h, lo + j * BN, hi, HKV, BN, LK, LP)
        cp.commit_group()
    for i in range(n):
        nxt = i + NB - 1
        _issue_copies(kbufs.index(nxt % NB), pbufs.index(nxt % NB), KC, KP, r2t, h, lo + nxt * BN, hi, HKV, BN,
                      LK, LP)
        cp.commit_group()
        cp.wait_group(NB - 1)
        gl.thread_barrier()  # every thread's copies of block i have landed
        s = i % NB
        m_i, l_i = _scores_step(kbufs.index(s), pbufs.index(s), qt0, qt1, qt2, qt3, qs0, qs1, m_i, l_i,
                                lo + i * BN, hi, BN, MMA, A_OP)
        gl.thread_barrier()  # block i's buffers may be refilled next iteration
    cp.wait_group(0)
    _store_stats(M_OUT, L_OUT, pid_bh, split, m_i, l_i, NS, MMA)


# ---------------------------------------------------------------------------------------------- host


def make_inputs(b, hkv, ctx, copies, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    slots = b * ctx * copies
    kc = torch.randint(0, 256, (slots, hkv, D4), generator=g, dtype=torch.uint8).to(device)
    scale = (torch.rand(slots, hkv, 2, generator=g) * 0.3 + 0.05).to(torch.bfloat16)
    mn = (-torch.rand(slots, hkv, 2, generator=g)).to(torch.bfloat16)
    kp = torch.stack([scale, mn], -1).reshape(slots, hkv, 4).contiguous().to(device)  # (s0, m0, s1, m1)
    perm = torch.randperm(slots, generator=g).to(torch.int32)  # scattered rows, like a used pool
    r2t = perm.view(b * copies, ctx).to(device)
    q = (torch.randn(b * copies, hkv, GQA, D, generator=g) * 0.5).to(torch.float16)
    return kc, kp, r2t, q


def query_planes(q):
    """QT [B·Hkv, 4, D4, NP] fp16 (plane p of dims p·D4.., pre-scaled by 4^(2g − p)) and QS [B·Hkv, 2, NP] fp32."""
    bh = q.shape[0] * q.shape[1]
    qf = q.reshape(bh, GQA, D).float()
    qt = torch.zeros(bh, 4, D4, NP, dtype=torch.float32, device=q.device)
    for p in range(4):
        g = p // 2
        qt[:, p, :, :GQA] = qf[:, :, p * D4:(p + 1) * D4].transpose(1, 2) * 4.0 ** (2 * g - p)
    qs = torch.zeros(bh, 2, NP, dtype=torch.float32, device=q.device)
    for g in range(2):
        qs[:, g, :GQA] = qf[:, :, g * G:(g + 1) * G].sum(-1)
    return qt.to(torch.float16).contiguous(), qs.contiguous()


def oracle(kc, kp, r2t, q, b, hkv, ctx, ns, sink, bn):
    """float64 (max, sum) per (b·Hkv, split, head) of the scores q·k̂ over each split's rows."""
    codes = torch.stack([(kc.long() >> (2 * p)) & 3 for p in range(4)], 2).reshape(kc.shape[0], hkv, D)  # dims order
    prm = kp.view(torch.bfloat16).double().reshape(kc.shape[0], hkv, 2, 2)
    k = prm[..., 1].repeat_interleave(G, -1) + prm[..., 0].repeat_interleave(G, -1) * codes.double()
    chunk = -(-(-(-(ctx - sink) // ns)) // bn) * bn
    m = torch.full((b * hkv, ns, GQA), float("-inf"), dtype=torch.float64)
    l = torch.zeros((b * hkv, ns, GQA), dtype=torch.float64)
    for r in range(b):
        rows = r2t[r].long()
        for h in range(hkv):
            s = (k[rows, h] @ q[r, h].double().T).cpu()  # [ctx, GQA]
            for sp in range(ns):
                lo, hi = sink + sp * chunk, min(sink + (sp + 1) * chunk, ctx)
                if hi > lo:
                    mm = s[lo:hi].max(0).values
                    m[r * hkv + h, sp] = mm
                    l[r * hkv + h, sp] = torch.exp2(s[lo:hi] - mm).sum(0)
    return m, l


def run(kernel, qt, qs, kc, kp, r2t, seq, m_out, l_out, hkv, ns, sink, bn, nb, nwc, b, maxnreg=None, prefetch=None):
    kernel[(b * hkv, ns)](qt, qs, kc, kp.view(torch.int64), r2t, seq, m_out, l_out, r2t.stride(0),
                          HKV=hkv, NS=ns, SINK=sink, BN=bn, NB=nb, NWC=nwc, num_warps=nwc,
                          **({"maxnreg": maxnreg} if maxnreg else {}),
                          **({"PREFETCH": prefetch} if prefetch is not None else {}))


def compile_only(nwc, nb, bn, maxnreg, dump=None):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    sig = {"QT": "*fp16", "QS": "*fp32", "KC": "*u8", "KP": "*i64", "R2T": "*i32", "SEQ": "*i32",
           "M_OUT": "*fp32", "L_OUT": "*fp32", "stride_r2t": "i32"}
    sys.path.insert(0, os.path.dirname(__file__))
    from inspect_decode_sass import count, sass_of
    out = {}
    for name, fn, extra in (("ws", ws_keys_kernel, {}), ("ws_pf", ws_keys_kernel, {"PREFETCH": True}),
                            ("sr", sr_keys_kernel, {})):
        consts = dict(HKV=8, NS=16, SINK=64, BN=bn, NB=nb, NWC=nwc, **extra)
        s = dict(sig, **{k: "constexpr" for k in consts})
        names = list(fn.arg_names)
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items() if t.startswith("*")}
        attrs[(names.index("stride_r2t"),)] = [["tt.divisibility", 16]]
        src = GluonASTSource(fn, s, constexprs=consts, attrs=attrs)
        opts = {"num_warps": nwc, **({"maxnreg": maxnreg} if maxnreg and name.startswith("ws") else {})}
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
        if dump:
            os.makedirs(dump, exist_ok=True)
            with open(os.path.join(dump, f"probe_{name}.ptx"), "w") as f:
                f.write(k.asm["ptx"])
        c = count(k, sass_of(k))
        out[name] = {key: c[key] for key in ("registers", "stack_bytes", "shared_bytes", "sass_instructions", "hmma",
                                             "ldgsts", "bar_sync")}
        out[name]["loop"] = c["int2_loop"]
    print(json.dumps(out, indent=1))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--dump", help="with --compile-only: folder for the PTX of both kernels")
    ap.add_argument("--nwc", type=int, default=4, help="compute warps")
    ap.add_argument("--nb", type=int, default=3, help="shared-memory stages")
    ap.add_argument("--bn", type=int, default=64, help="keys per block")
    ap.add_argument("--ws-maxnreg", type=lambda t: [int(x) for x in t.split(",")], default=[128, 96],
                    help="register caps for the ws kernel (its warps count by warpgroups: 4 compute + 4)")
    ap.add_argument("--prefetch-too", action="store_true",
                    help="also time the ws form whose producer loads the next block's req_to_token rows ahead")
    ap.add_argument("--points", default="8:32768,32:32768,8:131072,32:131072", help="batch:context list")
    args = ap.parse_args()
    if args.compile_only:
        compile_only(args.nwc, args.nb, args.bn, args.ws_maxnreg[0], args.dump)
        return
    sys.path.insert(0, os.path.dirname(__file__))
    from read_roofline import read_fns  # noqa: E402
    from bench_decode import bench, copy_bandwidth, n_copies  # noqa: E402
    dev = "cuda"
    hkv, sink = 8, 64
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    res = {"device": torch.cuda.get_device_name(), "copy_bandwidth_gbps": copy_bandwidth() / 1e9,
           "config": vars(args), "checks": {}, "rows": []}
    variants = [(f"ws_r{mr}" + ("_pf" if pf else ""), ws_keys_kernel, mr, pf) for mr in args.ws_maxnreg
                for pf in ((False, True) if args.prefetch_too else (False,))] + [("sr", sr_keys_kernel, None, None)]
    # correctness: small shapes, odd lengths (the last block masked), every variant
    for b, ctx, ns in ((2, 1000, 3), (1, 4099, 5)):
        kc, kp, r2t, q = make_inputs(b, hkv, ctx, 1, dev, seed=ctx)
        qt, qs = query_planes(q.to(dev))
        seq = torch.full((b,), ctx, dtype=torch.int32, device=dev)
        m_ref, l_ref = oracle(kc, kp, r2t, q.to(dev), b, hkv, ctx, ns, sink, args.bn)
        for name, kern, mr, pf in variants:
            m_out = torch.full((b * hkv, ns, NP), float("nan"), device=dev)
            l_out = torch.full_like(m_out, float("nan"))
            run(kern, qt, qs, kc, kp, r2t, seq, m_out, l_out, hkv, ns, sink, args.bn, args.nb, args.nwc, b, mr, pf)
            torch.cuda.synchronize()
            em = ((m_out[..., :GQA].double().cpu() - m_ref).abs().max()).item()
            el = ((l_out[..., :GQA].double().cpu() - l_ref).abs() / l_ref.abs().clamp_min(1e-30)).max().item()
            res["checks"][f"{name}_b{b}_ctx{ctx}"] = {"max_abs_err_max": em, "max_rel_err_sum": el}
            print(name, b, ctx, "max err", em, "sum rel err", el, flush=True)
            assert em < 2e-2 * max(1.0, m_ref.abs().max().item()) and el < 2e-2, (name, em, el)
    for spec in args.points.split(","):
        b, ctx = (int(x) for x in spec.split(":"))
        nbytes = int(b * hkv * (ctx - sink) * (int(D4) + 8) + b * ctx * 4)
        copies = n_copies(nbytes)
        kc, kp, r2t, q = make_inputs(b, hkv, ctx, copies, dev)
        qt, qs = query_planes(q.to(dev))
        seq = torch.full((b,), ctx, dtype=torch.int32, device=dev)
        ns = max(1, math.ceil(6 * num_sms / (b * hkv)))  # ~6 programs per SM, one round
        row = {"batch": b, "context": ctx, "bytes": nbytes, "splits": ns}
        for name, kern, mr, pf in variants:
            m_out = torch.empty(b * copies * hkv, ns, NP, device=dev)
            l_out = torch.empty_like(m_out)
            fns = []
            for c in range(copies):
                sl = slice(c * b, (c + 1) * b)
                fns.append(lambda sl=sl, kern=kern, mr=mr, pf=pf: run(kern, qt[sl.start * hkv:sl.stop * hkv], qs[sl.start * hkv:sl.stop * hkv],
                                                       kc, kp, r2t[sl], seq, m_out, l_out, hkv, ns, sink, args.bn,
                                                       args.nb, args.nwc, b, mr, pf))
            ms = bench(fns)
            row[f"{name}_ms"] = ms
            row[f"{name}_pct_copy"] = 100 * nbytes / (ms * 1e-3) / res["copy_bandwidth_gbps"] / 1e9
        fns, keep = read_fns(nbytes, copies, num_sms)
        ms = bench(fns)
        row["read_ms"] = ms
        row["read_pct_copy"] = 100 * nbytes / (ms * 1e-3) / res["copy_bandwidth_gbps"] / 1e9
        print(json.dumps(row), flush=True)
        res["rows"].append(row)
        del kc, kp, r2t, fns, keep
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"probe_ws_keys_nwc{args.nwc}_nb{args.nb}.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
