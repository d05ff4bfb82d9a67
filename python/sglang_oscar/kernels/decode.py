"""OSCAR mixed-precision decode attention: INT2 (or INT4-key) history + BF16 sink and recent window.

One query token per request. For a request of length L (the current token already written):

    sink     [0, min(S, L))                    BF16 rows via sink_table[req_to_token[r, pos]]
    history  [S, R)                            INT2 rows at slot req_to_token[r, pos]
    recent   [R, L),  R = max(S, L − W, ring_start[r])   BF16 ring rows r*W + pos % W

Stage 1 (one launch): grid (B·Hkv, NS + SS + RS). Splits 0..NS-1 cut the INT2 history of a request
into NS equal chunks; splits NS..NS+SS-1 read the sink rows in SS chunks of ceil(S / SS) positions,
splits NS+SS..NS+SS+RS-1 the ring rows in RS chunks of ceil(W / RS) positions (so that no window
program walks all its rows alone: at short contexts and batch 1 it was the longest program,
benchmark/NOTES.md). One program holds every query head of its KV head (the M dimension of the
dots), so each K/V byte is read once.
Stage 2: LSE merge of the NS + SS + RS partial outputs.

Missing sink rows. A sink position whose slot has sink_table[slot] < 0 (the pool ran out of sink
rows: srt/pool.py alloc_sink_rows gives -1 and the slot stays INT2-only; or the slot was written
by a generic set_kv_buffer caller, which writes no BF16 rows) is read as its INT2 form, which
every slot always holds (kernels/write.py writes codes and params for every token, BF16 copies
only where sink_dst / ring_dst >= 0). Stage 1 never indexes the sink buffers with row -1 (it
clamps the row to 0, so its sink partial is garbage for such a request, and flags it with a NaN
LSE); the merge, only where a sink partial is flagged, drops the sink partials and recomputes the
sink range itself: BF16 rows where present, min + scale·level[code] (fp32) where
not. The recompute lives in the merge, not in stage 1, on purpose: stage 1's register allocation
(ptxas) is fragile, and small edits to its window branch slowed the INT2 loop by 5-38% on H100.
Same contract as kernels/gather.py and the oracle (quant/attention.py, missing_sink_int2=True).

GQA. All Hq/Hkv query heads of a KV head share one program: the INT2 split puts them in the N of
its dots, padded to NP = max(4, next_pow2(group)) with the extra columns masked (loads, stores,
softmax), the window splits in M (BLOCK_M = 16). Groups up to MAX_GQA = 16 are supported,
powers of two or not (e.g. 12 for GLM-4.x at any TP: 96 q heads / 8 KV heads). Groups 9..16 run
at NP = 16 (a 12-head group's [BLOCK_N, NP] tiles are 1/4 padding), with 64 tokens per
iteration by default (default_block_n: at 128 the loop spills).

INT2 inner loop (the ALU budget, see docs/design.md): scale and min are folded out,

    q·k̂  = Σ_g scale_g · (q_g · c_g)  +  Σ_g min_g · Σ_{i∈g} q_i
    Σ_t p_t v̂_t = Σ_g Σ_t (p_t·scale_tg) c_t  +  Σ_g (Σ_t p_t·min_tg)

so the dots run on raw codes. A code of plane p enters the dots as the fp16 subnormal code·2^(2p−24):
its byte spread into a halfword and AND-ed with the plane's two bits, one instruction per two codes,
exact; the factor is undone outside the loop (_codes_plane_scaled). Quarter-plane packing
makes plane p = (byte >> 2p) & 3 the contiguous dims [p·D/4, (p+1)·D/4): four dots over D/4, no
reshapes.

Cache format (kernels/layout.py). (scale, min) are float8 e4m3 pairs, read as one 2-, 4- or 8-byte word per 1, 2 or 4
groups (param_words, _param_word) and decoded by integer ops into fp16 bit patterns of 2^-8 times their values
(e4m3_pair, exact; the 2^8 is folded into constants and the per-program query sums). A layer may hold INT4 keys on
some KV heads (k4_heads): code lo | hi << 2, lo in k_codes, hi in k_hi (its own records, k4_index[h] its head
there). Stage 1 and the merge specialise on whether the layer has any (K4, a constexpr): INT2-only
layers run the code without it; with K4 each history program ORs the k_hi plane into the subnormal codes (up to
15·2^(2p−24), _codes_plane_scaled4), its hi loads masked off on a head whose keys are INT2.

Folded tiles (default_fold: where NP < 8 and D <= 128): the m16n8 layout pads a [BLOCK_N, 4] tile's N to 8, so
_int2_split_folded lays the two halves of a block side by side, [BLOCK_N/2, 2·NP], with the K dots
against blockdiag(q, q): no padded softmax work, 168 registers instead of ~250, 6 CTAs per SM.

Plan and run. Every launch decision (split counts, folded tiles, which history kernel, the chain to the
KV write) depends only on shapes (batch, heads, head_dim, req_to_token's width) and the device, never
on tensor values: plan_decode makes them once into a DecodePlan (the server: once per forward batch),
and oscar_decode(..., plan=...) runs a layer on it. No host sync, CUDA-graph capturable.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..config import MAX_GQA
from . import history_cuda, write, write_cuda
from ..quant.intq import PARAM_DTYPE
from .layout import check_shape
from .records import k4_row, pool_record
from .shapes import PDL_SM_MAJOR, has_pdl, window_programs

LOG2E = 1.4426950408889634
SUPPORTED_QUERY_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MIN_NP = 4  # GQA heads padded to a power of two >= this (the N of the dots)
# e4m3_pair gives (scale, min) times 2^-8; the kernels undo it with PARAM_SCALE, folded into constants or
# once-per-program sums where they can
PARAM_SCALE = tl.constexpr(256.0)


# --------------------------------------------------------------------------------------------
# helpers


@triton.jit
def _codes_plane_scaled(b, P: tl.constexpr, FAST_CVT: tl.constexpr, DT: tl.constexpr):
    """Plane P of a uint8 tile as c·2^(2P−24), without an offset ("subnormal codes").

    Fast path: prmt spreads the 4 bytes of a word into the low bytes of 4 halfwords; AND-ing a halfword
    with the plane's two bits (MASK = 0x00030003 << 2P) leaves an fp16 of exponent 0, i.e. the
    subnormal c·2^(2P)·2^-24, exact. That is 1 AND per 2 codes per plane, and the 2 prmt per word are
    the same for all 4 planes (ptxas merges them); an offset form 1 + code/4 (OR-ed into the mantissa of
    1.0) spends shr + lop3 + 2 prmt per 4 codes per plane. The tensor cores take fp16 subnormals as they
    are (the GPU tests compare with the oracle). The per-plane factor 2^(2P−24) is undone outside the
    loop (V: on the accumulator of the sub-plane; K: q is pre-scaled so that all planes of a group share
    one factor)."""
    MASK: tl.constexpr = 0x00030003 << (2 * P)
    if FAST_CVT:
        return tl.inline_asm_elementwise(
            asm=f"""{{
            .reg .b32 t;
            prmt.b32 t, $2, 0, 0x4140;
            and.b32 $0, t, {MASK};
            prmt.b32 t, $2, 0, 0x4342;
            and.b32 $1, t, {MASK};
            }}""",
            constraints="=r,=r,r", args=[b], dtype=tl.float16, is_pure=True, pack=4,
        )
    else:
        return (((b >> (2 * P)) & 3).to(tl.float32) * (1 << (2 * P)) * 5.9604644775390625e-08).to(DT)


@triton.jit
def _codes_plane_scaled4(lo, hi, P: tl.constexpr, FAST_CVT: tl.constexpr, DT: tl.constexpr):
    """Plane P of INT4 key codes c = lo | hi << 2 (lo: a k_codes tile, hi: the same bytes of k_hi) as c·2^(2P−24),
    _codes_plane_scaled's form with codes up to 15: the hi word spread and AND-ed like lo, shifted up two bits and
    OR-ed in (2 more instructions per 2 codes; ptxas shares the prmt and shl of a word across its planes). At P = 3
    the code takes bits 6..9 of the halfword: 15·2^6 < 2^10, still an fp16 subnormal, exact."""
    MASK: tl.constexpr = 0x00030003 << (2 * P)
    if FAST_CVT:
        return tl.inline_asm_elementwise(
            asm=f"""{{
            .reg .b32 t, u;
            prmt.b32 t, $2, 0, 0x4140;
            prmt.b32 u, $3, 0, 0x4140;
            shl.b32 u, u, 2;
            and.b32 t, t, {MASK};
            lop3.b32 $0, u, {MASK << 2}, t, 0xEA;
            prmt.b32 t, $2, 0, 0x4342;
            prmt.b32 u, $3, 0, 0x4342;
            shl.b32 u, u, 2;
            and.b32 t, t, {MASK};
            lop3.b32 $1, u, {MASK << 2}, t, 0xEA;
            }}""",
            constraints="=r,=r,r,r", args=[lo, hi], dtype=tl.float16, is_pure=True, pack=4,
        )
    else:
        c = ((lo >> (2 * P)) & 3) | (((hi >> (2 * P)) & 3) << 2)
        return (c.to(tl.float32) * (1 << (2 * P)) * 5.9604644775390625e-08).to(DT)


@triton.jit
def _key_plane(kb, kh, P: tl.constexpr, DT: tl.constexpr, FAST_CVT: tl.constexpr, K4: tl.constexpr):
    """Plane P of a K code tile kb (and its k_hi tile kh where K4: INT4 keys, see _int2_split) as the K dots take
    it."""
    if K4:
        return _codes_plane_scaled4(kb, kh, P, FAST_CVT, DT)
    else:
        return _codes_plane_scaled(kb, P, FAST_CVT, DT)


@triton.jit
def _f16_bits(x):
    """The low 16 bits of int32 x as an fp16 bit pattern, in fp32 (exact)."""
    return x.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def e4m3_pair(w):
    """(scale, min) of the (scale, min) pair in the low 16 bits of int32 w (scale the low byte: the lower address)
    as fp32, each 2^-8 times its float8 e4m3 value, exactly. An e4m3 byte's sign / 4-bit exponent /
    3-bit mantissa moved into fp16's sign and the low bits of its exponent and top mantissa bits is the fp16 of
    2^-8 times it, subnormals included (exponent bias 15 vs 7); integer ops only, so the CPU interpreter (whose fp8
    casts are not trusted) computes the same bits as the GPU. Callers fold PARAM_SCALE = 2^8 into a constant or a
    once-per-program term where they can."""
    scale = _f16_bits(((w & 0x7F) << 7) | ((w & 0x80) << 8))
    mn = _f16_bits(((w >> 1) & 0x3F80) | (w & 0x8000))
    return scale, mn


@triton.jit
def _param_word(P, row, g: tl.constexpr, NG: tl.constexpr, mask):
    """(scale, min) of group g of each row [N] as e4m3_pair gives them (2^-8 times their values), from one 2-,
    4- or 8-byte load: P is the params viewed as words of min(NG, 4) pairs (param_words); 0 where ~mask."""
    GPW: tl.constexpr = 4 if NG >= 4 else NG
    w = tl.load(P + row * (NG // GPW) + g // GPW, mask=mask, other=0)
    if g % GPW != 0:
        w = w >> (16 * (g % GPW))
    return e4m3_pair(w.to(tl.int32))


@triton.jit
def _tuple_set(t, i: tl.constexpr, v):
    """t with element i replaced by v (Triton tuples have no item assignment)."""
    out = []
    for j in tl.static_range(len(t)):
        if j == i:
            out = out + [v]
        else:
            out = out + [t[j]]
    return out


@triton.jit
def _tuple_add(t, i: tl.constexpr, v):
    return _tuple_set(t, i, t[i] + v)


# --------------------------------------------------------------------------------------------
# stage 1


@triton.jit
def _split_chunk(base_hi, SINK: tl.constexpr, NS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rows per INT2 split: [SINK, base_hi) cut into NS multiples of BLOCK_N."""
    return tl.cdiv(tl.cdiv(tl.maximum(base_hi - SINK, 0), NS), BLOCK_N) * BLOCK_N


