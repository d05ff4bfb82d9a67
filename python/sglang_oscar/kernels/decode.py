"""OSCAR mixed-precision decode attention: INT2 history + BF16 sink and recent window.

One query token per request. For a request of length L (the current token already written):

    sink     [0, min(S, L))                    BF16 rows via sink_table[req_to_token[r, pos]]
    history  [S, R)                            INT2 rows at slot req_to_token[r, pos]
    recent   [R, L),  R = max(S, L − W, ring_start[r])   BF16 ring rows r*W + pos % W

Stage 1 (one launch): grid (B·Hkv, NS + 2). Splits 0..NS-1 cut the INT2 history of a request
into NS equal chunks; split NS reads the sink rows, split NS+1 the ring rows. One program holds
every query head of its KV head (the M dimension of the dots), so each K/V byte is read once.
Stage 2: LSE merge of the NS + 2 partial outputs.

INT2 inner loop (the ALU budget, see design/architecture.md): scale and min are folded out,

    q·k̂  = Σ_g scale_g · (q_g · c_g)  +  Σ_g min_g · Σ_{i∈g} q_i
    Σ_t p_t v̂_t = Σ_g Σ_t (p_t·scale_tg) c_t  +  Σ_g (Σ_t p_t·min_tg)

so the dots run on raw codes, and codes become fp16 by OR-ing them into the mantissa of 1024.0
(0x6400) and subtracting 1024 (exact). Quarter-plane packing makes plane p = (byte >> 2p) & 3
the contiguous dims [p·D/4, (p+1)·D/4): four dots over D/4, no reshapes.

The number of splits depends only on shapes (batch, KV heads, req_to_token's width), never on
tensor values: no host sync, CUDA-graph capturable.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from .layout import check_shape

LOG2E = 1.4426950408889634
SUPPORTED_QUERY_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_GQA = 8


# --------------------------------------------------------------------------------------------
# helpers


@triton.jit
def _codes_to_dot(b, SHIFT: tl.constexpr, LEVEL_A: tl.constexpr, CODEBOOK: tl.constexpr, DT: tl.constexpr,
                  FAST_CVT: tl.constexpr):
    """Plane (b >> SHIFT) & 3 of a uint8 tile as the dot dtype; codebook levels 0, a, 3-a, 3."""
    c = (b >> SHIFT) & 3
    if CODEBOOK:
        lo = (c & 1).to(tl.float32)
        hi = (c >> 1).to(tl.float32)
        return (lo * LEVEL_A + hi * (3.0 - LEVEL_A)).to(DT)
    elif FAST_CVT:
        # 0x6400 | c is the fp16 number 1024 + c; subtracting 1024 is exact.
        h = (c.to(tl.int32) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
        return h - 1024.0
    else:
        return c.to(DT)


@triton.jit
def _group_vec(t, cols, g):
    """Column g of a [M, NGP] tile as an [M] vector."""
    return tl.sum(tl.where(cols[None, :] == g, t, 0.0), 1)


# --------------------------------------------------------------------------------------------
# stage 1


@triton.jit
def _int2_split(
    Q, KC, KP, VC, VP, SK, SV, RK, RV, SINK_TABLE, O_PART, LSE_PART,
    split, b, h, r, L, recent_lo, hist_hi, r2t, q_row, out_row, lse_ptr, mask_m, qk_scale,
    HKV: tl.constexpr, D: tl.constexpr, GK: tl.constexpr, GV: tl.constexpr, SINK: tl.constexpr,
    WINDOW: tl.constexpr, NS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, K_A: tl.constexpr, V_A: tl.constexpr, K_CODEBOOK: tl.constexpr,
    V_CODEBOOK: tl.constexpr, DT: tl.constexpr, FAST_CVT: tl.constexpr, NGK: tl.constexpr,
    NGV: tl.constexpr, PPGK: tl.constexpr, PPGV: tl.constexpr, SUBK: tl.constexpr, SUBV: tl.constexpr,
    NGP: tl.constexpr, NGPV: tl.constexpr,
):
    """One split of the INT2 history [SINK, hist_hi)."""
    D4: tl.constexpr = D // 4
    offs_m = tl.arange(0, BLOCK_M)
    # ------------------------------------------------------------ INT2 history

    hist_len = tl.maximum(hist_hi - SINK, 0)
    chunk = tl.cdiv(tl.cdiv(hist_len, NS), BLOCK_N) * BLOCK_N
    lo = SINK + split * chunk
    hi = tl.minimum(lo + chunk, hist_hi)

    offs_j = tl.arange(0, D4)
    qmask = mask_m[:, None]
    q0 = tl.load(q_row[:, None] + 0 * D4 + offs_j[None, :], mask=qmask, other=0.0).to(tl.float32) * qk_scale
    q1 = tl.load(q_row[:, None] + 1 * D4 + offs_j[None, :], mask=qmask, other=0.0).to(tl.float32) * qk_scale
    q2 = tl.load(q_row[:, None] + 2 * D4 + offs_j[None, :], mask=qmask, other=0.0).to(tl.float32) * qk_scale
    q3 = tl.load(q_row[:, None] + 3 * D4 + offs_j[None, :], mask=qmask, other=0.0).to(tl.float32) * qk_scale
    # Σ_{i∈g} q_i per K group, as an [M, NGP] tile (computed from the scaled query)
    offs_d = tl.arange(0, D)
    qfull = tl.load(q_row[:, None] + offs_d[None, :], mask=qmask, other=0.0).to(tl.float32) * qk_scale
    gcols = tl.arange(0, NGP)
    qsum = tl.zeros([BLOCK_M, NGP], tl.float32)
    for g in tl.static_range(NGK):
        qs = tl.sum(tl.where((offs_d // GK)[None, :] == g, qfull, 0.0), 1)
        qsum += tl.where(gcols[None, :] == g, qs[:, None], 0.0)
    q0d = q0.to(DT)
    q1d = q1.to(DT)
    q2d = q2.to(DT)
    q3d = q3.to(DT)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc0 = tl.zeros([BLOCK_M, D4], tl.float32)
    acc1 = tl.zeros([BLOCK_M, D4], tl.float32)
    acc2 = tl.zeros([BLOCK_M, D4], tl.float32)
    acc3 = tl.zeros([BLOCK_M, D4], tl.float32)
    vcols = tl.arange(0, NGPV)
    accmin = tl.zeros([BLOCK_M, NGPV], tl.float32)

    offs_n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n
        mask_n = pos < hi
        slot = tl.load(r2t + pos, mask=mask_n, other=0).to(tl.int64)
        row = slot * HKV + h  # [N]
        kb = tl.load(KC + row[:, None] * D4 + offs_j[None, :], mask=mask_n[:, None], other=0)
        vb = tl.load(VC + row[:, None] * D4 + offs_j[None, :], mask=mask_n[:, None], other=0)
        kprow = KP + row * (NGK * 2)
        vprow = VP + row * (NGV * 2)

        # ---- scores [M, N]
        c0 = _codes_to_dot(kb, 0, K_A, K_CODEBOOK, DT, FAST_CVT)
        c1 = _codes_to_dot(kb, 2, K_A, K_CODEBOOK, DT, FAST_CVT)
        c2 = _codes_to_dot(kb, 4, K_A, K_CODEBOOK, DT, FAST_CVT)
        c3 = _codes_to_dot(kb, 6, K_A, K_CODEBOOK, DT, FAST_CVT)
        if SUBK:
            # group smaller than a plane: scale the codes per column (only D=256, G=32)
            gk0 = (0 * D4 + offs_j) // GK
            gk1 = (1 * D4 + offs_j) // GK
            gk2 = (2 * D4 + offs_j) // GK
            gk3 = (3 * D4 + offs_j) // GK
            sc0 = tl.load(kprow[:, None] + gk0[None, :] * 2, mask=mask_n[:, None], other=0.0).to(DT)
            sc1 = tl.load(kprow[:, None] + gk1[None, :] * 2, mask=mask_n[:, None], other=0.0).to(DT)
            sc2 = tl.load(kprow[:, None] + gk2[None, :] * 2, mask=mask_n[:, None], other=0.0).to(DT)
            sc3 = tl.load(kprow[:, None] + gk3[None, :] * 2, mask=mask_n[:, None], other=0.0).to(DT)
            s = tl.dot(q0d, tl.trans(c0 * sc0))
            s += tl.dot(q1d, tl.trans(c1 * sc1))
            s += tl.dot(q2d, tl.trans(c2 * sc2))
            s += tl.dot(q3d, tl.trans(c3 * sc3))
        else:
            d0 = tl.dot(q0d, tl.trans(c0))
            d1 = tl.dot(q1d, tl.trans(c1))
            d2 = tl.dot(q2d, tl.trans(c2))
            d3 = tl.dot(q3d, tl.trans(c3))
            if PPGK == 1:
                s = d0 * tl.load(kprow + 0 * 2, mask=mask_n, other=0.0).to(tl.float32)[None, :]
                s += d1 * tl.load(kprow + 1 * 2, mask=mask_n, other=0.0).to(tl.float32)[None, :]
                s += d2 * tl.load(kprow + 2 * 2, mask=mask_n, other=0.0).to(tl.float32)[None, :]
                s += d3 * tl.load(kprow + 3 * 2, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            elif PPGK == 2:
                s = (d0 + d1) * tl.load(kprow + 0 * 2, mask=mask_n, other=0.0).to(tl.float32)[None, :]
                s += (d2 + d3) * tl.load(kprow + 1 * 2, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            else:
                s = (d0 + d1 + d2 + d3) * tl.load(kprow, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        for g in tl.static_range(NGK):
            mn = tl.load(kprow + g * 2 + 1, mask=mask_n, other=0.0).to(tl.float32)
            s += _group_vec(qsum, gcols, g)[:, None] * mn[None, :]
        s = tl.where(mask_n[None, :], s, float("-inf"))

        # ---- online softmax (log2 domain)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        acc0 *= alpha[:, None]
        acc1 *= alpha[:, None]
        acc2 *= alpha[:, None]
        acc3 *= alpha[:, None]
        accmin *= alpha[:, None]

        # ---- values
        e0 = _codes_to_dot(vb, 0, V_A, V_CODEBOOK, DT, FAST_CVT)
        e1 = _codes_to_dot(vb, 2, V_A, V_CODEBOOK, DT, FAST_CVT)
        e2 = _codes_to_dot(vb, 4, V_A, V_CODEBOOK, DT, FAST_CVT)
        e3 = _codes_to_dot(vb, 6, V_A, V_CODEBOOK, DT, FAST_CVT)
        if SUBV:
            gv0 = (0 * D4 + offs_j) // GV
            gv1 = (1 * D4 + offs_j) // GV
            gv2 = (2 * D4 + offs_j) // GV
            gv3 = (3 * D4 + offs_j) // GV
            pd = p.to(DT)
            acc0 += tl.dot(pd, e0 * tl.load(vprow[:, None] + gv0[None, :] * 2, mask=mask_n[:, None], other=0.0).to(DT))
            acc1 += tl.dot(pd, e1 * tl.load(vprow[:, None] + gv1[None, :] * 2, mask=mask_n[:, None], other=0.0).to(DT))
            acc2 += tl.dot(pd, e2 * tl.load(vprow[:, None] + gv2[None, :] * 2, mask=mask_n[:, None], other=0.0).to(DT))
            acc3 += tl.dot(pd, e3 * tl.load(vprow[:, None] + gv3[None, :] * 2, mask=mask_n[:, None], other=0.0).to(DT))
        elif PPGV == 1:
            acc0 += tl.dot((p * tl.load(vprow + 0 * 2, mask=mask_n, other=0.0).to(tl.float32)[None, :]).to(DT), e0)
            acc1 += tl.dot((p * tl.load(vprow + 1 * 2, mask=mask_n, other=0.0).to(tl.float32)[None, :]).to(DT), e1)
            acc2 += tl.dot((p * tl.load(vprow + 2 * 2, mask=mask_n, other=0.0).to(tl.float32)[None, :]).to(DT), e2)
            acc3 += tl.dot((p * tl.load(vprow + 3 * 2, mask=mask_n, other=0.0).to(tl.float32)[None, :]).to(DT), e3)
        elif PPGV == 2:
            w01 = (p * tl.load(vprow + 0 * 2, mask=mask_n, other=0.0).to(tl.float32)[None, :]).to(DT)
            w23 = (p * tl.load(vprow + 1 * 2, mask=mask_n, other=0.0).to(tl.float32)[None, :]).to(DT)
            acc0 += tl.dot(w01, e0)
            acc1 += tl.dot(w01, e1)
            acc2 += tl.dot(w23, e2)
            acc3 += tl.dot(w23, e3)
        else:
            w = (p * tl.load(vprow, mask=mask_n, other=0.0).to(tl.float32)[None, :]).to(DT)
            acc0 += tl.dot(w, e0)
            acc1 += tl.dot(w, e1)
            acc2 += tl.dot(w, e2)
            acc3 += tl.dot(w, e3)
        for g in tl.static_range(NGV):
            mn = tl.load(vprow + g * 2 + 1, mask=mask_n, other=0.0).to(tl.float32)
            accmin += tl.where(vcols[None, :] == g, tl.sum(p * mn[None, :], 1)[:, None], 0.0)

    # ---- epilogue: add the min terms, normalise, store
    inv_l = tl.where(l_i > 0, 1.0 / l_i, 0.0)
    for g in tl.static_range(NGV):
        mg = _group_vec(accmin, vcols, g)[:, None]
        acc0 += tl.where(((0 * D4 + offs_j) // GV)[None, :] == g, mg, 0.0)
        acc1 += tl.where(((1 * D4 + offs_j) // GV)[None, :] == g, mg, 0.0)
        acc2 += tl.where(((2 * D4 + offs_j) // GV)[None, :] == g, mg, 0.0)
        acc3 += tl.where(((3 * D4 + offs_j) // GV)[None, :] == g, mg, 0.0)
    tl.store(out_row[:, None] + 0 * D4 + offs_j[None, :], acc0 * inv_l[:, None], mask=qmask)
    tl.store(out_row[:, None] + 1 * D4 + offs_j[None, :], acc1 * inv_l[:, None], mask=qmask)
    tl.store(out_row[:, None] + 2 * D4 + offs_j[None, :], acc2 * inv_l[:, None], mask=qmask)
    tl.store(out_row[:, None] + 3 * D4 + offs_j[None, :], acc3 * inv_l[:, None], mask=qmask)
    lse = tl.where(l_i > 0, m_i + tl.log2(l_i), float("-inf"))
    tl.store(lse_ptr, lse, mask=mask_m)


@triton.jit
def _window_split(
    Q, KC, KP, VC, VP, SK, SV, RK, RV, SINK_TABLE, O_PART, LSE_PART,
    split, b, h, r, L, recent_lo, hist_hi, r2t, q_row, out_row, lse_ptr, mask_m, qk_scale,
    HKV: tl.constexpr, D: tl.constexpr, GK: tl.constexpr, GV: tl.constexpr, SINK: tl.constexpr,
    WINDOW: tl.constexpr, NS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_W: tl.constexpr, WDT: tl.constexpr,
):
    """Split NS: the BF16 sink rows [0, min(L, S)); split NS + 1: the ring rows [recent_lo, L)."""
    # ------------------------------------------------------------ BF16 sink / ring rows
    is_ring = split == NS + 1
    not_ring = split != NS + 1
    lo = tl.where(is_ring, recent_lo, 0)
    hi = tl.where(is_ring, L, tl.minimum(L, SINK))
    offs_d = tl.arange(0, D)
    qmask = mask_m[:, None]
    q = (tl.load(q_row[:, None] + offs_d[None, :], mask=qmask, other=0.0).to(tl.float32) * qk_scale).to(WDT)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    offs_n = tl.arange(0, BLOCK_W)
    for start in range(lo, hi, BLOCK_W):
        pos = start + offs_n
        mask_n = pos < hi
        ring_n = mask_n & is_ring
        sink_n = mask_n & (not_ring)
        slot = tl.load(r2t + pos, mask=sink_n, other=0)
        srow = tl.load(SINK_TABLE + slot, mask=sink_n, other=0).to(tl.int64)
        rrow = r * WINDOW + pos % WINDOW
        soff = (srow * HKV + h)[:, None] * D + offs_d[None, :]
        roff = (rrow * HKV + h)[:, None] * D + offs_d[None, :]
        k = tl.load(SK + soff, mask=sink_n[:, None], other=0.0).to(WDT) + tl.load(
            RK + roff, mask=ring_n[:, None], other=0.0).to(WDT)
        v = tl.load(SV + soff, mask=sink_n[:, None], other=0.0).to(WDT) + tl.load(
            RV + roff, mask=ring_n[:, None], other=0.0).to(WDT)
        s = tl.dot(q, tl.trans(k))
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        acc = acc * alpha[:, None] + tl.dot(p.to(WDT), v)
    inv_l = tl.where(l_i > 0, 1.0 / l_i, 0.0)
    tl.store(out_row[:, None] + offs_d[None, :], acc * inv_l[:, None], mask=qmask)
    lse = tl.where(l_i > 0, m_i + tl.log2(l_i), float("-inf"))
    tl.store(lse_ptr, lse, mask=mask_m)



@triton.jit
def _oscar_decode_stage1(
    Q,  # [B, Hq, D] transformed, any float dtype
    KC, KP, VC, VP,  # codes uint8 [slots, Hkv, D/4]; params bf16 [slots, Hkv, D/G, 2]
    SK, SV, RK, RV,  # sink rows / ring rows [rows, Hkv, D]
    SINK_TABLE,  # int32 [slots]
    REQ_TO_TOKEN, REQ_IDX, SEQ_LENS, RING_START,
    O_PART,  # fp32 [B, Hq, NS_TOTAL, D]
    LSE_PART,  # fp32 [B, Hq, NS_TOTAL] (log2 domain)
    qk_scale,  # sm_scale * log2(e)
    stride_r2t,
    HKV: tl.constexpr, GQA: tl.constexpr, D: tl.constexpr,
    GK: tl.constexpr, GV: tl.constexpr,
    SINK: tl.constexpr, WINDOW: tl.constexpr,
    NS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
    K_A: tl.constexpr, V_A: tl.constexpr, K_CODEBOOK: tl.constexpr, V_CODEBOOK: tl.constexpr,
    DT: tl.constexpr,  # dtype of the INT2 dots (fp16 on GPU, fp32 in the interpreter)
    WDT: tl.constexpr,  # dtype of the BF16-window dots
    FAST_CVT: tl.constexpr,  # codes -> fp16 through the 0x6400 mantissa trick
    NGK: tl.constexpr, NGV: tl.constexpr,  # groups per row
    PPGK: tl.constexpr, PPGV: tl.constexpr,  # planes per group (1 when a group is smaller than a plane)
    SUBK: tl.constexpr, SUBV: tl.constexpr,  # group smaller than a plane (D=256, G=32)
    NGP: tl.constexpr, NGPV: tl.constexpr,  # NGK / NGV padded to >= 16
):
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = pid_bh // HKV
    h = pid_bh % HKV
    NS_TOTAL: tl.constexpr = NS + 2
    D4: tl.constexpr = D // 4

    L = tl.load(SEQ_LENS + b)
    r = tl.load(REQ_IDX + b).to(tl.int64)
    ring_start = tl.load(RING_START + r)
    recent_lo = tl.maximum(tl.maximum(L - WINDOW, SINK), ring_start)
    hist_hi = tl.minimum(recent_lo, L)
    r2t = REQ_TO_TOKEN + r * stride_r2t

    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < GQA
    hq = h * GQA + offs_m
    q_row = Q + (b * (HKV * GQA) + hq) * D  # [M] pointers
    out_row = O_PART + ((b * (HKV * GQA) + hq) * NS_TOTAL + split) * D
    lse_ptr = LSE_PART + (b * (HKV * GQA) + hq) * NS_TOTAL + split

    if split < NS:
        _int2_split(
            Q, KC, KP, VC, VP, SK, SV, RK, RV, SINK_TABLE, O_PART, LSE_PART,
            split, b, h, r, L, recent_lo, hist_hi, r2t, q_row, out_row, lse_ptr, mask_m, qk_scale,
            HKV, D, GK, GV, SINK, WINDOW, NS, BLOCK_M,
            BLOCK_N, K_A, V_A, K_CODEBOOK, V_CODEBOOK, DT, FAST_CVT, NGK, NGV, PPGK, PPGV, SUBK, SUBV, NGP, NGPV,
        )
    else:
        _window_split(
            Q, KC, KP, VC, VP, SK, SV, RK, RV, SINK_TABLE, O_PART, LSE_PART,
            split, b, h, r, L, recent_lo, hist_hi, r2t, q_row, out_row, lse_ptr, mask_m, qk_scale,
            HKV, D, GK, GV, SINK, WINDOW, NS, BLOCK_M,
            BLOCK_W, WDT,
        )


# --------------------------------------------------------------------------------------------
# stage 2


@triton.jit
def _oscar_decode_merge(O_PART, LSE_PART, OUT, NS_TOTAL: tl.constexpr, BLOCK_S: tl.constexpr, D: tl.constexpr):
    pid = tl.program_id(0)  # b * Hq + hq
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, D)
    mask_s = offs_s < NS_TOTAL
    lse = tl.load(LSE_PART + pid * NS_TOTAL + offs_s, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    w = tl.where(mask_s, w, 0.0)
    o = tl.load(O_PART + (pid * NS_TOTAL + offs_s)[:, None] * D + offs_d[None, :], mask=mask_s[:, None], other=0.0)
    o = tl.where(w[:, None] > 0, o, 0.0)  # empty splits: never read their (unwritten-or-zero) rows
    den = tl.sum(w, 0)
    res = tl.sum(o * w[:, None], 0) / tl.where(den > 0, den, 1.0)
    tl.store(OUT + pid * D + offs_d, res.to(OUT.dtype.element_ty))


# --------------------------------------------------------------------------------------------
# host side


def default_num_splits(batch: int, kv_heads: int, max_context: int, num_sms: int = 132, min_tokens: int = 256) -> int:
    """History splits from shapes only: ≥ ~3 waves of programs, ≥ min_tokens INT2 rows per split."""
    want = triton.cdiv(3 * num_sms, max(batch * kv_heads, 1))
    cap = max(1, triton.cdiv(max_context, min_tokens))
    return int(max(1, min(want, cap, 128)))


def transform_query(q: torch.Tensor, q_transform: Optional[torch.Tensor], kv_heads: int) -> torch.Tensor:
    """q·T_q per KV head (T_q = T_K^{-T}), one small fp32 GEMM."""
    if q_transform is None:
        return q
    t = q_transform.float()
    b, hq, d = q.shape
    if t.dim() == 2:
        if t.shape != (d, d):
            raise ValueError(f"q_transform must be [D, D] = [{d}, {d}], got {tuple(t.shape)}")
        return (q.float() @ t).to(q.dtype)
    if t.shape != (kv_heads, d, d):
        raise ValueError(f"q_transform must be [Hkv, D, D] = [{kv_heads}, {d}, {d}], got {tuple(t.shape)}")
    qg = q.float().reshape(b, kv_heads, hq // kv_heads, d)
    return torch.einsum("bhgd,hde->bhge", qg, t).reshape(b, hq, d).to(q.dtype)


def oscar_decode(
    q: torch.Tensor,
    cache,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    ring_start: torch.Tensor,
    *,
    sink: int,
    window: int,
    sm_scale: float,
    q_transform: Optional[torch.Tensor] = None,
    num_splits: Optional[int] = None,
    out: Optional[torch.Tensor] = None,
    k_level_a: Optional[float] = None,
    v_level_a: Optional[float] = None,
    block_n: int = 128,
    block_w: int = 64,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """Decode attention over the mixed cache. q [B, Hq, D] raw (or transformed if q_transform is
    None); returns o [B, Hq, D] in the V-transformed basis, dtype of q (or written into `out`).

    k_level_a / v_level_a: INT2 codebook parameter a (levels 0, a, 3−a, 3); None = uniform.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [B, Hq, D], got {tuple(q.shape)}")
    if q.dtype not in SUPPORTED_QUERY_DTYPES:
        raise ValueError(f"q dtype {q.dtype} is not supported (use one of {SUPPORTED_QUERY_DTYPES})")
    B, Hq, D = q.shape
    Hkv = cache.k_codes.shape[1]
    if cache.k_codes.shape[2] * 4 != D:
        raise ValueError(f"q head_dim {D} does not match the cache's {cache.k_codes.shape[2] * 4}")
    gk = D // cache.k_params.shape[2]
    gv = D // cache.v_params.shape[2]
    check_shape(D, gk, "K: ")
    check_shape(D, gv, "V: ")
    if Hq % Hkv:
        raise ValueError(f"query heads {Hq} are not a multiple of KV heads {Hkv}")
    group = Hq // Hkv
    if group > MAX_GQA:
        raise ValueError(f"GQA group {group} is not supported (at most {MAX_GQA} query heads per KV head)")
    if cache.sink_table is None:
        raise ValueError("oscar_decode needs cache.sink_table")
    if window <= 0:
        raise ValueError("window must be >= 1")
    if cache.ring_k.shape[0] % window:
        raise ValueError(f"ring has {cache.ring_k.shape[0]} rows, not a multiple of window {window}")
    for name, t, dt in (
        ("req_to_token", req_to_token, torch.int32),
        ("seq_lens", seq_lens, torch.int32),
        ("ring_start", ring_start, torch.int32),
    ):
        if t.dtype != dt:
            raise ValueError(f"{name} must be {dt}, got {t.dtype}")
    if req_pool_indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"req_pool_indices must be int32/int64, got {req_pool_indices.dtype}")
    if not req_to_token.is_contiguous() and req_to_token.stride(1) != 1:
        raise ValueError("req_to_token must have unit stride along positions")

    q = transform_query(q, q_transform, Hkv).contiguous()
    ns = num_splits if num_splits is not None else default_num_splits(B, Hkv, req_to_token.shape[1], _num_sms(q.device))
    ns_total = ns + 2
    o_part = torch.empty(B, Hq, ns_total, D, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(B, Hq, ns_total, dtype=torch.float32, device=q.device)
    if out is None:
        out = torch.empty(B, Hq, D, dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {tuple(q.shape)} tensor")

    fp32 = q.dtype == torch.float32
    dt = tl.float32 if fp32 else tl.float16
    wdt = tl.float32 if cache.ring_k.dtype == torch.float32 or fp32 else (
        tl.bfloat16 if cache.ring_k.dtype == torch.bfloat16 else tl.float16
    )
    block_m = max(16, triton.next_power_of_2(group))
    grid = (B * Hkv, ns_total)
    _oscar_decode_stage1[grid](
        q, cache.k_codes, cache.k_params, cache.v_codes, cache.v_params,
        cache.sink_k, cache.sink_v, cache.ring_k, cache.ring_v, cache.sink_table,
        req_to_token, req_pool_indices, seq_lens, ring_start,
        o_part, lse_part,
        float(sm_scale) * LOG2E,
        req_to_token.stride(0),
        HKV=Hkv, GQA=group, D=D, GK=gk, GV=gv, SINK=sink, WINDOW=window, NS=ns,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_W=block_w,
        K_A=float(k_level_a if k_level_a is not None else 1.0),
        V_A=float(v_level_a if v_level_a is not None else 1.0),
        K_CODEBOOK=k_level_a is not None, V_CODEBOOK=v_level_a is not None,
        DT=dt, WDT=wdt, FAST_CVT=not fp32,
        NGK=D // gk, NGV=D // gv,
        PPGK=max(1, gk // (D // 4)), PPGV=max(1, gv // (D // 4)),
        SUBK=gk < D // 4, SUBV=gv < D // 4,
        NGP=max(16, D // gk), NGPV=max(16, D // gv),
        num_warps=num_warps, num_stages=num_stages,
    )
    _oscar_decode_merge[(B * Hq,)](
        o_part, lse_part, out, NS_TOTAL=ns_total, BLOCK_S=triton.next_power_of_2(ns_total), D=D, num_warps=4
    )
    return out


_SM_COUNT = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]
