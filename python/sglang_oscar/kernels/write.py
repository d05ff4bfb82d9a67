"""Cache write: transform, window copy, clip, quantize (INT2, or INT4 keys) and pack K and V in one launch.

For every token t and KV head h, per side (K, V):

    x'   = (x − μ)·T                     fp32 (IEEE products, see PRECISION below); V: T may be absent
    sink_dst[t] >= 0  ->  sink[sink_dst[t], h] = x'   (cast to the sink buffer dtype)
    ring_dst[t] >= 0  ->  ring[ring_dst[t], h] = x'
    c    = clip(x', ±τ)                  τ = (n+1)-th largest |x'| of the row, n = clip_count(ρ, D)
    per group of G: scale = e4m3((max − min)/qmax), min = e4m3(min)     float8 e4m3: saturated to ±448, rounded to
                                         nearest even (quant/intq.py round_param); qmax 3 (INT2) or 15 (INT4 keys)
    t    = (c − min)/scale               with the rounded values, IEEE division (0 where scale is 0)
    code = #{thresholds <= t}            thresholds k + 0.5: INT2 k = 0..2, code in [0, 3]; INT4 keys k = 0..14,
                                         code in [0, 15]
    codes[slots[t], h] = quarter-plane packed codes, params[slots[t], h] = (scale, min)
                                         INT4 keys: code & 3 packed into k_codes, code >> 2 into k_hi (quant/pack.py)
                                         at the head's row j = k4_index[h] of k_hi's heads

The oracle is quant/cache_ops.py:write_reference (SideQuantizer math of quant/kv.py). INT4 keys are chosen per
(layer, KV head): the KV heads pool.k4_heads of a layer with pool.k_hi. Such a layer is a compile-time variant of the
launch (HAS_K4), so layers without INT4 heads run the INT2 code only; in it a head's width is a program-uniform
runtime value (k4_index[h] >= 0): INT4 heads are never clipped (k_clip is the INT2 heads'), qmax 15; INT2 heads as
usual: both count thresholds k + 0.5 up to their qmax.

Decode also hands the write the step's queries (q, q_transform, q_out): q_out = q·T_q per KV head, in a third
program per (token block, head), so that no GEMM runs between the write and the decode (oscar_decode
follows_write / q_from_write chain the CUDA history kernel to this launch through PDL, pdl_trigger).

Grid: (cdiv(T, BLOCK_T), Hkv, 2, or 3 with q): a program does BLOCK_T tokens of one head of one side. The
transform is a [BLOCK_T, D] x [D, D] tl.dot accumulated over BLOCK_K-wide slices of D, so a
D=256 fp32 matrix never has to sit in shared memory whole. Decode-sized calls (T <= 32 by default)
use BLOCK_T = 1, programs of one token (_write_row: x . T as a [BK, D] tile summed over k, the clip's
threshold from one pairwise count; see SMALL_BATCH_TOKENS); 2-8 tokens per program (the interpreter's
tiles for small calls) a broadcast-multiply-sum instead of the dot.

PRECISION. The transform's dots run with input_precision "ieee": true fp32 products (FMA units, no TF32).
Then x' differs from the fp32 oracle only by summation order (~1e-6 relative), window rows match
to ~1e-6 and codes match except where t lies within ~1e-5 of a level midpoint.
There are no host syncs: all sizes come from tensor shapes.

Callers must keep destinations unique within one call: two tokens with the same slot, sink row or
ring row race (no order is defined). For a prefill longer than the window, pass ring rows only for
its last W positions. Tokens of padded batches (CUDA graphs) can point at a scratch slot and -1 rows.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..quant.clip import clip_count
from .layout import WINDOW_DTYPES, LayerCache, check_shape
from .shapes import PDL_SM_MAJOR, has_pdl

try:
    import triton
    import triton.language as tl

    from triton.language.extra.cuda import gdc_launch_dependents

    from .records import k4_row, pool_record

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only without triton
    HAS_TRITON = False

KERNELS = ("triton", "cuda")  # oscar_write_kv(kernel=...): kernels/write_cuda.py for "cuda"


if HAS_TRITON:

    @triton.jit
    def _round_bf16(x):
        """fp32 -> the fp32 value of bf16(x), round to nearest even, done on the bits.

        Same result as the hardware cvt.rn.bf16.f32 for finite x; spelled out because the Triton
        CPU interpreter truncates fp32 -> bf16 casts, which would make CPU tests meaningless.
        """
        b = x.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        return b.to(tl.float32, bitcast=True)

    @triton.jit
    def _e4m3(x):
        """fp32 -> (the fp32 value of float8 e4m3 (x), its byte as uint8): saturated to +-448, then rounded to nearest
        even, as the oracle's x.clamp(-448, 448).to(torch.float8_e4m3fn) and the GPU's cvt.rn.satfinite.e4m3x2.f32.

        Done on the bits because the CPU interpreter's fp8 casts cannot be trusted (and the byte is stored through a
        uint8 view of the params). |x| >= 2^-6 (e4m3 normals): drop 20 of fp32's 23 mantissa bits, rounding to
        nearest even (a carry into the exponent is the next binade). |x| < 2^-6: the e4m3 subnormals, multiples n of
        2^-9 (n in [0, 8]; 8 is 2^-6, whose byte is 8 too): n = mantissa with its implicit bit, shifted right by
        141 − biased exponent, rounded to nearest even (fp32 subnormals and anything below 2^-10 give 0).
        """
        b = x.to(tl.uint32, bitcast=True)
        sign = b & 0x80000000
        a = tl.minimum(b & 0x7FFFFFFF, 0x43E00000)  # |x| saturated at 448 (the bits of non-negative floats sort so)
        r = (a + 0x7FFFF + ((a >> 20) & 1)) & 0xFFF00000  # normals: fp32 bits of the rounded value
        e = (a >> 23).to(tl.int32)
        sh = tl.minimum(tl.maximum(141 - e, 21), 31).to(tl.uint32)  # 21..25 for the subnormal range, 31: 0 result
        mant = (a & 0x7FFFFF) | 0x800000
        n = (mant + (1 << (sh - 1)) - 1 + ((mant >> sh) & 1)) >> sh  # round(|x| / 2^-9), ties to even
        normal = a >= 0x3C800000  # 2^-6
        mag = tl.where(normal, r, (n.to(tl.float32) * 0.001953125).to(tl.uint32, bitcast=True))  # n · 2^-9 exact
        byte = tl.where(normal, (r >> 20) - (120 << 3), n) | (sign >> 24)  # exponent bias 127 -> 7, 3 mantissa bits
        return (mag | sign).to(tl.float32, bitcast=True), byte.to(tl.uint8)

    @triton.jit
    def _key_width(k4_index_ptr, h, HAS_K4: tl.constexpr):
        """(j, qmax) of KV head h's codes on this side: j its row among k_hi's heads (records.k4_row: -1 for INT2
        keys, and on every head without HAS_K4), qmax 15 for INT4 keys, else 3."""
        j = k4_row(k4_index_ptr, h, HAS_K4)
        if HAS_K4:
            return j, tl.where(j >= 0, 15.0, 3.0)
        else:
            return j, 3.0

    @triton.jit
    def _code(t, qmax, ANY_QMAX: tl.constexpr):
        """int32 code = #{k + 0.5 <= t}: ANY_QMAX (the keys of a layer with INT4 heads) up to qmax (3 or 15,
        program-uniform), else the three INT2 thresholds 0.5, 1.5, 2.5."""
        if ANY_QMAX:
            c = tl.minimum(tl.maximum(tl.floor(t + 0.5), 0.0), qmax)
            # t + 0.5 rounds up to the next integer where t lies just below a threshold k + 0.5 (never down: the
            # integers are exact); k + 0.5 and the comparison are exact, so this is the oracle's count
            c = tl.where((c > 0.0) & (t < c - 0.5), c - 1.0, c)
            return c.to(tl.int32)
        else:
            return (t >= 0.5).to(tl.int32) + (t >= 1.5).to(tl.int32) + (t >= 2.5).to(tl.int32)

    @triton.jit
    def _to_window(x, ptr):
        """Cast fp32 rows to the element type of `ptr` (rounded to nearest even)."""
        if ptr.dtype.element_ty == tl.bfloat16:
            return _round_bf16(x).to(tl.bfloat16)
        else:
            return x.to(ptr.dtype.element_ty)

    @triton.jit
    def _write_side(
        x_ptr, stride_xt, stride_xh,
        mat_ptr, stride_mh, mean_ptr, stride_meanh,
        slots_ptr, sink_dst_ptr, ring_dst_ptr,
        codes_ptr, hi_ptr, k4_index_ptr, params_ptr, sink_ptr, ring_ptr,
        T, t0, h,
        H: tl.constexpr, D: tl.constexpr, G: tl.constexpr, HAS_K4: tl.constexpr, H4: tl.constexpr,
        HAS_MAT: tl.constexpr, HAS_MEAN: tl.constexpr, CLIP_N: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, PAGE: tl.constexpr,
    ):
        """BLOCK_T tokens of one head of one side. params_ptr: the params as bytes (uint8 view). HAS_K4 (the keys of a
        layer with INT4 heads): head h is INT4 where k4_index[h] = j >= 0, its code & 3 going to codes_ptr and code >> 2
        to row j of hi_ptr's H4 heads (else both None)."""
        offs_t = t0 + tl.arange(0, BLOCK_T)
        tmask = offs_t < T
        offs_d = tl.arange(0, D)
        x_rows = x_ptr + offs_t.to(tl.int64)[:, None] * stride_xt + h * stride_xh

        # ---- x' = (x - mean) @ T, fp32 ----
        if HAS_MAT:
            acc = tl.zeros((BLOCK_T, D), dtype=tl.float32)
            offs_k = tl.arange(0, BLOCK_K)
            for k0 in tl.static_range(0, D, BLOCK_K):
                xk = tl.load(x_rows + (k0 + offs_k)[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)
                if HAS_MEAN:
                    mu = tl.load(mean_ptr + h * stride_meanh + k0 + offs_k).to(tl.float32)
                    xk = tl.where(tmask[:, None], xk - mu[None, :], 0.0)
                mk = tl.load(mat_ptr + h * stride_mh + (k0 + offs_k)[:, None] * D + offs_d[None, :]).to(tl.float32)
                if BLOCK_T >= 16:
                    acc = tl.dot(xk, mk, acc, input_precision="ieee")
                else:
                    # Decode-sized tiles (tl.dot needs 16 rows): an fp32 broadcast-multiply-sum, i.e.
                    # the same IEEE products, in another summation order.
                    acc += tl.sum(xk[:, :, None] * mk[None, :, :], axis=1)
            xt = acc
        else:
            xt = tl.load(x_rows + offs_d[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)

        # ---- BF16 window copies ----
        row_off = h * D + offs_d[None, :]
        sd = tl.load(sink_dst_ptr + offs_t, mask=tmask, other=-1).to(tl.int64)
        tl.store(sink_ptr + sd[:, None] * (H * D) + row_off, _to_window(xt, sink_ptr), mask=(sd >= 0)[:, None])
        rd = tl.load(ring_dst_ptr + offs_t, mask=tmask, other=-1).to(tl.int64)
        tl.store(ring_ptr + rd[:, None] * (H * D) + row_off, _to_window(xt, ring_ptr), mask=(rd >= 0)[:, None])

        j, qmax = _key_width(k4_index_ptr, h, HAS_K4)

        # ---- per-row clip at the (CLIP_N+1)-th largest |x'| (ties counted like torch.topk) ----
        if CLIP_N > 0:
            a = tl.abs(xt)
            cur = tl.full((BLOCK_T,), float("inf"), tl.float32)
            need = tl.full((BLOCK_T,), CLIP_N + 1, tl.int32)
            tau = tl.zeros((BLOCK_T,), dtype=tl.float32)
            for _ in tl.static_range(CLIP_N + 1):
                v = tl.max(tl.where(a < cur[:, None], a, -1.0), axis=1)
                cnt = tl.sum((a == v[:, None]).to(tl.int32), axis=1)
                tau = tl.where(need > 0, v, tau)
                need = need - cnt
                cur = v
            if HAS_K4:
                tau = tl.where(j >= 0, float("inf"), tau)  # INT4 heads are never clipped
            xt = tl.minimum(tl.maximum(xt, -tau[:, None]), tau[:, None])

        # ---- per-group asymmetric INT2 / INT4 ----
        NG: tl.constexpr = D // G
        xg = tl.reshape(xt, (BLOCK_T, NG, G))
        lo = tl.min(xg, axis=2)
        hi = tl.max(xg, axis=2)
        scale_r, scale_b = _e4m3(tl.math.div_rn(hi - lo, tl.zeros(hi.shape, tl.float32) + qmax))  # stored, as fp32
        min_r, min_b = _e4m3(lo)
        s = scale_r[:, :, None]
        m = min_r[:, :, None]
        pos = s > 0.0
        t = tl.where(pos, tl.math.div_rn(xg - m, tl.where(pos, s, 1.0)), 0.0)
        code = _code(t, qmax, HAS_K4)  # in [0, qmax]

        slot = tl.load(slots_ptr + offs_t, mask=tmask, other=0).to(tl.int64)
        rec = pool_record(slot, h, H, PAGE)  # [BLOCK_T] (slot, head) records (kernels/records.py)
        offs_g = tl.arange(0, NG)
        p_ptr = params_ptr + rec[:, None] * (NG * 2) + offs_g[None, :] * 2
        pmask = tmask[:, None]
        tl.store(p_ptr, scale_b, mask=pmask)
        tl.store(p_ptr + 1, min_b, mask=pmask)

        # ---- quarter-plane pack: byte j = c[j] | c[j+D/4]<<2 | c[j+D/2]<<4 | c[j+3D/4]<<6 (INT4: of code & 3 and,
        # into hi_ptr, of code >> 2) ----
        Q: tl.constexpr = D // 4
        c4 = tl.reshape(code, (BLOCK_T, 4, Q))
        shift = (tl.arange(0, 4) * 2)[None, :, None]
        offs_q = tl.arange(0, Q)
        if HAS_K4:
            tl.store(codes_ptr + rec[:, None] * Q + offs_q[None, :], tl.sum((c4 & 3) << shift, axis=1).to(tl.uint8),
                     mask=pmask)
            rec4 = pool_record(slot, j, H4, PAGE)
            tl.store(hi_ptr + rec4[:, None] * Q + offs_q[None, :], tl.sum((c4 >> 2) << shift, axis=1).to(tl.uint8),
                     mask=pmask & (j >= 0))
        else:
            packed = tl.sum(c4 << shift, axis=1).to(tl.uint8)
            tl.store(codes_ptr + rec[:, None] * Q + offs_q[None, :], packed, mask=pmask)

    @triton.jit
    def _write_row(
        x_ptr, stride_xt, stride_xh,
        mat_ptr, stride_mh, mean_ptr, stride_meanh,
        slots_ptr, sink_dst_ptr, ring_dst_ptr,
        codes_ptr, hi_ptr, k4_index_ptr, params_ptr, sink_ptr, ring_ptr,
        t, h,
        H: tl.constexpr, D: tl.constexpr, G: tl.constexpr, HAS_K4: tl.constexpr, H4: tl.constexpr,
        HAS_MAT: tl.constexpr, HAS_MEAN: tl.constexpr, CLIP_N: tl.constexpr,
        BLOCK_K: tl.constexpr, PAGE: tl.constexpr,
    ):
        """_write_side for one token (BLOCK_T = 1, the decode write), written for its layouts: a [BLOCK_K, D] tile
        of T with the warps along k, so that x' comes out of one cross-warp sum replicated in every warp and the
        row's own reductions below (clip, group min / max, pack) stay inside a warp; and the clip's threshold from
        one comparison of all pairs instead of CLIP_N + 1 max-and-count rounds. Measured: NOTES "The decode write"."""
        offs_n = tl.arange(0, D)
        x_row = x_ptr + t.to(tl.int64) * stride_xt + h * stride_xh

        # ---- x' = (x - mean) @ T, fp32: products summed per k in registers, one reduction over k at the end ----
        if HAS_MAT:
            offs_k = tl.arange(0, BLOCK_K)
            acc = tl.zeros((BLOCK_K, D), dtype=tl.float32)
            for k0 in tl.static_range(0, D, BLOCK_K):
                xk = tl.load(x_row + k0 + offs_k).to(tl.float32)
                if HAS_MEAN:
                    xk = xk - tl.load(mean_ptr + h * stride_meanh + k0 + offs_k).to(tl.float32)
                mk = tl.load(mat_ptr + h * stride_mh + (k0 + offs_k)[:, None] * D + offs_n[None, :]).to(tl.float32)
                acc += xk[:, None] * mk
            xt = tl.sum(acc, axis=0)
        else:
            xt = tl.load(x_row + offs_n).to(tl.float32)

        # ---- BF16 window copies (offs_n < D: the row-shaped mask of a per-token condition) ----
        row_off = h * D + offs_n
        sd = tl.load(sink_dst_ptr + t).to(tl.int64)
        tl.store(sink_ptr + sd * (H * D) + row_off, _to_window(xt, sink_ptr), mask=(offs_n < D) & (sd >= 0))
        rd = tl.load(ring_dst_ptr + t).to(tl.int64)
        tl.store(ring_ptr + rd * (H * D) + row_off, _to_window(xt, ring_ptr), mask=(offs_n < D) & (rd >= 0))

        j, qmax = _key_width(k4_index_ptr, h, HAS_K4)

        # ---- clip at tau = min{|x'_j| : #{i : |x'_i| > |x'_j|} <= CLIP_N}: the (CLIP_N+1)-th largest |x'|, ties
        # counted like torch.topk (the value at that rank has at most CLIP_N strictly above it, anything smaller
        # has at least CLIP_N + 1) ----
        if CLIP_N > 0:
            a = tl.abs(xt)
            above = tl.sum((a[:, None] > a[None, :]).to(tl.int32), axis=0)
            tau = tl.min(tl.where(above <= CLIP_N, a, float("inf")), axis=0)
            if HAS_K4:
                tau = tl.where(j >= 0, float("inf"), tau)  # INT4 heads are never clipped
            xt = tl.minimum(tl.maximum(xt, -tau), tau)

        # ---- per-group asymmetric INT2 / INT4 (the same arithmetic as _write_side) ----
        NG: tl.constexpr = D // G
        xg = tl.reshape(xt, (NG, G))
        lo = tl.min(xg, axis=1)
        hi = tl.max(xg, axis=1)
        scale_r, scale_b = _e4m3(tl.math.div_rn(hi - lo, tl.zeros(hi.shape, tl.float32) + qmax))
        min_r, min_b = _e4m3(lo)
        s = scale_r[:, None]
        m = min_r[:, None]
        pos = s > 0.0
        u = tl.where(pos, tl.math.div_rn(xg - m, tl.where(pos, s, 1.0)), 0.0)
        code = _code(u, qmax, HAS_K4)

        slot = tl.load(slots_ptr + t).to(tl.int64)
        rec = pool_record(slot, h, H, PAGE)
        p_ptr = params_ptr + rec * (NG * 2) + tl.arange(0, NG) * 2
        tl.store(p_ptr, scale_b)
        tl.store(p_ptr + 1, min_b)
        Q: tl.constexpr = D // 4
        c4 = tl.reshape(code, (4, Q))
        shift = (tl.arange(0, 4) * 2)[:, None]
        if HAS_K4:
            tl.store(codes_ptr + rec * Q + tl.arange(0, Q), tl.sum((c4 & 3) << shift, axis=0).to(tl.uint8))
            tl.store(hi_ptr + pool_record(slot, j, H4, PAGE) * Q + tl.arange(0, Q),
                     tl.sum((c4 >> 2) << shift, axis=0).to(tl.uint8), mask=(tl.arange(0, Q) < Q) & (j >= 0))
        else:
            packed = tl.sum(c4 << shift, axis=0).to(tl.uint8)
            tl.store(codes_ptr + rec * Q + tl.arange(0, Q), packed)

    @triton.jit
    def _rotate_q(
        q_ptr, stride_qt, stride_qh, tq_ptr, stride_tqh, qo_ptr,
        T, t0, h,
        GQA: tl.constexpr, GQA_P2: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_KQ: tl.constexpr, LOWP: tl.constexpr,
    ):
        """q' = q . T_q[h] for the GQA query heads of KV head h of BLOCK_T tokens (rows token-major), stored in
        q_out's dtype (rounded to nearest). What transform_query does, in this launch: LOWP (q and T_q both bf16 or
        fp16) a tensor-core dot of them with fp32 accumulation, as its GEMM; else fp32 products."""
        R: tl.constexpr = BLOCK_T * GQA_P2
        offs_r = tl.arange(0, R)
        tok = t0 + offs_r // GQA_P2
        head = h * GQA + offs_r % GQA_P2
        rmask = (tok < T) & (offs_r % GQA_P2 < GQA)
        rows = q_ptr + tok.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
        offs_d = tl.arange(0, D)
        offs_k = tl.arange(0, BLOCK_KQ)
        acc = tl.zeros((R, D), dtype=tl.float32)
        for k0 in tl.static_range(0, D, BLOCK_KQ):
            xk = tl.load(rows + (k0 + offs_k)[None, :], mask=rmask[:, None], other=0.0)
            mk = tl.load(tq_ptr + h * stride_tqh + (k0 + offs_k)[:, None] * D + offs_d[None, :])
            if R >= 16 and LOWP:
                acc = tl.dot(xk, mk, acc)
            elif R >= 16:
                acc = tl.dot(xk.to(tl.float32), mk.to(tl.float32), acc, input_precision="ieee")
            else:
                acc += tl.sum(xk.to(tl.float32)[:, :, None] * mk.to(tl.float32)[None, :, :], axis=1)
        out = qo_ptr + (tok.to(tl.int64)[:, None] * (H * GQA) + head[:, None]) * D + offs_d[None, :]
        tl.store(out, _to_window(acc, qo_ptr), mask=rmask[:, None])

    @triton.jit
    def _oscar_write_kv_kernel(
        k_ptr, stride_kt, stride_kh, v_ptr, stride_vt, stride_vh,
        kmat_ptr, stride_kmh, kmean_ptr, stride_kmeanh, vmat_ptr, stride_vmh,
        slots_ptr, sink_dst_ptr, ring_dst_ptr,
        k_codes_ptr, k_hi_ptr, k4_index_ptr, k_params_ptr, v_codes_ptr, v_params_ptr,
        sink_k_ptr, sink_v_ptr, ring_k_ptr, ring_v_ptr,
        T,
        H: tl.constexpr, D: tl.constexpr, GK: tl.constexpr, GV: tl.constexpr, HAS_K4: tl.constexpr, H4: tl.constexpr,
        HAS_KMEAN: tl.constexpr, HAS_VMAT: tl.constexpr,
        K_CLIP_N: tl.constexpr, V_CLIP_N: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, PAGE: tl.constexpr,
        PDL_TRIGGER: tl.constexpr = False,  # the decode's history kernel may launch now (oscar_write_kv)
        q_ptr=None, stride_qt=0, stride_qh=0, tq_ptr=None, stride_tqh=0, qo_ptr=None,
        HAS_Q: tl.constexpr = False, GQA: tl.constexpr = 1, GQA_P2: tl.constexpr = 1, BLOCK_KQ: tl.constexpr = 8,
        Q_LOWP: tl.constexpr = False,
    ):
        if PDL_TRIGGER:
            gdc_launch_dependents()
        t0 = tl.program_id(0) * BLOCK_T
        h = tl.program_id(1)
        if HAS_Q and tl.program_id(2) == 2:  # the step's queries, rotated here instead of by a GEMM before
            _rotate_q(q_ptr, stride_qt, stride_qh, tq_ptr, stride_tqh, qo_ptr, T, t0, h, GQA, GQA_P2, H, D,
                      BLOCK_T, BLOCK_KQ, Q_LOWP)
        elif BLOCK_T == 1 and tl.program_id(2) == 0:
            _write_row(
                k_ptr, stride_kt, stride_kh, kmat_ptr, stride_kmh, kmean_ptr, stride_kmeanh,
                slots_ptr, sink_dst_ptr, ring_dst_ptr, k_codes_ptr, k_hi_ptr, k4_index_ptr, k_params_ptr,
                sink_k_ptr, ring_k_ptr, t0, h, H, D, GK, HAS_K4, H4, True, HAS_KMEAN, K_CLIP_N, BLOCK_K, PAGE,
            )
        elif BLOCK_T == 1:
            _write_row(
                v_ptr, stride_vt, stride_vh, vmat_ptr, stride_vmh, kmean_ptr, 0,
                slots_ptr, sink_dst_ptr, ring_dst_ptr, v_codes_ptr, None, None, v_params_ptr,
                sink_v_ptr, ring_v_ptr, t0, h, H, D, GV, False, 0, HAS_VMAT, False, V_CLIP_N, BLOCK_K, PAGE,
            )
        elif tl.program_id(2) == 0:
            _write_side(
                k_ptr, stride_kt, stride_kh, kmat_ptr, stride_kmh, kmean_ptr, stride_kmeanh,
                slots_ptr, sink_dst_ptr, ring_dst_ptr, k_codes_ptr, k_hi_ptr, k4_index_ptr, k_params_ptr,
                sink_k_ptr, ring_k_ptr, T, t0, h, H, D, GK, HAS_K4, H4, True, HAS_KMEAN, K_CLIP_N, BLOCK_T, BLOCK_K,
                PAGE,
            )
        else:
            _write_side(
                v_ptr, stride_vt, stride_vh, vmat_ptr, stride_vmh, kmean_ptr, 0,
                slots_ptr, sink_dst_ptr, ring_dst_ptr, v_codes_ptr, None, None, v_params_ptr,
                sink_v_ptr, ring_v_ptr, T, t0, h, H, D, GV, False, 0, HAS_VMAT, False, V_CLIP_N, BLOCK_T, BLOCK_K, PAGE,
            )


def _check_matrix(name: str, m: torch.Tensor, h: int, d: int, device) -> tuple:
    """Return (contiguous fp32 matrix, head stride) for a [D, D] or [H, D, D] transform."""
    if m.dtype != torch.float32:
        raise TypeError(f"{name} must be float32 (the transform is applied in fp32), got {m.dtype}")
    if m.device != device:
        raise ValueError(f"{name} is on {m.device}, the cache on {device}")
    if m.dim() == 3 and m.shape[0] == 1:
        m = m[0]
    if m.dim() == 2 and tuple(m.shape) == (d, d):
        return m.contiguous(), 0
    if m.dim() == 3 and tuple(m.shape) == (h, d, d):
        return m.contiguous(), d * d
    raise ValueError(f"{name} must have shape [{d}, {d}] or [{h}, {d}, {d}], got {tuple(m.shape)}")


def _check_mean(mean: torch.Tensor, h: int, d: int, device) -> tuple:
    if mean.dtype != torch.float32:
        raise TypeError(f"k_mean must be float32, got {mean.dtype}")
    if mean.device != device:
        raise ValueError(f"k_mean is on {mean.device}, the cache on {device}")
    if tuple(mean.shape) == (d,):
        return mean.contiguous(), 0
    if tuple(mean.shape) == (h, d):
        return mean.contiguous(), d
    raise ValueError(f"k_mean must have shape [{d}] or [{h}, {d}], got {tuple(mean.shape)}")


# Up to this many tokens (decode batches) a program handles one token (_write_row): a 16-row dot tile would be mostly
# padding, and one program per (token, head, side) spreads the work over more SMs. Each such program reads its head's
# D x D fp32 matrix (64 KiB at D 128) from L2, so larger batches go back to the dot tiles (H100, Qwen3-8B / 32B: batch
# 32 0.8x the tiles' time, batch 64 1.3x).
SMALL_BATCH_TOKENS = 32
# Up to this many tokens, 16-row dot tiles (more programs) of 8 warps (0.85-0.95x the time of 4 at batch 32-64);
# beyond, the prefill tiles per head_dim.
MID_BATCH_TOKENS = 256
MID_BATCH_WARPS = 8
# The prefill tiles at head_dim 128 (32 rows) with the transform's dot in IEEE fp32: 8 warps. With 4 the fp32 dot's
# [32, 128] accumulator and operands spill (H200, Qwen3-8B 100k tokens, V absorbed: 2.38 ms per layer call against
# 6.16).
PREFILL_D128_WARPS = 8
# Interpreter tiles (default_block_t(..., interpreter=True)): the largest of each path.
INTERPRETER_MAX_SMALL_T = 8
INTERPRETER_MAX_DOT_T = 128


def write_grid(num_tokens: int, kv_heads: int, block_t: int, with_q: bool) -> tuple:
    """oscar_write_kv's launch grid: token tiles x KV heads x (K, V and, with_q, the q programs). The chained decode
    counts these programs (history_cuda.split_count)."""
    return (-(-num_tokens // block_t), kv_heads, 3 if with_q else 2)


def default_block_t(num_tokens: int, head_dim: int, interpreter: bool = False) -> int:
    """Tokens per program: 1 for decode-sized calls (<= SMALL_BATCH_TOKENS), 16 for larger decode
    batches (<= MID_BATCH_TOKENS), else enough rows to feed the dot with few enough registers for
    the [BT, D] tile (prefill).

    interpreter=True (the tensors are on the CPU: Triton's interpreter runs the kernel): larger tiles, because there
    a program costs about the same whatever its tile (Python overhead per op): from 16 rows the GPU's dot path with
    its largest tile (a 150-token prefill 0.17 s instead of 0.84); one token the GPU's one-token program; 2 to
    SMALL_BATCH_TOKENS tokens up to 8 per program without tl.dot (the same math as the one-token programs in other
    layouts, and the max-and-count clip; a decode batch of 8 takes 0.3 s instead of 1.0). The one-token programs
    are tested on the CPU with block_t=1 (test_write.py)."""
    bt = 1 if num_tokens <= SMALL_BATCH_TOKENS else 16 if num_tokens <= MID_BATCH_TOKENS else {
        64: 64, 128: 32, 256: 16}[head_dim]
    if interpreter:
        fit = triton.next_power_of_2(max(num_tokens, 1)) if HAS_TRITON else 1
        bt = min(fit, INTERPRETER_MAX_SMALL_T) if bt < 16 else max(16, min(fit, INTERPRETER_MAX_DOT_T))
    return bt


def default_num_warps(num_tokens: int, head_dim: int, block_t: int) -> int:
    """Warps per program of the Triton write: MID_BATCH_WARPS for the 16-row tiles of mid-sized decode batches,
    PREFILL_D128_WARPS for the 32-row prefill tiles at head_dim 128, else 4."""
    if block_t == 16 and num_tokens <= MID_BATCH_TOKENS:
        return MID_BATCH_WARPS
    if head_dim == 128 and block_t == 32:
        return PREFILL_D128_WARPS
    return 4


def oscar_write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    sink_dst: torch.Tensor,
    ring_dst: torch.Tensor,
    pool: LayerCache,
    *,
    k_transform: torch.Tensor,
    k_mean: Optional[torch.Tensor] = None,
    v_transform: Optional[torch.Tensor] = None,
    k_clip: float = 1.0,
    v_clip: float = 1.0,
    block_t: Optional[int] = None,
    num_warps: Optional[int] = None,
    validate: bool = True,
    pdl_trigger: bool = False,
    q: Optional[torch.Tensor] = None,
    q_transform: Optional[torch.Tensor] = None,
    q_out: Optional[torch.Tensor] = None,
    kernel: str = "triton",
) -> None:
    """Write T tokens of one layer into `pool` (in place). See the module docstring.

    k, v: [T, Hkv, D] post-RoPE rows (bf16/fp16/fp32; last dim contiguous, any token/head stride).
    slots: int64 [T] pool slots (quantized form, always written). sink_dst / ring_dst: int32 [T] rows of
    the sink / ring buffers, −1 = do not write. k_transform: fp32 [D, D] or [Hkv, D, D]; k_mean: fp32
    [D] or [Hkv, D]; v_transform None = V already in its basis. Clip ratios ρ in (0, 1], ρ = 1 no clip.
    The KV heads pool.k4_heads store INT4 keys, never clipped (k_clip is the other heads'). Values are always INT2.
    validate=False skips the (host-only, sync-free) shape checks of the pool for hot loops.
    num_warps None: default_num_warps (8 for the 16-row tiles of decode batches <= MID_BATCH_TOKENS and for the 32-row
    prefill tiles at head_dim 128, else 4; measured, see there).
    pdl_trigger: let the next kernel, launched as a programmatic dependent, start as soon as every program of this
    one has started (griddepcontrol.launch_dependents; sm_90+). Used with oscar_decode(follows_write=True), whose
    CUDA history kernel then streams the old INT2 rows while this write runs; a dependent must still wait
    (griddepcontrol.wait) before it reads what this kernel writes.
    q / q_transform / q_out: also rotate the step's queries, q_out = transform_query(q, q_transform) (decode:
    q [T, Hq, D], one query row set per token; q_transform [D, D] or [Hkv, D, D], fp32 or q's dtype; q_out a
    contiguous [T, Hq, D] tensor of q's dtype), in extra programs of this launch instead of a GEMM before it:
    one kernel less per layer and decode step, and with pdl_trigger nothing between the write and the decode. q and
    T_q both bf16 (or fp16): products in that dtype with fp32 sums, as transform_query's GEMM; else fp32.
    kernel: "triton" (every shape the pool takes) or "cuda" (kernels/write_cuda.py: the decode-sized write in CUDA,
    head_dim 128, bf16 / fp16 k and v, BF16 windows; the same results, its own grid write_cuda.grid; no block_t /
    num_warps). An unsupported call raises; nothing falls back.
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if kernel == "cuda" and (block_t is not None or num_warps is not None):
        raise ValueError("kernel='cuda' has one tile (a CTA per token, head and side): leave block_t and num_warps "
                         "at their defaults")
    if not HAS_TRITON and kernel == "triton":
        raise RuntimeError("oscar_write_kv needs triton")
    if pdl_trigger and not has_pdl(k.device):
        raise ValueError(f"pdl_trigger needs programmatic dependent launch (a CUDA device of sm_{PDL_SM_MAJOR}0 or "
                         "newer)")
    if validate:
        pool.validate()
    h, d = pool.kv_heads, pool.head_dim
    dev = pool.k_codes.device
    for name, x in (("k", k), ("v", v)):
        if x.dim() != 3 or tuple(x.shape[1:]) != (h, d):
            raise ValueError(f"{name} must have shape [T, {h}, {d}], got {tuple(x.shape)}")
        if x.dtype not in WINDOW_DTYPES:
            raise TypeError(f"{name} must be bf16, fp16 or fp32, got {x.dtype}")
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim")
        if x.device != dev:
            raise ValueError(f"{name} is on {x.device}, the cache on {dev}")
    n = k.shape[0]
    if v.shape[0] != n:
        raise ValueError(f"k has {n} tokens, v has {v.shape[0]}")
    for name, idx, dtype in (("slots", slots, torch.int64), ("sink_dst", sink_dst, torch.int32), ("ring_dst", ring_dst, torch.int32)):
        if idx.dtype != dtype or tuple(idx.shape) != (n,) or idx.device != dev:
            raise ValueError(f"{name} must be {dtype} [{n}] on {dev}, got {idx.dtype} {tuple(idx.shape)} on {idx.device}")
    check_shape(d, pool.k_group, "K: ")
    check_shape(d, pool.v_group, "V: ")
    kmat, s_kmh = _check_matrix("k_transform", k_transform, h, d, dev)
    if v_transform is not None:
        vmat, s_vmh = _check_matrix("v_transform", v_transform, h, d, dev)
    else:
        vmat, s_vmh = kmat, 0  # never read
    if k_mean is not None:
        kmean, s_kmeanh = _check_mean(k_mean, h, d, dev)
    else:
        kmean, s_kmeanh = kmat, 0  # never read
    k_n, v_n = clip_count(k_clip, d), clip_count(v_clip, d)
    if n == 0:
        return
    if kernel == "cuda":
        from . import write_cuda

        tq = _check_q(q, q_transform, q_out, n, h, d, dev)
        write_cuda.launch(k, v, slots, sink_dst, ring_dst, pool, kmat=kmat, s_kmh=s_kmh,
                          kmean=kmean if k_mean is not None else None, s_kmeanh=s_kmeanh,
                          vmat=vmat if v_transform is not None else None, s_vmh=s_vmh, k_clip_n=k_n, v_clip_n=v_n,
                          pdl_trigger=pdl_trigger, q=q, q_transform=tq[0] if tq else None,
                          s_tqh=tq[1] if tq else 0, q_out=q_out)
        return
    bt = block_t or default_block_t(n, d, interpreter=pool.k_codes.device.type == "cpu")
    if bt not in (1, 2, 4, 8) and bt < 16 or bt & (bt - 1):
        raise ValueError(f"block_t must be a power of two (1-8: no tl.dot, >= 16: tl.dot), got {bt}")
    # 16+ rows: [BT, 64] x [64, D] dots; one row: a [BK, D] tile of T of 16K elements (the whole T up to D 128);
    # 2-8 rows: [BT, BK, D] products that stay in registers
    bk = min(d, 64) if bt >= 16 else min(d, 16384 // d) if bt == 1 else min(d, 32)
    if num_warps is None:
        num_warps = default_num_warps(n, d, bt)
    qargs = _q_args(q, q_transform, q_out, n, h, d, dev, bt)
    grid = write_grid(n, h, bt, bool(qargs))
    _oscar_write_kv_kernel[grid](
        k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1),
        kmat, s_kmh, kmean, s_kmeanh, vmat, s_vmh,
        slots, sink_dst, ring_dst,
        # the params as bytes: the kernel encodes float8 e4m3 itself (_e4m3)
        pool.k_codes, pool.k_hi, pool.k4_index if pool.has_k4 else None, pool.k_params.view(torch.uint8),
        pool.v_codes, pool.v_params.view(torch.uint8),
        pool.sink_k, pool.sink_v, pool.ring_k, pool.ring_v,
        n,
        H=h, D=d, GK=pool.k_group, GV=pool.v_group, HAS_K4=pool.has_k4,
        H4=pool.k_hi.shape[1] if pool.has_k4 else 0,
        HAS_KMEAN=k_mean is not None, HAS_VMAT=v_transform is not None,
        K_CLIP_N=k_n, V_CLIP_N=v_n,
        BLOCK_T=bt, BLOCK_K=bk, PAGE=pool.page, PDL_TRIGGER=bool(pdl_trigger),
        num_warps=num_warps, **qargs,
    )


def _check_q(q, q_transform, q_out, n: int, h: int, d: int, device) -> Optional[tuple]:
    """(T_q as [D, D] or [Hkv, D, D], its head stride) for oscar_write_kv(q=..., q_transform=..., q_out=...),
    checked; None without q."""
    if q is None and q_transform is None and q_out is None:
        return None
    if q is None or q_transform is None or q_out is None:
        raise ValueError("q, q_transform and q_out go together (the queries rotated in the write's launch)")
    if n > MID_BATCH_TOKENS:
        raise ValueError(f"the write rotates q for decode-sized calls (<= {MID_BATCH_TOKENS} tokens, whose tiles "
                         f"hold a token's query heads in registers); this call has {n}: use transform_query")
    if q.dim() != 3 or q.shape[0] != n or q.shape[2] != d or q.shape[1] % h or q.stride(-1) != 1:
        raise ValueError(f"q must be [{n}, Hq, {d}] (one row set per written token, Hq a multiple of {h}, "
                         f"contiguous in head_dim), got {tuple(q.shape)}")
    if q.device != device or q_out.device != device or q_transform.device != device:
        raise ValueError("q, q_transform and q_out must be on the cache's device")
    if q_out.shape != q.shape or q_out.dtype != q.dtype or not q_out.is_contiguous():
        raise ValueError(f"q_out must be a contiguous {tuple(q.shape)} {q.dtype} tensor")
    if q_transform.dtype not in (torch.float32, q.dtype):
        raise TypeError(f"q_transform must be float32 or q's dtype {q.dtype}, got {q_transform.dtype}")
    t = q_transform[0] if q_transform.dim() == 3 and q_transform.shape[0] == 1 else q_transform
    if t.dim() == 2 and tuple(t.shape) == (d, d):
        stride = 0
    elif t.dim() == 3 and tuple(t.shape) == (h, d, d):
        stride = d * d
    else:
        raise ValueError(f"q_transform must have shape [{d}, {d}] or [{h}, {d}, {d}], got {tuple(q_transform.shape)}")
    return t, stride


def _q_args(q, q_transform, q_out, n: int, h: int, d: int, device, bt: int) -> dict:
    """The Triton kernel's q arguments for oscar_write_kv(q=..., q_transform=..., q_out=...), checked; {} without q."""
    checked = _check_q(q, q_transform, q_out, n, h, d, device)
    if checked is None:
        return {}
    t, stride = checked
    gqa = q.shape[1] // h
    lowp = q.dtype == t.dtype and q.dtype in (torch.bfloat16, torch.float16)
    p2 = triton.next_power_of_2(gqa)
    if lowp and q.is_cuda:
        # pad a token's heads to 16 tile rows: a tensor-core dot instead of the broadcast product (the broadcast took
        # most of the write's time with q at GQA 8)
        p2 = max(p2, 16 // bt)
    rows = bt * p2
    # 16+ rows: tl.dot over 32-wide slices; fewer: a broadcast product [rows, BLOCK_KQ, D] of ~4K fp32 elements
    kq = 32 if rows >= 16 else max(2, min(32, 4096 // (rows * d)))
    return dict(q_ptr=q, stride_qt=q.stride(0), stride_qh=q.stride(1), tq_ptr=t.contiguous(), stride_tqh=stride,
                qo_ptr=q_out, HAS_Q=True, GQA=gqa, GQA_P2=p2, BLOCK_KQ=min(kq, d),
                # bf16 / fp16 q and T_q (the server's decode): a tensor-core dot with fp32 accumulation, as the GEMM
                # of transform_query; the fp32 "ieee" dot measured 34 us at batch 32 (H100) against 11 us without q
                Q_LOWP=lowp)