@triton.jit
def _split_rows(split, base_hi, hist_hi, SINK: tl.constexpr, NS: tl.constexpr, BLOCK_N: tl.constexpr):
    """History rows [lo, hi) of INT2 split `split` (see _history_end): chunks of [SINK, base_hi), and
    the split that ends at base_hi runs on to its hist_hi (> base_hi only in that program)."""
    chunk = _split_chunk(base_hi, SINK, NS, BLOCK_N)
    lo = SINK + split * chunk
    return lo, tl.minimum(lo + chunk + (hist_hi - base_hi), hist_hi)


@triton.jit
def _history_end(split, L, ring_start_ptr, SINK: tl.constexpr, WINDOW: tl.constexpr, NS: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """(base_hi, hist_hi) of an INT2 program. The history is [SINK, min(max(L − W, SINK, ring_start), L));
    base_hi = min(max(L − W, SINK), L) is its end without ring_start, at most W rows less. The chunks
    cut [SINK, base_hi); the split whose chunk holds base_hi (the last one if base_hi ends the last chunk
    exactly) also takes the rows [base_hi, end) that a ring starting after L − W leaves to INT2. Only
    that program loads ring_start (a predicated load; the others get hist_hi = base_hi), so every other
    program goes from seq_lens / req_pool_indices straight to req_to_token: one dependent load fewer
    before its first codes."""
    base_hi = tl.minimum(tl.maximum(L - WINDOW, SINK), L)
    chunk = _split_chunk(base_hi, SINK, NS, BLOCK_N)
    end = SINK + (split + 1) * chunk
    ext = ((end - chunk <= base_hi) & (base_hi < end)) | ((split == NS - 1) & (base_hi == end))
    ring_start = tl.load(ring_start_ptr, mask=ext, other=0)
    return base_hi, tl.minimum(tl.maximum(base_hi, ring_start), L)


@triton.jit
def _query_sub_planes(q_ptr, q_mask, qk_scale, N: tl.constexpr, D: tl.constexpr, GK: tl.constexpr,
                      NGK: tl.constexpr, CH: tl.constexpr, DT: tl.constexpr):
    """The query as the B operands of the K dots, one per sub-plane sp (dims p·D/4 + k·CH + c), scaled by
    qk_scale in the dot dtype, and the per-group sums [N] of the q that the dots see, times PARAM_SCALE (the
    min terms take the mins as _param_word gives them). q_ptr / q_mask:
    the pointer tile of sub-plane 0 (rows: CH dims, or 2·CH for the folded block diagonal) and its mask.
    All planes of group g share the factor 2^(2 p_g − 24) of its lowest plane p_g, so q of plane p
    is pre-scaled by 4^(p_g − p) (<= 1) and the sums are taken before that scale."""
    D4: tl.constexpr = D // 4
    NCH: tl.constexpr = D4 // CH
    qts = []
    qsum = []
    for g in tl.static_range(NGK):
        qsum = qsum + [tl.zeros([N], tl.float32)]
    for sp in tl.static_range(4 * NCH):
        qt = tl.load(q_ptr + ((sp // NCH) * D4 + (sp % NCH) * CH), mask=q_mask, other=0.0).to(tl.float32)
        p_g = ((((sp // NCH) * D4 + (sp % NCH) * CH) // GK) * GK) // D4
        qts = qts + [(qt * (qk_scale / (1 << (2 * (sp // NCH - p_g))))).to(DT)]
        qsum = _tuple_add(qsum, ((sp // NCH) * D4 + (sp % NCH) * CH) // GK, tl.sum(qt * qk_scale, 0))
    for g in tl.static_range(NGK):
        qsum = _tuple_set(qsum, g, qsum[g] * PARAM_SCALE)
    return qts, qsum


@triton.jit
def _group_scores(d, ks, km, qsum_g, P_G: tl.constexpr):
    """K group g's share of the scores from its dot d = E_g·q: scale and min terms (ks, km broadcast to
    d's shape, 2^-8 times their values; qsum_g [N], times PARAM_SCALE); P_G is the group's lowest plane
    (the subnormal codes' factor 2^(2 P_G − 24))."""
    return d * (ks * ((1 << (24 - 2 * P_G)) * PARAM_SCALE)) + km * qsum_g[None, :]


@triton.jit
def _value_weights(p, vs, vm, DT: tl.constexpr):
    """(w, min term) of a V group for the probabilities p (vs, vm: 2^-8 times their values): the dots'
    weights p·scale in the dot dtype (scaled back first: fp16 would lose small ones), and p·min in fp32, still
    2^-8 times it (_store_split scales the sums)."""
    return (p * (vs * PARAM_SCALE)).to(DT), p * vm


@triton.jit
def _store_split(O_PART, LSE_PART, b, h, split, accs, mins, l_i, m_i,
                 HKV: tl.constexpr, GQA: tl.constexpr, D: tl.constexpr, GV: tl.constexpr, CH: tl.constexpr,
                 NS_TOTAL: tl.constexpr, NP: tl.constexpr):
    """Store one INT2 split's partial output oᵀ per sub-plane (with its V group's min term mins[g] [NP], 2^-8
    times it, normalised by l_i) and its LSE (log2 domain), for the GQA heads of KV head h."""
    D4: tl.constexpr = D // 4
    NCH: tl.constexpr = D4 // CH
    offs_c = tl.arange(0, CH)
    offs_h = tl.arange(0, NP)
    mask_h = offs_h < GQA
    hq = h * GQA + offs_h
    inv_l = tl.where(l_i > 0, 1.0 / l_i, 0.0)
    out_col = O_PART + ((b * (HKV * GQA) + hq) * NS_TOTAL + split) * D  # [NP]
    for sp in tl.static_range(4 * NCH):
        acc = accs[sp] * (1 << (24 - 2 * (sp // NCH)))
        o = (acc + mins[((sp // NCH) * D4 + (sp % NCH) * CH) // GV][None, :] * PARAM_SCALE) * inv_l[None, :]
        tl.store(out_col[None, :] + ((sp // NCH) * D4 + (sp % NCH) * CH) + offs_c[:, None], o, mask=mask_h[None, :])
    lse = tl.where(l_i > 0, m_i + tl.log2(l_i), float("-inf"))
    tl.store(LSE_PART + (b * (HKV * GQA) + hq) * NS_TOTAL + split, lse, mask=mask_h)


@triton.jit
def _int2_block(
    KC, KH, j4, KP, VC, VP, r2t, h, start, hi, qts, qsum, m_i, l_t, accs, accmin,
    HKV: tl.constexpr, D: tl.constexpr, GK: tl.constexpr, GV: tl.constexpr, BLOCK_N: tl.constexpr,
    DT: tl.constexpr, FAST_CVT: tl.constexpr, NGK: tl.constexpr, NGV: tl.constexpr, CH: tl.constexpr,
    PAGE: tl.constexpr, K4: tl.constexpr, H4: tl.constexpr,
):
    """BLOCK_N history rows [start, start + BLOCK_N) of one split: scores, online softmax, V dots; rows >= hi are
    masked."""
    D4: tl.constexpr = D // 4
    NCH: tl.constexpr = D4 // CH
    NSP: tl.constexpr = 4 * NCH
    offs_c = tl.arange(0, CH)
    pos = start + tl.arange(0, BLOCK_N)
    mask_n = pos < hi
    slot = tl.load(r2t + pos, mask=mask_n, other=0).to(tl.int64)
    row = pool_record(slot, h, HKV, PAGE)  # [N] (slot, head) records (kernels/records.py)
    kbs = []
    vbs = []
    for k in tl.static_range(NCH):
        kbs = kbs + [tl.load(KC + row[:, None] * D4 + (k * CH + offs_c)[None, :], mask=mask_n[:, None], other=0)]
    khs = kbs  # K4: the k_hi bytes of the rows (0 for an INT2-key head); unused otherwise
    if K4:
        khs = []
        row4 = pool_record(slot, j4, H4, PAGE)
        mask4 = mask_n & (j4 >= 0)
        for k in tl.static_range(NCH):
            khs = khs + [tl.load(KH + row4[:, None] * D4 + (k * CH + offs_c)[None, :], mask=mask4[:, None], other=0)]
    for k in tl.static_range(NCH):
        # V codes as [CH, BLOCK_N] (dims x tokens): already the A operand of the V dots, so Triton
        # stages the bytes once and converts each plane in registers; a [BLOCK_N, CH] load
        # needs tl.trans of every fp16 plane, one shared-memory round trip per plane
        vbs = vbs + [tl.load(VC + row[None, :] * D4 + (k * CH + offs_c)[:, None], mask=mask_n[None, :], other=0)]

    # ---- scores sᵀ [N, NP]
    s = tl.zeros(l_t.shape, tl.float32)
    for g in tl.static_range(NGK):
        ks, km = _param_word(KP, row, g, NGK, mask_n)
        d = tl.zeros(l_t.shape, tl.float32)
        for sp in tl.static_range(NSP):
            if ((sp // NCH) * D4 + (sp % NCH) * CH) // GK == g:
                e = _key_plane(kbs[sp % NCH], khs[sp % NCH], sp // NCH, DT, FAST_CVT, K4)
                d = tl.dot(e, qts[sp], acc=d)
        s += _group_scores(d, ks[:, None], km[:, None], qsum[g], (g * GK) // D4)
    s = tl.where(mask_n[:, None], s, float("-inf"))

    # ---- online softmax over the tokens (log2 domain)
    m_blk = tl.max(s, 0)
    m_new = tl.maximum(m_i, m_blk)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[None, :])
    l_t = l_t * alpha[None, :] + p
    m_i = m_new

    # ---- values oᵀ [CH, NP] per sub-plane
    for g in tl.static_range(NGV):
        vs, vm = _param_word(VP, row, g, NGV, mask_n)
        w, vmp = _value_weights(p, vs[:, None], vm[:, None], DT)
        accmin = _tuple_set(accmin, g, accmin[g] * alpha[None, :] + vmp)
        for sp in tl.static_range(NSP):
            if ((sp // NCH) * D4 + (sp % NCH) * CH) // GV == g:
                e = _codes_plane_scaled(vbs[sp % NCH], sp // NCH, FAST_CVT, DT)
                accs = _tuple_set(accs, sp, tl.dot(e, w, acc=accs[sp] * alpha[None, :]))
    return m_i, l_t, accs, accmin


@triton.jit
def _int2_split(
    Q, KC, KH, K4_INDEX, KP, VC, VP, O_PART, LSE_PART,
    split, b, h, base_hi, hist_hi, r2t, qk_scale,
    HKV: tl.constexpr, GQA: tl.constexpr, D: tl.constexpr, GK: tl.constexpr, GV: tl.constexpr,
    SINK: tl.constexpr, NS: tl.constexpr, NS_TOTAL: tl.constexpr, NP: tl.constexpr,
    BLOCK_N: tl.constexpr, DT: tl.constexpr, FAST_CVT: tl.constexpr, NGK: tl.constexpr,
    NGV: tl.constexpr, CH: tl.constexpr, PAGE: tl.constexpr, K4: tl.constexpr, H4: tl.constexpr,
):
    """One split of the INT2 history [SINK, hist_hi), transposed: tokens in M, the GQA heads in N
    (padded to NP = next power of two, not 16), so the softmax and the scale / min algebra run on
    [BLOCK_N, NP] tiles. The codes are handled in sub-planes (plane p, byte chunk k of CH bytes):
    each one lies inside exactly one K group and one V group. With the codes as subnormals E_p = code·2^(2p−24)
    (exact in fp16, _codes_plane_scaled):

        sᵀ[t, h] = Σ_g ks_tg·2^(24−2p_g)·(Σ_{sp∈g} E_p q'_spᵀ)[t, h] + km_tg·Qsum_g[h]
        oᵀ[d, h] = 2^(24−2p)·Σ_t E_p[t, d]·(vs_tg·p[t, h]) + Σ_t p[t, h]·vm_tg
    where p_g is the lowest plane of K group g, q'_sp = q_sp·4^(p_g − p) (≤ q: no fp16 overflow) and
    Qsum_g = Σ_{i∈g} q_i.

    K4 (a layer with INT4-key heads, layout.py k4_heads): K codes lo | hi << 2 from k_codes and k_hi (up to 15, the
    same sums); KV head h's hi bytes are at k_hi head K4_INDEX[h], none (hi = 0) where that is -1 (an INT2-key head
    of the layer: its loads masked off)."""
    NSP: tl.constexpr = D // CH  # sub-planes: 4 planes x D/4 / CH byte chunks
    lo, hi = _split_rows(split, base_hi, hist_hi, SINK, NS, BLOCK_N)

    offs_h = tl.arange(0, NP)
    mask_h = offs_h < GQA
    hq = h * GQA + offs_h
    q_col = Q + (b * (HKV * GQA) + hq) * D  # [NP] pointers
    offs_c = tl.arange(0, CH)

    # qᵀ per sub-plane [CH, NP], and the per-group sums of the rounded q
    qts, qsum = _query_sub_planes(q_col[None, :] + offs_c[:, None], mask_h[None, :], qk_scale, NP, D, GK, NGK,
                                  CH, DT)
    j4 = k4_row(K4_INDEX, h, K4)

    m_i = tl.full([NP], float("-inf"), tl.float32)
    l_t = tl.zeros([BLOCK_N, NP], tl.float32)  # per token lane: reduced once, after the loop
    accs = []
    for sp in tl.static_range(NSP):
        accs = accs + [tl.zeros([CH, NP], tl.float32)]
    accmin = []
    for g in tl.static_range(NGV):
        accmin = accmin + [tl.zeros([BLOCK_N, NP], tl.float32)]

    for start in range(lo, hi, BLOCK_N):
        m_i, l_t, accs, accmin = _int2_block(
            KC, KH, j4, KP, VC, VP, r2t, h, start, hi, qts, qsum, m_i, l_t, accs, accmin,
            HKV, D, GK, GV, BLOCK_N, DT, FAST_CVT, NGK, NGV, CH, PAGE, K4, H4,
        )

    # ---- epilogue: reduce the token lanes, then add the min terms, normalise, store oᵀ
    mins = []
    for g in tl.static_range(NGV):
        mins = mins + [tl.sum(accmin[g], 0)]
    _store_split(O_PART, LSE_PART, b, h, split, accs, mins, tl.sum(l_t, 0), m_i,
                 HKV, GQA, D, GV, CH, NS_TOTAL, NP)


@triton.jit
def _fold_pick(a, b, half):
    """[BM] vectors a (tokens of the first half) and b (second half) as a folded [BM, len(half)] tile:
    column j takes a where half[j] == 0, else b (half = j // NP for the score tiles, j // CH for codes)."""
    return tl.where(half[None, :] == 0, a[:, None], b[:, None])


@triton.jit
def _halves_max(x, NP: tl.constexpr):
    """[2·NP] -> [2·NP]: each head's max over the two halves, written to both."""
    m = tl.max(tl.reshape(x, [2, NP]), 0)
    return tl.reshape(tl.broadcast_to(m[None, :], [2, NP]), [2 * NP])


@triton.jit
def _halves_sum(x, NP: tl.constexpr):
    """[2·NP] -> [NP]: each head's sum over the two halves."""
    return tl.sum(tl.reshape(x, [2, NP]), 0)


@triton.jit
def _int2_split_folded(
    Q, KC, KH, K4_INDEX, KP, VC, VP, O_PART, LSE_PART,
    split, b, h, L, ring_start_ptr, r2t, qk_scale,
    HKV: tl.constexpr, GQA: tl.constexpr, D: tl.constexpr, GK: tl.constexpr, GV: tl.constexpr,
    SINK: tl.constexpr, WINDOW: tl.constexpr, NS: tl.constexpr, NS_TOTAL: tl.constexpr, NP: tl.constexpr,
    BLOCK_N: tl.constexpr, DT: tl.constexpr, FAST_CVT: tl.constexpr, NGK: tl.constexpr,
    NGV: tl.constexpr, CH: tl.constexpr, PAGE: tl.constexpr, K4: tl.constexpr, H4: tl.constexpr,
):
    """_int2_split with the two halves of each block of BLOCK_N tokens side by side in N ("folded"):
    the score / softmax / min tiles are [BM = BLOCK_N/2, 2·NP] instead of [BLOCK_N, NP]. With NP = 4
    the m16n8 layout pads N to 8, so half of the unfolded tiles' elementwise work is padding; folded,
    none is. The K dots become E' · blockdiag(q, q): E' [BM, 2·CH] holds the codes of token t in its
    first CH columns and of token t + BM in the next CH, so the MMA count is unchanged. The V dots
    take w unfolded back to [BLOCK_N, NP] (a reshape + permute that Triton folds into the conversion
    to the dot operand). Same math as _int2_split (docstring there)."""
    D4: tl.constexpr = D // 4
    NCH: tl.constexpr = D4 // CH
    NSP: tl.constexpr = 4 * NCH
    BM: tl.constexpr = BLOCK_N // 2
    NPF: tl.constexpr = 2 * NP
    offs_j = tl.arange(0, NPF)
    jh = offs_j % NP  # head of folded column j
    jk = offs_j // NP  # half of folded column j
    offs_c2 = tl.arange(0, 2 * CH)
    ck = offs_c2 // CH
    cc = offs_c2 % CH
    offs_c = tl.arange(0, CH)
    offs_t = tl.arange(0, BM)
    offs_n = tl.arange(0, BLOCK_N)
    q_colj = Q + (b * (HKV * GQA) + h * GQA + jh) * D  # [NPF] pointers
    q_mask = (jh < GQA)[None, :] & (ck[:, None] == jk[None, :])  # block diagonal

    # blockdiag(qᵀ, qᵀ) per sub-plane [2·CH, NPF] (the mask keeps one block per column), so the group
    # sums come out per folded column
    qts, qsum = _query_sub_planes(q_colj[None, :] + cc[:, None], q_mask, qk_scale, NPF, D, GK, NGK, CH, DT)
    j4 = k4_row(K4_INDEX, h, K4)
    # the rows after q's loads: they need seq_lens, q does not (so q's loads are in flight while L arrives)
    base_hi, hist_hi = _history_end(split, L, ring_start_ptr, SINK, WINDOW, NS, BLOCK_N)
    lo, hi = _split_rows(split, base_hi, hist_hi, SINK, NS, BLOCK_N)

    m_i = tl.full([NPF], float("-inf"), tl.float32)  # the same value in both halves of a head
    l_t = tl.zeros([BM, NPF], tl.float32)
    accs = []
    for sp in tl.static_range(NSP):
        accs = accs + [tl.zeros([CH, NP], tl.float32)]
    accmin = []
    for g in tl.static_range(NGV):
        accmin = accmin + [tl.zeros([BM, NPF], tl.float32)]

    for start in range(lo, hi, BLOCK_N):
        pos_a = start + offs_t
        pos_b = pos_a + BM
        mask_a = pos_a < hi
        mask_b = pos_b < hi
        slot_a = tl.load(r2t + pos_a, mask=mask_a, other=0).to(tl.int64)
        slot_b = tl.load(r2t + pos_b, mask=mask_b, other=0).to(tl.int64)
        row_a = pool_record(slot_a, h, HKV, PAGE)  # [BM]
        row_b = pool_record(slot_b, h, HKV, PAGE)
        pos = start + offs_n
        mask_n = pos < hi
        row = pool_record(tl.load(r2t + pos, mask=mask_n, other=0).to(tl.int64), h, HKV, PAGE)  # [BLOCK_N], for V
        row_k = _fold_pick(row_a, row_b, ck)  # [BM, 2·CH]: token t in the first CH columns, t + BM after
        mask_k = _fold_pick(mask_a, mask_b, ck)
        mask_f = _fold_pick(mask_a, mask_b, jk)  # [BM, NPF]
        kbs = []
        vbs = []
        for k in tl.static_range(NCH):
            kbs = kbs + [tl.load(KC + row_k * D4 + (k * CH + cc)[None, :], mask=mask_k, other=0)]
        khs = kbs  # K4: the k_hi bytes of the rows (0 for an INT2-key head); unused otherwise
        if K4:
            khs = []
            row4 = _fold_pick(pool_record(slot_a, j4, H4, PAGE), pool_record(slot_b, j4, H4, PAGE), ck)
            mask4 = mask_k & (j4 >= 0)
            for k in tl.static_range(NCH):
                khs = khs + [tl.load(KH + row4 * D4 + (k * CH + cc)[None, :], mask=mask4, other=0)]
        for k in tl.static_range(NCH):
            vbs = vbs + [tl.load(VC + row[None, :] * D4 + (k * CH + offs_c)[:, None], mask=mask_n[None, :], other=0)]

        # ---- scores, folded [BM, NPF]
        s = tl.zeros([BM, NPF], tl.float32)
        for g in tl.static_range(NGK):
            ks_a, km_a = _param_word(KP, row_a, g, NGK, mask_a)
            ks_b, km_b = _param_word(KP, row_b, g, NGK, mask_b)
            d = tl.zeros([BM, NPF], tl.float32)
            for sp in tl.static_range(NSP):
                if ((sp // NCH) * D4 + (sp % NCH) * CH) // GK == g:
                    e = _key_plane(kbs[sp % NCH], khs[sp % NCH], sp // NCH, DT, FAST_CVT, K4)
                    d = tl.dot(e, qts[sp], acc=d)
            ks = _fold_pick(ks_a, ks_b, jk)
            km = _fold_pick(km_a, km_b, jk)
            s += _group_scores(d, ks, km, qsum[g], (g * GK) // D4)
        s = tl.where(mask_f, s, float("-inf"))

        # ---- online softmax (a head's max over both halves)
        m_new = tl.maximum(m_i, _halves_max(tl.max(s, 0), NP))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)  # [NPF], equal halves
        p = tl.exp2(s - m_safe[None, :])
        l_t = l_t * alpha[None, :] + p
        m_i = m_new
        alpha_h = tl.max(tl.reshape(alpha, [2, NP]), 0)  # [NP]

        # ---- values oᵀ [CH, NP] per sub-plane, w unfolded to [BLOCK_N, NP]
        for g in tl.static_range(NGV):
            vs_a, vm_a = _param_word(VP, row_a, g, NGV, mask_a)
            vs_b, vm_b = _param_word(VP, row_b, g, NGV, mask_b)
            vs = _fold_pick(vs_a, vs_b, jk)
            vm = _fold_pick(vm_a, vm_b, jk)
            wf, vmp = _value_weights(p, vs, vm, DT)
            accmin = _tuple_set(accmin, g, accmin[g] * alpha[None, :] + vmp)
            w = tl.reshape(tl.permute(tl.reshape(wf, [BM, 2, NP]), (1, 0, 2)), [BLOCK_N, NP])
            for sp in tl.static_range(NSP):
                if ((sp // NCH) * D4 + (sp % NCH) * CH) // GV == g:
                    e = _codes_plane_scaled(vbs[sp % NCH], sp // NCH, FAST_CVT, DT)
                    accs = _tuple_set(accs, sp, tl.dot(e, w, acc=accs[sp] * alpha_h[None, :]))

    # ---- epilogue: fold the halves back, then as _int2_split
    mins = []
    for g in tl.static_range(NGV):
        mins = mins + [_halves_sum(tl.sum(accmin[g], 0), NP)]
    _store_split(O_PART, LSE_PART, b, h, split, accs, mins, _halves_sum(tl.sum(l_t, 0), NP),
                 tl.max(tl.reshape(m_i, [2, NP]), 0), HKV, GQA, D, GV, CH, NS_TOTAL, NP)


@triton.jit
def _window_split(
    Q, SK, SV, RK, RV, SINK_TABLE,
    split, r, L, recent_lo, r2t, q_row, out_row, lse_ptr, mask_m, qk_scale, h,
    HKV: tl.constexpr, D: tl.constexpr, SINK: tl.constexpr,
    WINDOW: tl.constexpr, NS: tl.constexpr, SS: tl.constexpr, RS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_W: tl.constexpr, WDT: tl.constexpr,
):
    """Split NS + j (j < SS): sink chunk j of [0, min(L, S)), positions j·ceil(S/SS) on; split
    NS + SS + j (j < RS): ring chunk j of [recent_lo, L), positions recent_lo + j·ceil(W/RS) on
    (either possibly empty: its LSE is then -inf). A sink position without a sink row (sink_table < 0)
    reads row 0 instead (in bounds) and the program stores its LSE as NaN: the merge then discards
    the sink partials and recomputes the sink range."""
    # ------------------------------------------------------------ BF16 sink / ring rows
    is_ring = split >= NS + SS
    not_ring = split < NS + SS
    RING_CHUNK: tl.constexpr = (WINDOW + RS - 1) // RS
    SINK_CHUNK: tl.constexpr = (SINK + SS - 1) // SS
    ring_lo = recent_lo + (split - NS - SS) * RING_CHUNK
    sink_lo = (split - NS) * SINK_CHUNK
    lo = tl.where(is_ring, ring_lo, sink_lo)
    hi = tl.where(is_ring, tl.minimum(ring_lo + RING_CHUNK, L), tl.minimum(tl.minimum(L, SINK), sink_lo + SINK_CHUNK))
    offs_d = tl.arange(0, D)
    qmask = mask_m[:, None]
    q = (tl.load(q_row[:, None] + offs_d[None, :], mask=qmask, other=0.0).to(tl.float32) * qk_scale).to(WDT)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    offs_n = tl.arange(0, BLOCK_W)
    missing = L * 0
    for start in range(lo, hi, BLOCK_W):
        pos = start + offs_n
        mask_n = pos < hi
        ring_n = mask_n & is_ring
        sink_n = mask_n & (not_ring)
        slot = tl.load(r2t + pos, mask=sink_n, other=0)
        srow = tl.load(SINK_TABLE + slot, mask=sink_n, other=0)
        missing += tl.sum((srow < 0).to(tl.int32), 0)
        srow = tl.maximum(srow, 0).to(tl.int64)
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
    tl.store(lse_ptr, tl.where(missing > 0, float("nan"), lse), mask=mask_m)



@triton.jit
def _oscar_decode_stage1(
    Q,  # [B, Hq, D] transformed, any float dtype
    KC, KH, K4_INDEX, KP, VC, VP,  # codes uint8 [slots, Hkv, D/4] (KH, K4_INDEX: k_hi, k4_index, read where K4);
    # params as words (param_words)
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
    NS: tl.constexpr,  # INT2 history splits
    SS: tl.constexpr,  # sink splits
    RS: tl.constexpr,  # ring splits
    BLOCK_M: tl.constexpr, NP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
    DT: tl.constexpr,  # dtype of the INT2 dots (fp16 on GPU, fp32 in the interpreter)
    WDT: tl.constexpr,  # dtype of the BF16-window dots
    FAST_CVT: tl.constexpr,  # codes -> fp16 through inline PTX (GPU, fp16 dots)
    NGK: tl.constexpr, NGV: tl.constexpr,  # groups per row
    CH: tl.constexpr,  # bytes per code chunk: min(GK, GV, D/4)
    FOLD: tl.constexpr,  # the two halves of a block side by side in N (_int2_split_folded)
    WINDOW_ONLY: tl.constexpr,  # a grid of the SS + RS window programs only (after the CUDA history stage)
    PDL_TRIGGER: tl.constexpr,  # let the merge launch now (its programs wait for this grid's writes)
    PAGE: tl.constexpr,  # pool page size: the record rule of kernels/records.py
    K4: tl.constexpr,  # the layer has INT4-key heads (k_codes low planes, KH high planes; layout.py k4_heads)
    H4: tl.constexpr,  # KH's heads
    PDL_WAIT: tl.constexpr = False,  # window programs launched after the CUDA history: exit only after it has
    # (its partials visible), so that the merge's wait on this grid covers both producers
):
    if PDL_TRIGGER:
        gdc_launch_dependents()
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    if WINDOW_ONLY:
        split = split + NS
    b = pid_bh // HKV
    h = pid_bh % HKV
    NS_TOTAL: tl.constexpr = NS + SS + RS

    L = tl.load(SEQ_LENS + b)
    r = tl.load(REQ_IDX + b).to(tl.int64)
    r2t = REQ_TO_TOKEN + r * stride_r2t

    if split < NS:
        if FOLD:
            _int2_split_folded(
                Q, KC, KH, K4_INDEX, KP, VC, VP, O_PART, LSE_PART,
                split, b, h, L, RING_START + r, r2t, qk_scale,
                HKV, GQA, D, GK, GV, SINK, WINDOW, NS, NS_TOTAL, NP,
                BLOCK_N, DT, FAST_CVT, NGK, NGV, CH, PAGE, K4, H4,
            )
        else:
            base_hi, hist_hi = _history_end(split, L, RING_START + r, SINK, WINDOW, NS, BLOCK_N)
            _int2_split(
                Q, KC, KH, K4_INDEX, KP, VC, VP, O_PART, LSE_PART,
                split, b, h, base_hi, hist_hi, r2t, qk_scale,
                HKV, GQA, D, GK, GV, SINK, NS, NS_TOTAL, NP,
                BLOCK_N, DT, FAST_CVT, NGK, NGV, CH, PAGE, K4, H4,
            )
    else:
        recent_lo = tl.maximum(tl.maximum(L - WINDOW, SINK), tl.load(RING_START + r))
        offs_m = tl.arange(0, BLOCK_M)
        mask_m = offs_m < GQA
        hq = h * GQA + offs_m
        q_row = Q + (b * (HKV * GQA) + hq) * D  # [M] pointers
        out_row = O_PART + ((b * (HKV * GQA) + hq) * NS_TOTAL + split) * D
        lse_ptr = LSE_PART + (b * (HKV * GQA) + hq) * NS_TOTAL + split
        _window_split(
            Q, SK, SV, RK, RV, SINK_TABLE,
            split, r, L, recent_lo, r2t, q_row, out_row, lse_ptr, mask_m, qk_scale, h,
            HKV, D, SINK, WINDOW, NS, SS, RS, BLOCK_M, BLOCK_W, WDT,
        )
    if PDL_WAIT:
        gdc_wait()


# --------------------------------------------------------------------------------------------
# stage 2


@triton.jit
def _dequant_rows(C, H, P16, row, row4, use, use4, d0, DN: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
                  FOUR: tl.constexpr):
    """Dims [d0, d0 + DN) of the quantized rows `row` [N] (pool records) as fp32 [N, DN]: min + scale·code;
    0 where ~use. P16: the params as int16 words, one (scale, min) pair each. FOUR: codes lo | hi << 2 (lo from C,
    hi from H at records row4 where use4, else 0: the keys of a layer with INT4-key heads)."""
    D4: tl.constexpr = D // 4
    NG: tl.constexpr = D // G
    offs_d = d0 + tl.arange(0, DN)
    m = use[:, None]
    shift = (2 * (offs_d // D4))[None, :]
    byte = tl.load(C + row[:, None] * D4 + (offs_d % D4)[None, :], mask=m, other=0).to(tl.int32)
    code = (byte >> shift) & 3
    if FOUR:
        hi = tl.load(H + row4[:, None] * D4 + (offs_d % D4)[None, :], mask=use4[:, None], other=0).to(tl.int32)
        code = code | (((hi >> shift) & 3) << 2)
    lvl = code.to(tl.float32)
    w = tl.load(P16 + row[:, None] * NG + (offs_d // G)[None, :], mask=m, other=0)
    scale, mn = e4m3_pair(w.to(tl.int32))
    return tl.where(m, (mn + scale * lvl) * PARAM_SCALE, 0.0)


@triton.jit
def _sink_rows(C, H, j4, P16, S_ROWS, slot, srow, in_sink, h, d0, DN: tl.constexpr, HKV: tl.constexpr,
               D: tl.constexpr, G: tl.constexpr, PAGE: tl.constexpr, FOUR: tl.constexpr, H4: tl.constexpr):
    """Dims [d0, d0 + DN) of sink positions' rows as fp32 [N, DN]: the BF16 sink row where srow >= 0, else
    the quantized form (_dequant_rows; FOUR: hi bytes at head j4 of H's H4 heads, none where j4 < 0)."""
    offs_d = d0 + tl.arange(0, DN)
    has = in_sink & (srow >= 0)
    q = in_sink & (srow < 0)
    x = tl.load(S_ROWS + (srow * HKV + h)[:, None] * D + offs_d[None, :], mask=has[:, None], other=0.0)
    return x.to(tl.float32) + _dequant_rows(C, H, P16, pool_record(slot, h, HKV, PAGE), pool_record(slot, j4, H4, PAGE),
                                            q, q & (j4 >= 0), d0, DN, D, G, FOUR)


@triton.jit
def _oscar_decode_merge(
    O_PART, LSE_PART, OUT,
    Q, KC, KH, K4_INDEX, KP16, VC, VP16, SK, SV, SINK_TABLE, REQ_TO_TOKEN, REQ_IDX, SEQ_LENS, qk_scale, stride_r2t,
    HQ: tl.constexpr, GQA: tl.constexpr, HKV: tl.constexpr, GK: tl.constexpr, GV: tl.constexpr,
    SINK: tl.constexpr, BLOCK_T: tl.constexpr,
    NS: tl.constexpr, SS: tl.constexpr, NS_TOTAL: tl.constexpr, BLOCK_S: tl.constexpr, D: tl.constexpr,
    DC: tl.constexpr,  # output dims per program: program (pid, c) merges dims [c·DC, (c + 1)·DC)
    PDL: tl.constexpr,  # launched as a programmatic dependent of stage 1: wait for its writes here
    PAGE: tl.constexpr,  # pool page size (kernels/records.py), for the sink positions read as INT2
    K4: tl.constexpr,  # the layer has INT4-key heads (KH: their high planes, K4_INDEX: layout.py k4_index)
    H4: tl.constexpr,  # KH's heads
):
    pid = tl.program_id(0)  # b * Hq + hq
    d0 = tl.program_id(1) * DC
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = d0 + tl.arange(0, DC)
    offs_k = tl.arange(0, D)
    mask_s = offs_s < NS_TOTAL
    if PDL:
        gdc_wait()
    lse = tl.load(LSE_PART + pid * NS_TOTAL + offs_s, mask=mask_s, other=float("-inf"))
    # issued before the sink check below, so that the common path waits on one round trip
    o = tl.load(O_PART + (pid * NS_TOTAL + offs_s)[:, None] * D + offs_d[None, :], mask=mask_s[:, None], other=0.0)
    b = pid // HQ
    h = (pid % HQ) // GQA

    # Sink positions without a sink row (rare): the sink programs flag them with a NaN LSE; drop the
    # sink partials and recompute [0, min(L, S)) here as one more partial (m_x, l_x, acc_x): BF16 rows
    # where present, INT2 where not. Flagged in stage 1, so the merge reads no index on the common path.
    sink_part = (offs_s >= NS) & (offs_s < NS + SS)
    n_missing = tl.sum((sink_part & (lse != lse)).to(tl.int32), 0)
    L = tl.load(SEQ_LENS + b)
    n = tl.minimum(L, SINK)
    m_x = tl.max(tl.full([BLOCK_T], float("-inf"), tl.float32), 0)
    l_x = tl.sum(tl.zeros([BLOCK_T], tl.float32), 0)
    acc_x = tl.zeros([DC], tl.float32)
    if n_missing > 0:
        lse = tl.where(sink_part, float("-inf"), lse)
        r2t = REQ_TO_TOKEN + tl.load(REQ_IDX + b).to(tl.int64) * stride_r2t
        q = tl.load(Q + pid * D + offs_k).to(tl.float32) * qk_scale  # scores need all D dims
        j4 = k4_row(K4_INDEX, h, K4)
        for start in range(0, n, BLOCK_T):
            pos = start + tl.arange(0, BLOCK_T)
            in_sink = pos < n
            slot = tl.load(r2t + pos, mask=in_sink, other=0).to(tl.int64)
            srow = tl.load(SINK_TABLE + slot, mask=in_sink, other=0).to(tl.int64)
            k = _sink_rows(KC, KH, j4, KP16, SK, slot, srow, in_sink, h, 0, D, HKV, D, GK, PAGE, K4, H4)
            s = tl.where(in_sink, tl.sum(k * q[None, :], 1), float("-inf"))
            m_new = tl.maximum(m_x, tl.max(s, 0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_x - m_safe)
            p = tl.exp2(s - m_safe)
            v = _sink_rows(VC, VC, 0, VP16, SV, slot, srow, in_sink, h, d0, DC, HKV, D, GV, PAGE, False, 1)
            acc_x = acc_x * alpha + tl.sum(p[:, None] * v, 0)
            l_x = l_x * alpha + tl.sum(p, 0)
            m_x = m_new
    lse_x = tl.where(l_x > 0, m_x + tl.log2(l_x), float("-inf"))

    m = tl.maximum(tl.max(lse, 0), lse_x)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    w = tl.where(mask_s, w, 0.0)
    w_x = tl.exp2(lse_x - m)  # 0 without missing rows
    o = tl.where(w[:, None] > 0, o, 0.0)  # empty / dropped splits: never read their rows
    den = tl.sum(w, 0) + w_x
    num = tl.sum(o * w[:, None], 0) + tl.where(w_x > 0, acc_x / tl.where(l_x > 0, l_x, 1.0), 0.0) * w_x
    res = num / tl.where(den > 0, den, 1.0)
    tl.store(OUT + pid * D + offs_d, res.to(OUT.dtype.element_ty))


# --------------------------------------------------------------------------------------------
# host side


# Split rule of the Triton history (default_num_splits). At least SPLIT_WAVES INT2 programs per SM; at batch 1 (at most
# SMALL_BATCH_HEADS request x KV-head pairs) at least SMALL_BATCH_SPLITS splits (H100, Qwen3-8B heads: 0.84x the time
# of 3 waves' 50 at 128k, 0.93x at 32k); at least SPLIT_MIN_ROWS history rows per split; at most MAX_SPLITS (the
# merge holds all partials of a head in one tile).
SPLIT_WAVES = 3
SMALL_BATCH_HEADS = 8
SMALL_BATCH_SPLITS = 64
SPLIT_MIN_ROWS = 256
MAX_SPLITS = 128
# Folded tiles (the two halves of a block side by side in N) where the GQA heads pad N (NP < 8): the folded loop
# compiles to 168 registers at 128:2:3 (254 unfolded), so capped there 6 CTAs fit per SM. At D 256 it spills under 168
# registers, so it is not folded there.
FOLD_MAXNREG = 168
FOLD_MAX_HEAD_DIM = 128
# GQA groups of 9-16 heads (NP = 16, e.g. GLM-4.x's 12) at D 128: [128, 16] tiles spill at 255 registers; 64 tokens per
# iteration compile to 240 registers without spills.
LARGE_NP_BLOCK_N = 64
# The INT2 loop's warps and pipeline depth (128 tokens, 64 per warp) and the window programs' rows per iteration.
NUM_WARPS, NUM_STAGES, BLOCK_W = 2, 3, 16

# Wave fill. The unfolded loop runs 4 CTAs per SM (<= 255 registers x 64 threads), the folded one 6 (FOLD_MAXNREG),
# so P INT2 programs take ceil(P / (ctas·SMs)) rounds, and ceil(3·SMs / heads) splits can leave the last round nearly
# empty (SmolLM2 batch 64: 192 heads x 3 = 576 programs for 528 slots). When the rounds would be less than FILL_BELOW
# full on average, the smallest larger count (up to 3x) that fills them to FILL_TO is taken, if every split keeps
# >= fill_min_rows rows: FILL_MIN_ROWS unfolded at NP 4 and D 256 (fewer rows per split measured slower), the lower
# LARGE_NP_FILL_MIN_ROWS unfolded at NP >= 8 and D <= 128, FOLD_FILL_MIN_ROWS folded. Folded, when after the fill the
# programs take more than one round and a split holds more than FOLD_LONG_SPLIT_ROWS rows, the count is raised to
# ceil(context / FOLD_LONG_SPLIT_ROWS) and filled again (Qwen3-8B batch 64 at 128k: 3 -> 16 splits, 0.86x the time).
FILL_CTAS_PER_SM = 4
FILL_BELOW = 0.9
FILL_TO = 0.95
FILL_MIN_ROWS = 4096
FOLD_FILL_MIN_ROWS = 512
LARGE_NP_FILL_MIN_ROWS = 1024
FOLD_LONG_SPLIT_ROWS = 8192
# The merge's programs each take >= this many output dims of a query head (default_merge_splits).
MERGE_MIN_DIMS = 32
HISTORY_KERNELS = ("triton", "cuda")


def _rounds_fill(programs: int, slots: int) -> float:
    """programs / (rounds x slots): how full the launch's rounds are on average (1.0 = no idle slot;
    all programs of a round are taken as equally long)."""
    return programs / (triton.cdiv(programs, slots) * slots)


def _split_cap(max_context: int) -> int:
    """The most history splits of a context: SPLIT_MIN_ROWS rows each, at most MAX_SPLITS."""
    return max(1, min(triton.cdiv(max_context, SPLIT_MIN_ROWS), MAX_SPLITS))


def _wave_splits(batch: int, kv_heads: int, max_context: int, num_sms: int) -> int:
    """default_num_splits before its wave fill: >= SPLIT_WAVES programs per SM, >= SMALL_BATCH_SPLITS splits where
    batch x kv_heads <= SMALL_BATCH_HEADS, within _split_cap."""
    heads = max(batch * kv_heads, 1)
    want = triton.cdiv(SPLIT_WAVES * num_sms, heads)
    if heads <= SMALL_BATCH_HEADS:
        want = max(want, SMALL_BATCH_SPLITS)
    return int(min(want, _split_cap(max_context)))


def default_num_splits(batch: int, kv_heads: int, max_context: int, num_sms: int = 132,
                       ctas_per_sm: int = FILL_CTAS_PER_SM, fill_min_rows: int = FILL_MIN_ROWS,
                       long_split_rows: Optional[int] = None) -> int:
    """History splits from shapes only: the waves rule (_wave_splits), then the wave-fill step above, for
    `ctas_per_sm` resident programs per SM and splits of >= fill_min_rows rows, then the long-split step (and the
    fill again) when long_split_rows is set; both may raise the count above SPLIT_WAVES programs per SM (never above
    _split_cap)."""
    heads = max(batch * kv_heads, 1)
    cap = _split_cap(max_context)
    ns = _wave_splits(batch, kv_heads, max_context, num_sms)
    slots = ctas_per_sm * num_sms

    def filled(ns):
        if _rounds_fill(heads * ns, slots) < FILL_BELOW:
            for n in range(ns + 1, min(3 * ns, cap) + 1):
                if max_context < n * fill_min_rows:
                    break
                if _rounds_fill(heads * n, slots) >= FILL_TO:
                    return n
        return ns

    ns = filled(ns)
    if long_split_rows and heads * ns > slots and max_context > ns * long_split_rows:
        ns = filled(int(min(triton.cdiv(max_context, long_split_rows), cap)))
    return ns


def default_window_splits(heads: int, num_splits: int, sink: int, window: int, slots: int) -> tuple:
    """(sink programs, ring programs) per (request, KV head): shapes.window_programs, halved once where that brings a
    launch whose INT2 programs fit one round of `slots` resident programs, but whose window programs spill past it,
    back into one round (so no window program trails the round, and the merge launches early through PDL). H100,
    Qwen3-8B batch 1 at 64k (95 splits + 8 window programs per head = 824 programs for 792 slots): 0.95x the time;
    halving to 1 + 1 measured slower (the 256-row ring program gets longest)."""
    ss, rs = window_programs(sink, window)
    if heads * num_splits <= slots < heads * (num_splits + ss + rs):
        ss2, rs2 = triton.cdiv(ss, 2), triton.cdiv(rs, 2)
        if heads * (num_splits + ss2 + rs2) <= slots:
            return ss2, rs2
    return ss, rs


def default_merge_splits(query_heads: int, head_dim: int, num_sms: int = 132) -> int:
    """Merge programs per query head: where the B·Hq heads leave SMs idle (small batch), split each head's
    D output dims over up to num_sms / (B·Hq) programs (a power of two, >= MERGE_MIN_DIMS dims each), so
    that each program loads a slice of the partials instead of all of them."""
    n = 1
    while 2 * n * query_heads <= num_sms and head_dim // (2 * n) >= MERGE_MIN_DIMS:
        n *= 2
    return n


def default_block_n(np_: int, head_dim: int) -> int:
    """Tokens per INT2 iteration: 128, LARGE_NP_BLOCK_N where NP >= 16 and D <= 128."""
    return LARGE_NP_BLOCK_N if np_ >= 16 and head_dim <= 128 else 128


def default_fold(np_: int, head_dim: int, block_n: int) -> bool:
    """Folded tiles where N is padded (NP < 8) and the folded loop fits FOLD_MAXNREG (D <= FOLD_MAX_HEAD_DIM), with a
    block_n the folded dots take (a multiple of 32)."""
    return np_ < 8 and head_dim <= FOLD_MAX_HEAD_DIM and block_n >= 32 and block_n % 32 == 0


def param_words(params: torch.Tensor, ng: int) -> torch.Tensor:
    """A params buffer (float8 (scale, min) pairs, ng groups per record) viewed as words of min(ng, 4) pairs: int16,
    int32 or int64, the one load per group (or per 2 or 4 groups) of _param_word; ng 1: one pair per int16 word, as
    _dequant_rows reads any ng."""
    per = min(ng, 4)
    return params.reshape(-1, 2 * per).view({1: torch.int16, 2: torch.int32, 4: torch.int64}[per])


def transform_query(q: torch.Tensor, q_transform: Optional[torch.Tensor], kv_heads: int) -> torch.Tensor:
    """q·T_q per KV head (T_q = T_K^{-T}).

    T_q in fp32 (any q): fp32 product, cast back to q's dtype. T_q already in q's dtype (decode keeps a
    bf16 copy): one GEMM in that dtype with fp32 accumulation and no casts — one kernel instead of four
    per layer and step (measured 0.3 ms of a 100k-context Qwen3-8B decode step on H100)."""
    if q_transform is None:
        return q
    b, hq, d = q.shape
    t = q_transform
    low = t.dtype == q.dtype and t.dtype in (torch.bfloat16, torch.float16)
    if not low:
        t = t.float()
    if t.dim() == 2:
        if t.shape != (d, d):
            raise ValueError(f"q_transform must be [D, D] = [{d}, {d}], got {tuple(t.shape)}")
        return q @ t if low else (q.float() @ t).to(q.dtype)
    if t.shape != (kv_heads, d, d):
        raise ValueError(f"q_transform must be [Hkv, D, D] = [{kv_heads}, {d}, {d}], got {tuple(t.shape)}")
    if low:  # [Hkv, B, G, D] @ [Hkv, D, D]: one batched GEMM
        qg = q.reshape(b, kv_heads, hq // kv_heads, d).transpose(0, 1)
        return torch.matmul(qg, t[:, None]).transpose(0, 1).reshape(b, hq, d)
    qg = q.float().reshape(b, kv_heads, hq // kv_heads, d)
    return torch.einsum("bhgd,hde->bhge", qg, t).reshape(b, hq, d).to(q.dtype)


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """The launch decisions of decode calls of one shape (plan_decode), reused by every layer of a forward batch.

    Everything here follows from shapes and the device, never from tensor values, so a plan holds for every replay
    of a CUDA graph captured with it."""

    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int
    max_context: int  # req_to_token's width
    history_kernel: str  # "triton" (this module's loop) or "cuda" (history_cuda.py)
    num_splits: int  # INT2 history splits per (request, KV head)
    sink_splits: int  # window partials per (request, KV head); (0, 0): the window is folded into the CUDA history
    ring_splits: int
    merge_splits: int  # merge programs per query head
    block_n: int  # Triton INT2 loop: tokens per iteration
    fold: bool  # Triton INT2 loop: folded tiles (_int2_split_folded)
    fold_window: bool  # CUDA: the window folded into the history CTAs (history_cuda.folds)
    window_in_cuda: bool  # CUDA: the kernel reads the window itself (history_cuda.fuses_window)
    pdl: bool  # the merge (and window programs after the CUDA history) launched as programmatic dependents
    follows_write: bool  # the CUDA history launched as this step's KV write's programmatic dependent
    q_from_write: bool  # ... whose launch also rotated q
    write_kernel: str  # that write's kernel ("triton" / "cuda"), whose programs the chained split count leaves room for
    maxnreg: Optional[int]  # register cap of the Triton stage 1

    @property
    def gqa(self) -> int:
        return self.q_heads // self.kv_heads

    @property
    def ns_total(self) -> int:
        return self.num_splits + self.sink_splits + self.ring_splits


def plan_decode(batch: int, q_heads: int, kv_heads: int, head_dim: int, max_context: int, device, *, sink: int,
                window: int, history_kernel: str = "triton", follows_write: bool = False, q_from_write: bool = False,
                write_kernel: str = "triton", num_splits: Optional[int] = None, block_n: Optional[int] = None,
                sink_splits: Optional[int] = None, ring_splits: Optional[int] = None,
                merge_splits: Optional[int] = None) -> DecodePlan:
    """Every launch decision of a decode call of batch `batch`, from shapes and the device only.

    history_kernel: "triton" (every supported shape) or "cuda" (history_cuda.py: the shapes kernels/shapes.py gives
    it, checked by oscar_decode against the cache). follows_write: the kernel launched just before the call is this
    step's KV write (kernels/write.py oscar_write_kv(..., pdl_trigger=True)) and q, already transformed and contiguous,
    was written before it: the CUDA history kernel is launched as the write's programmatic dependent (sm_90+); its
    history CTAs read q, the indices and the old INT2 rows while the write runs, its window CTAs wait for the write.
    q_from_write (with follows_write): q is that write's q_out, so the history CTAs issue their first copies, then
    wait for the write before they read q. write_kernel: that write's kernel, whose grid (write.write_grid,
    write_cuda.grid) the chained split count takes as the SM slots the write holds.

    The rest fix what the rules would choose, for tests of edges: num_splits (INT2 history splits per request and KV
    head), block_n (Triton tokens per iteration: 128, 64 where NP >= 16), sink_splits / ring_splits (the Triton window
    programs; the CUDA history reads the window itself at D 128), merge_splits (a power of two, D / merge_splits >=
    MERGE_MIN_DIMS)."""
    if history_kernel not in HISTORY_KERNELS:
        raise ValueError(f"history_kernel must be 'triton' or 'cuda', got {history_kernel!r}")
    if kv_heads < 1 or q_heads % kv_heads:
        raise ValueError(f"query heads {q_heads} are not a multiple of KV heads {kv_heads}")
    group = q_heads // kv_heads
    if group > MAX_GQA:
        raise ValueError(f"GQA group {group} ({q_heads} query heads / {kv_heads} KV heads) is not supported: the int2 "
                         f"decode kernel holds at most {MAX_GQA} query heads per KV head")
    if window <= 0:
        raise ValueError("window must be >= 1")
    device = torch.device(device)
    hist_cuda = history_kernel == "cuda"
    if follows_write:
        if not hist_cuda:
            raise ValueError("follows_write launches the CUDA history kernel as the KV write's programmatic "
                             "dependent: it needs history_kernel='cuda'")
        if not has_pdl(device):
            raise ValueError(f"follows_write needs programmatic dependent launch (sm_{PDL_SM_MAJOR}0 or newer)")
    elif q_from_write:
        raise ValueError("q_from_write qualifies follows_write (the history kernel chained to the write that "
                         "rotated q); without follows_write the launch waits for the write anyway")
    window_in_cuda = hist_cuda and history_cuda.fuses_window(head_dim)
    if window_in_cuda and (ring_splits is not None or sink_splits is not None):
        raise ValueError("ring_splits / sink_splits set the Triton window programs; history_kernel='cuda' reads "
                         "the window in its own CTAs (history_cuda.window_ctas)")
    on_gpu = device.type == "cuda"
    if hist_cuda and not on_gpu:
        raise ValueError("history_kernel='cuda' needs CUDA tensors")
    sms = _num_sms(device)
    np_ = max(MIN_NP, triton.next_power_of_2(group))
    if block_n is None:
        block_n = default_block_n(np_, head_dim)
    fold = default_fold(np_, head_dim, block_n)
    maxnreg = FOLD_MAXNREG if fold and on_gpu else None
    # resident stage-1 programs per SM if registers bound them (4 at 128:2:3, 6 folded), for the wave fill
    ctas = max(1, 65536 // ((FOLD_MAXNREG if fold else 256) * 32 * NUM_WARPS))
    fold_window = False
    if num_splits is None:
        if hist_cuda:
            chained = None  # chained: the write's programs of this step's tokens hold SM slots at the launch
            if follows_write:
                if write_kernel == "cuda":
                    chained = math.prod(write_cuda.grid(batch, kv_heads, group if q_from_write else None))
                else:
                    chained = math.prod(write.write_grid(batch, kv_heads, write.default_block_t(batch, head_dim),
                                                         q_from_write))
            num_splits, fold_window = history_cuda.plan(batch, kv_heads, group, max_context, sms, sink, window,
                                                        chained, head_dim=head_dim)
        else:
            if fold:
                rule = dict(fill_min_rows=FOLD_FILL_MIN_ROWS, long_split_rows=FOLD_LONG_SPLIT_ROWS)
            elif np_ >= 8 and head_dim <= 128:
                rule = dict(fill_min_rows=LARGE_NP_FILL_MIN_ROWS)
            else:
                rule = {}
            num_splits = default_num_splits(batch, kv_heads, max_context, sms, ctas_per_sm=ctas, **rule)
    elif window_in_cuda:
        fold_window = history_cuda.folds(num_splits, sink, window, head_dim)  # an explicit count folds by the rule
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    slots = ctas * sms  # stage-1 programs resident at once (one round)
    if fold_window:
        ss, rs = 0, 0
    elif window_in_cuda:
        ss, rs = history_cuda.window_ctas(sink, window)
    else:
        ss, rs = default_window_splits(batch * kv_heads, num_splits, sink, window, slots)
        ss = ss if sink_splits is None else sink_splits
        rs = rs if ring_splits is None else ring_splits
        if rs < 1:
            raise ValueError(f"ring_splits must be >= 1, got {rs}")
        if ss < 1:
            raise ValueError(f"sink_splits must be >= 1, got {ss}")
    ns_total = num_splits + ss + rs
    if merge_splits is None:
        # Split a head's D over programs only where they run in parallel: the Triton interpreter (CPU) runs
        # programs one after another, and each costs the same fixed overhead (one program per head: -14% of a
        # CPU server's decode step at batch 8)
        merge_splits = default_merge_splits(batch * q_heads, head_dim, sms) if on_gpu else 1
    if merge_splits < 1 or merge_splits & (merge_splits - 1) or head_dim // merge_splits < MERGE_MIN_DIMS:
        raise ValueError(f"merge_splits must be a power of two with D / merge_splits >= {MERGE_MIN_DIMS} "
                         f"(D = {head_dim}), got {merge_splits}")
    # PDL chains the merge to the one stage-1 launch where its grid fits one round (no gain measured otherwise). After
    # the CUDA history (it lets its dependents launch at once) the merge follows it at any grid size: the window is
    # read in the same grid, or by the Triton window programs launched as its dependents (they run in the SM slots its
    # CTAs free and exit only after it has).
    pdl = on_gpu and (hist_cuda or batch * kv_heads * ns_total <= slots)
    return DecodePlan(batch, q_heads, kv_heads, head_dim, max_context, history_kernel, num_splits, ss, rs,
                      merge_splits, block_n, fold, fold_window, window_in_cuda, pdl, follows_write, q_from_write,
                      write_kernel if follows_write else "triton", maxnreg)


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
    out: Optional[torch.Tensor] = None,
    plan: Optional[DecodePlan] = None,
    **plan_args,
) -> torch.Tensor:
    """Decode attention over the mixed cache. q [B, Hq, D] raw (or transformed if q_transform is
    None); returns o [B, Hq, D] in the V-transformed basis, dtype of q (or written into `out`).

    The params must be float8 e4m3 (kernels/layout.py).
    plan: the launch decisions (plan_decode) of this call's shape; None: plan_decode(**plan_args) for this call
    (history_kernel, follows_write, q_from_write, write_kernel, num_splits, block_n, sink_splits, ring_splits,
    merge_splits: see there). With follows_write, q must already be transformed (q_transform None) and contiguous: a
    kernel between the write and this call would write q while the history kernel reads it; the caller guarantees
    the order (the server's backend does, srt/backend.py)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [B, Hq, D], got {tuple(q.shape)}")
    if q.dtype not in SUPPORTED_QUERY_DTYPES:
        raise ValueError(f"q dtype {q.dtype} is not supported (use one of {SUPPORTED_QUERY_DTYPES})")
    B, Hq, D = q.shape
    Hkv = cache.k_codes.shape[1]
    if cache.head_dim != D:
        raise ValueError(f"q head_dim {D} does not match the cache's {cache.head_dim}")
    gk = D // cache.k_params.shape[-2]
    gv = D // cache.v_params.shape[-2]
    check_shape(D, gk, "K: ")
    check_shape(D, gv, "V: ")
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
    for name, t in (("k_params", cache.k_params), ("v_params", cache.v_params)):
        if t.dtype != PARAM_DTYPE:
            raise ValueError(f"{name} must be {PARAM_DTYPE} (the cache format, kernels/layout.py), got {t.dtype}")
    follows = plan.follows_write if plan is not None else plan_args.get("follows_write", False)
    if follows and (q_transform is not None or not q.is_contiguous()):
        raise ValueError("follows_write: transform q (transform_query) and make it contiguous before the KV "
                         "write, and pass q_transform=None; a kernel between the write and this call would "
                         "write q while the history kernel reads it")
    if plan is None:
        if plan_args.get("history_kernel") == "cuda":  # the shape first: its refusal names what the stage covers
            history_cuda.check_supported(D, Hq // Hkv, gk, gv, None, window_dtype=cache.ring_k.dtype)
        plan = plan_decode(B, Hq, Hkv, D, req_to_token.shape[1], q.device, sink=sink, window=window, **plan_args)
    elif plan_args:
        raise ValueError(f"pass either a plan or plan_decode's arguments, not both ({sorted(plan_args)})")
    elif (plan.batch, plan.q_heads, plan.kv_heads, plan.head_dim, plan.max_context) != (B, Hq, Hkv, D,
                                                                                       req_to_token.shape[1]):
        raise ValueError(f"the plan is for batch {plan.batch}, {plan.q_heads} / {plan.kv_heads} heads, head_dim "
                         f"{plan.head_dim}, req_to_token width {plan.max_context}; this call has {B}, {Hq} / {Hkv}, "
                         f"{D}, {req_to_token.shape[1]}")
    hist_cuda = plan.history_kernel == "cuda"
    if hist_cuda:
        history_cuda.check_supported(D, plan.gqa, gk, gv, q.device, window_dtype=cache.ring_k.dtype)
    q = transform_query(q, q_transform, Hkv).contiguous()
    ns, ss, rs, ns_total = plan.num_splits, plan.sink_splits, plan.ring_splits, plan.ns_total
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
    group = plan.gqa
    block_m = max(16, triton.next_power_of_2(group))
    ngk, ngv = D // gk, D // gv
    k4 = cache.k_hi is not None
    # not read unless K4
    k_hi, k4_index = (cache.k_hi, cache.k4_index) if k4 else (cache.k_codes, cache.sink_table)
    h4 = cache.k_hi.shape[1] if k4 else 1
    sink_k, sink_v = cache.sink_k, cache.sink_v
    if sink_k.shape[0] == 0:  # no sink rows at all: stage 1 clamps row -1 to 0, which must exist
        sink_k = sink_v = torch.zeros(1, Hkv, D, dtype=sink_k.dtype, device=sink_k.device)
    if hist_cuda:
        # a plain launch (it reads q, written by the kernel before it), or the KV write's programmatic dependent
        # (follows_write); it lets its dependents launch early
        history_cuda.launch(q, cache, req_to_token, req_pool_indices, seq_lens, ring_start, sink=sink, window=window,
                            sm_scale=sm_scale, ns=ns, ns_total=ns_total, o_part=o_part, lse_part=lse_part,
                            pdl=(history_cuda.PDL_OFF if not plan.follows_write else history_cuda.PDL_AFTER_WRITE_Q
                                 if plan.q_from_write else history_cuda.PDL_AFTER_WRITE),
                            window_splits=(ss, rs) if plan.window_in_cuda else (0, 0), sink_k=sink_k, sink_v=sink_v,
                            fold=plan.fold_window)
    if not plan.window_in_cuda:
        # the INT2 history and the window programs, or (after the CUDA history) the window programs only
        grid = (B * Hkv, ss + rs if hist_cuda else ns_total)
        wait = plan.pdl and hist_cuda  # window programs after the CUDA history: exit only after it has
        _oscar_decode_stage1[grid](
            q, cache.k_codes, k_hi, k4_index, param_words(cache.k_params, ngk), cache.v_codes,
            param_words(cache.v_params, ngv),
            sink_k, sink_v, cache.ring_k, cache.ring_v, cache.sink_table,
            req_to_token, req_pool_indices, seq_lens, ring_start,
            o_part, lse_part,
            float(sm_scale) * LOG2E,
            req_to_token.stride(0),
            HKV=Hkv, GQA=group, D=D, GK=gk, GV=gv, SINK=sink, WINDOW=window, NS=ns, SS=ss, RS=rs,
            BLOCK_M=block_m, NP=max(MIN_NP, triton.next_power_of_2(group)), BLOCK_N=plan.block_n, BLOCK_W=BLOCK_W,
            DT=dt, WDT=wdt, FAST_CVT=not fp32,
            NGK=ngk, NGV=ngv, CH=min(gk, gv, D // 4), FOLD=plan.fold,
            WINDOW_ONLY=hist_cuda, PDL_TRIGGER=plan.pdl, PAGE=cache.page, K4=k4, H4=h4, PDL_WAIT=wait,
            num_warps=NUM_WARPS, num_stages=NUM_STAGES, **({"maxnreg": plan.maxnreg} if plan.maxnreg else {}),
            **({"launch_pdl": True} if wait else {}),
        )
    _oscar_decode_merge[(B * Hq, plan.merge_splits)](
        o_part, lse_part, out,
        q, cache.k_codes, k_hi, k4_index, param_words(cache.k_params, 1), cache.v_codes,
        param_words(cache.v_params, 1),
        sink_k, sink_v, cache.sink_table,
        req_to_token, req_pool_indices, seq_lens, float(sm_scale) * LOG2E, req_to_token.stride(0),
        HQ=Hq, GQA=group, HKV=Hkv, GK=gk, GV=gv, SINK=sink, BLOCK_T=16,
        NS=ns, SS=ss, NS_TOTAL=ns_total, BLOCK_S=triton.next_power_of_2(ns_total), D=D, DC=D // plan.merge_splits,
        PDL=plan.pdl, PAGE=cache.page, K4=k4, H4=h4,
        num_warps=4, **({"launch_pdl": True} if plan.pdl else {}),
    )
    return out


_SM_COUNT = {}


def _num_sms(device: torch.device) -> int:
    device = torch.device(device)
    if device.type != "cuda":
        return 132
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]
