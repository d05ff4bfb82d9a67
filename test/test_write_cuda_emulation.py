"""CPU mirror of the CUDA write's per-thread steps (kernels/cuda/int2_write.cu), against the oracle.

The GPU tests (test_write.py, kernel="cuda") run the kernel itself; CI has no GPU, so this file replays, in PyTorch,
the decisions the kernel's code makes in the order it makes them: the four warps' partial sums of x . T over their
32-row slices (fp32 fused multiply-adds, summed ((p0 + p1) + p2) + p3), the clip threshold as the smallest |x'_j|
with at most n values strictly above it (each warp's minimum of its candidates, then the minimum over warps), the
group bounds as minima / maxima of order-preserving integer keys (redux.sync takes integers), the IEEE divisions,
the (scale, min) pair's float8 e4m3 conversion (cvt.rn.satfinite.e4m3x2.f32: saturate to ±448, round to nearest
even; scale in the low byte) and its exact decode, INT4 keys' code as floor(u + 0.5) corrected below a threshold, and
the pack of a record as eight 32-bit words from the codes' bytes (INT4 keys: of code & 3 and code >> 2). A change to one of these steps in the .cu file
should change this mirror too; the mirror's results must match write_reference with test_write.py's tolerances.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from kernel_utils import (assert_codes_match, assert_within_e4m3_ulp, gen, int4_thresholds, random_orthogonal,
                          threshold_rows)

from sglang_oscar.quant.cache_ops import quantize_side, transform_side
from sglang_oscar.quant.clip import clip_count, clip_rows
from sglang_oscar.quant.pack import pack_int2, pack_int4_planes, unpack_int2, unpack_int4_planes

D, WARPS = 128, 4
PRODUCTION_SOURCE = os.path.join(os.path.dirname(__file__), "..", "python", "sglang_oscar", "kernels", "cuda",
                                 "int2_write.cu")

# The lines of int2_write.cu this mirror replays (checked verbatim by test_the_mirrored_lines_are_the_kernels), by step:
MIRRORED_LINES = {
    "D 128, four warps of 32 rows": [
        "constexpr int kD = 128;",
        "constexpr int kThreads = 128; // 4 warps",
        "float part[4][kD];",
        "const int tid = threadIdx.x, w = tid >> 5, l = tid & 31;",
    ],
    "x - mean over warp w's rows [32w, 32w + 32), one fmaf per row in order (fma_rows)": [
        "for (int i = 0; i < 4; ++i) load8<TI>(xrow + 32 * w + 8 * i, a.vec, xk + 8 * i);",
        "xk[4 * i] -= m.x; xk[4 * i + 1] -= m.y; xk[4 * i + 2] -= m.z; xk[4 * i + 3] -= m.w;",
        "const float4* tm = reinterpret_cast<const float4*>(s.mat + h * s.stride_mh + (32 * w) * kD) + l;",
        "for (int k = 0; k < 32; ++k) {",
        "acc.x = fmaf(xk[k], r.x, acc.x); acc.y = fmaf(xk[k], r.y, acc.y);",
    ],
    "the warps' partial rows summed ((p0 + p1) + p2) + p3": [
        "xt = ((sm.part[0][tid] + sm.part[1][tid]) + sm.part[2][tid]) + sm.part[3][tid];",
    ],
    "the window rows: x' before the clip": [
        "const __nv_bfloat16 xb = __float2bfloat16_rn(xt);",
    ],
    "the clip: #{i : |x'_i| > |x'_j|} <= n, per-warp minimum, then over the warps; INT4 heads unclipped": [
        "if (s.clip_n > 0 && !is4) {",
        "c0 += v.x > ax; c1 += v.y > ax; c2 += v.z > ax; c3 += v.w > ax;",
        "uint32_t cand = (c0 + c1) + (c2 + c3) <= s.clip_n ? __float_as_uint(ax) : 0x7f800000u;",
        "cand = __reduce_min_sync(0xffffffffu, cand);",
        "const float tau = __uint_as_float(min(min(sm.tau[0], sm.tau[1]), min(sm.tau[2], sm.tau[3])));",
        "xt = fminf(fmaxf(xt, -tau), tau);",
    ],
    "group bounds as min / max of order keys (order_key, from_key)": [
        "return (b & 0x80000000u) ? ~b : (b | 0x80000000u);",
        "return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);",
        "const uint32_t key = order_key(xt);",
        "uint32_t kmin = __reduce_min_sync(0xffffffffu, key), kmax = __reduce_max_sync(0xffffffffu, key);",
        "const float lo = from_key(kmin), hi = from_key(kmax);",
    ],
    "(scale, min): IEEE division by qmax, e4m3 satfinite pair (scale low), decoded exactly (cvt_e4m3x2)": [
        "const float qmax = is4 ? 15.f : 3.f;",
        "__nv_cvt_float2_to_fp8x2(make_float2(__fdiv_rn(hi - lo, qmax), lo), __NV_SATFINITE, __NV_E4M3);",
        "const float2 stored = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3)));",
        "const float scale = stored.x, mn = stored.y;",
        "const float u = scale > 0.f ? __fdiv_rn(xt - mn, scale) : 0.f;",
    ],
    "codes: INT4-key layers floor(u + 0.5) corrected below a threshold; INT2 layers the threshold count": [
        "float c = fminf(fmaxf(floorf(u + 0.5f), 0.f), qmax);",
        "if (c > 0.f && u < c - 0.5f) c -= 1.f;",
        "code = (u >= s.th0) + (u >= s.th1) + (u >= s.th2);",
    ],
    "the pack: code j in byte j, word i = w[i] | w[i+8] << 2 | w[i+16] << 4 | w[i+24] << 6": [
        "reinterpret_cast<uint8_t*>(sm.code)[tid] = (uint8_t)code;",
        "const uint32_t word = sm.code[tid] | (sm.code[tid + 8] << 2) | (sm.code[tid + 16] << 4) | "
        "(sm.code[tid + 24] << 6);",
        "const int i = tid & 7, sh = (tid >> 3) * 2;",
        "const uint32_t m = 0x03030303u;  // two bits of each byte",
        "const uint32_t word = ((sm.code[i] >> sh) & m) | (((sm.code[i + 8] >> sh) & m) << 2) |",
        "(((sm.code[i + 16] >> sh) & m) << 4) | (((sm.code[i + 24] >> sh) & m) << 6);",
        "if (tid < 8) s.codes[rec * (kD / 16) + i] = word;",
        "else s.hi[pool_record(slot, j, s.h4, a.page_log2) * (kD / 16) + i] = word;",
    ],
}


def cvt_e4m3x2(scale: torch.Tensor, mn: torch.Tensor) -> tuple:
    """__nv_cvt_float2_to_fp8x2(make_float2(scale, min), __NV_SATFINITE, __NV_E4M3): the 16-bit pairs (scale in the
    low byte) and their exact values back (__nv_cvt_fp8x2_to_halfraw2 then fp16 -> fp32). torch's cast rounds to
    nearest even; saturation is the clamp."""
    s8, m8 = (x.float().clamp(-448.0, 448.0).to(torch.float8_e4m3fn) for x in (scale, mn))
    pair = s8.view(torch.uint8).to(torch.int32) | (m8.view(torch.uint8).to(torch.int32) << 8)
    return pair, s8.to(torch.float16).float(), m8.to(torch.float16).float()


def order_key(f: np.ndarray) -> np.ndarray:
    """int2_write.cu order_key: fp32 bits -> uint32 with the floats' order (negative: all bits flipped; else the
    sign bit set)."""
    b = f.astype(np.float32).view(np.uint32)
    return np.where(b & 0x80000000, ~b, b | 0x80000000).astype(np.uint32)


def from_key(k: np.ndarray) -> np.ndarray:
    k = k.astype(np.uint32)
    return np.where(k & 0x80000000, k & 0x7FFFFFFF, ~k).astype(np.uint32).view(np.float32)


def fma_rows(xk: torch.Tensor, tk: torch.Tensor) -> torch.Tensor:
    """acc = fmaf(x_k, T[k], acc) over the rows k of one warp's slice, in order: each step rounds once (the product
    of two fp32 values is exact in float64, and so is its sum with the fp32 accumulator up to a final rounding)."""
    acc = torch.zeros(tk.shape[-1], dtype=torch.float32)
    for k in range(xk.shape[0]):
        acc = (xk[k].double() * tk[k].double() + acc.double()).float()
    return acc


def emulate_side(x, mat, mean, clip_n, group, th, k4=None):
    """One (token, head, side) program of int2_write.cu on fp32 row x [D]: (x' before the clip, scale, min, codes,
    record bytes). k4 None: write_side<TI, false> (INT2, thresholds th); True / False: write_side<TI, true> (a layer with
    INT4-key heads) for an INT4 head (no clip, qmax 15; the record bytes of k_codes and of k_hi) / an INT2 head (qmax
    3, the thresholds k + 0.5 by the same floor and correction)."""
    if mat is not None:
        xk = x.float() - (mean.float() if mean is not None else 0.0)
        part = [fma_rows(xk[32 * w:32 * w + 32], mat[32 * w:32 * w + 32]) for w in range(WARPS)]
        xt = ((part[0] + part[1]) + part[2]) + part[3]
    else:
        xt = x.float().clone()
    window = xt.clone()  # what the sink / ring rows get (rounded to bf16 there)
    if clip_n > 0 and not k4:
        a = xt.abs()
        above = (a[None, :] > a[:, None]).sum(1)  # thread j: #{i : a_i > a_j}
        cand = torch.where(above <= clip_n, a, torch.full_like(a, float("inf")))
        tau = min(cand[32 * w:32 * w + 32].min() for w in range(WARPS))  # redux per warp, then over the warps
        xt = torch.minimum(torch.maximum(xt, -tau), tau)
    keys = order_key(xt.numpy())
    ng = D // group
    lo = torch.from_numpy(np.array([from_key(keys[g * group:(g + 1) * group].min(keepdims=True))[0]
                                     for g in range(ng)], dtype=np.float32))
    hi = torch.from_numpy(np.array([from_key(keys[g * group:(g + 1) * group].max(keepdims=True))[0]
                                     for g in range(ng)], dtype=np.float32))
    qmax = 15.0 if k4 else 3.0
    _, scale, mn = cvt_e4m3x2((hi - lo) / torch.tensor(qmax), lo)  # fp32 IEEE division, then e4m3
    s, m = scale.repeat_interleave(group), mn.repeat_interleave(group)
    u = torch.where(s > 0, (xt - m) / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(xt))
    if k4 is not None:
        c = torch.floor(u + 0.5).clamp(0.0, qmax)  # fp32: u + 0.5 rounded as fminf(fmaxf(floorf(u + 0.5f)...))
        codes = torch.where((c > 0) & (u < c - 0.5), c - 1, c).to(torch.int64)
    else:
        codes = sum((u >= t).to(torch.int64) for t in th)
    # the pack: code j in byte j of a 128-byte buffer; word i of the record = w[i] | w[i+8] << 2 | w[i+16] << 4 |
    # w[i+24] << 6 over its little-endian 32-bit words w
    words = codes.to(torch.uint8).numpy().view(np.uint32)
    if k4:  # the same of the words shifted right by 0 (k_codes) or 2 (k_hi), masked to two bits per byte

        def plane(sh):
            w = (words >> np.uint32(sh)) & np.uint32(0x03030303)
            rec = w[:8] | (w[8:16] << 2) | (w[16:24] << 4) | (w[24:32] << 6)
            return torch.from_numpy(rec.view(np.uint8).copy())

        return window, scale, mn, codes, (plane(0), plane(2))
    rec = words[:8] | (words[8:16] << 2) | (words[16:24] << 4) | (words[24:32] << 6)
    return window, scale, mn, codes, torch.from_numpy(rec.view(np.uint8).copy())


def test_the_mirrored_lines_are_the_kernels():
    """Every line of int2_write.cu the mirror replays (MIRRORED_LINES) is in the source verbatim, in write_side's order
    (the window rows take x' before the clip, the clip comes before the group bounds, the bounds before the codes):
    a change to one of them fails here until the mirror follows it."""
    lines = open(PRODUCTION_SOURCE).read().splitlines()

    def where(code):  # the source line holding `code` (each entry is within one line)
        hits = [i for i, ln in enumerate(lines) if code in ln]
        assert hits, f"not in int2_write.cu: {code}"
        return hits[0]

    for step, want in MIRRORED_LINES.items():
        for code in want:
            assert where(code) >= 0, step
    pos = [where(k) for k in ("const __nv_bfloat16 xb = __float2bfloat16_rn(xt);",
                              "xt = fminf(fmaxf(xt, -tau), tau);",
                              "const uint32_t key = order_key(xt);",
                              "float c = fminf(fmaxf(floorf(u + 0.5f), 0.f), qmax);",
                              "reinterpret_cast<uint8_t*>(sm.code)[tid] = (uint8_t)code;")]
    assert pos == sorted(pos), pos


def test_order_keys_sort_like_the_floats_and_invert():
    g = np.random.default_rng(0)
    f = np.concatenate([g.standard_normal(4000).astype(np.float32) * 10.0 ** g.integers(-40, 30, 4000),
                        np.array([0.0, -0.0, np.inf, -np.inf, 1e-45, -1e-45, 3.4e38, -3.4e38], dtype=np.float32)])
    f = f.astype(np.float32)
    k = order_key(f)
    assert (from_key(k).view(np.uint32) == f.view(np.uint32)).all()  # exact inverse, sign of zero included
    order = np.argsort(k, kind="stable")
    assert (np.diff(f[order].astype(np.float64)) >= 0).all()  # keys sort the values
    assert order_key(np.array([-0.0], np.float32))[0] < order_key(np.array([0.0], np.float32))[0]


def test_the_word_pack_is_the_quarter_plane_layout():
    g = gen(1)
    codes = torch.randint(0, 4, (50, D), generator=g)
    for row in codes:
        words = row.to(torch.uint8).numpy().view(np.uint32)
        rec = words[:8] | (words[8:16] << 2) | (words[16:24] << 4) | (words[24:32] << 6)
        assert torch.equal(torch.from_numpy(rec.view(np.uint8).copy()), pack_int2(row))


def test_the_int4_word_pack_is_the_two_plane_layout():
    g = gen(2)
    codes = torch.randint(0, 16, (50, D), generator=g)
    for row in codes:
        words = row.to(torch.uint8).numpy().view(np.uint32)
        lo, hi = pack_int4_planes(row)
        for sh, want in ((0, lo), (2, hi)):
            w = (words >> np.uint32(sh)) & np.uint32(0x03030303)
            rec = w[:8] | (w[8:16] << 2) | (w[16:24] << 4) | (w[24:32] << 6)
            assert torch.equal(torch.from_numpy(rec.view(np.uint8).copy()), want)


def test_the_param_pair_is_scale_then_min():
    """The kernel stores the e4m3 pair as one 16-bit word, scale in the low byte: the params buffer's [..., 2] order
    (scale at the lower address) on a little-endian GPU."""
    pair, s, m = cvt_e4m3x2(torch.tensor([0.75, 500.0]), torch.tensor([-1.5, -2.0**-9]))
    buf = torch.tensor(pair.numpy().astype(np.uint16).view(np.uint8)).view(torch.float8_e4m3fn).view(2, 2)
    assert buf[:, 0].float().tolist() == s.tolist() == [0.75, 448.0]
    assert buf[:, 1].float().tolist() == m.tolist() == [-1.5, -(2.0**-9)]


MIRROR_CASES = [  # group, clip ratio, with a transform, head: None INT2 layer, True / False INT4 / INT2 head
    (64, 0.95, True, None), (128, 0.9, True, None), (32, 1.0, True, None), (64, 0.9, False, None),
    (64, 1.0, True, True), (32, 0.9, True, True), (128, 0.95, False, True), (64, 0.9, True, False),
    (32, 0.95, False, False),
]


def test_the_mirror_matches_the_oracle():
    """Rows with outlier channels, shared transform with a mean (K) and without (V: absorbed, x' = x), groups 32 /
    64 / 128, clip ratios 0.9 / 0.95 / 1.0, INT4-key heads (never clipped) and the INT2 heads of
    their layers (uniform thresholds k + 0.5 counted like the INT4 ones): the mirror's window row to 1e-5 of the
    row's max, its float8 e4m3 params the oracle's (bit for bit without a transform; with one, at most one group
    differs, by one e4m3 ulp: the sum's order), its codes equal except threshold boundary cases and its record bytes
    those of pack_int2 (INT4: pack_int4_planes)."""
    from sglang_oscar.kernels.write_cuda import INT2_THRESHOLDS

    g = gen(7)
    for group, rho, with_mat, k4 in MIRROR_CASES:
        bits = 4 if k4 else 2
        x = torch.randn(24, D, generator=g) * 2.0
        x[:, 5] *= 8.0
        if not with_mat:
            x[3] = 1.5  # a constant row: scale 0
            x[4, :16] = 3.0  # ties above the clip count (12 at 0.9)
            x = x.round()  # integer values: ties everywhere
        mat = random_orthogonal(D, g=g, device="cpu") if with_mat else None
        mean = torch.randn(D, generator=g) if with_mat else None
        th = INT2_THRESHOLDS if bits == 2 else int4_thresholds()
        if k4:
            rho = 1.0  # the oracle's INT4 heads are never clipped; the mirror gets the clip count and skips it
        n = clip_count(rho, D)
        ref_xt = transform_side(x, mat, mean)
        ref = quantize_side(ref_xt, group, rho, bits)
        got = [emulate_side(x[i], mat, mean, clip_count(0.9, D) if k4 else n, group, th, k4) for i in range(x.shape[0])]
        xt = torch.stack([r[0] for r in got])
        scale, mn = torch.stack([r[1] for r in got]), torch.stack([r[2] for r in got])
        codes = torch.stack([r[3] for r in got])
        assert ((xt - ref_xt).abs() <= 1e-5 * ref_xt.abs().amax(-1, keepdim=True)).all()
        params = torch.stack([scale, mn], -1)
        want = torch.stack([ref.scale, ref.minv], -1).float()
        assert_within_e4m3_ulp(params, want, f"G{group} params")
        same = (params == want).all(-1)
        assert int((~same).sum()) <= (1 if with_mat else 0), f"G{group}: {int((~same).sum())} groups differ"
        s = want[..., 0].double().repeat_interleave(group, -1)
        m = want[..., 1].double().repeat_interleave(group, -1)
        clipped = clip_rows(transform_side(x.double(), mat.double() if mat is not None else None,
                                           mean.double() if mean is not None else None), rho)
        t64 = torch.where(s > 0, (clipped - m) / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(s))
        excused = (~same).repeat_interleave(group, -1)
        assert_codes_match(torch.where(excused, ref.codes.long(), codes), ref.codes.long(), t64, th, f"G{group} codes")
        if bits == 4:
            lo, hi = torch.stack([r[4][0] for r in got]), torch.stack([r[4][1] for r in got])
            assert torch.equal(unpack_int4_planes(lo, hi), codes.to(torch.uint8))
        else:
            assert torch.equal(unpack_int2(torch.stack([r[4] for r in got])), codes.to(torch.uint8))
        if not with_mat:
            assert (scale[3] == 0).all() and (codes[3] == 0).all()


def test_the_int4_mirror_is_exact_at_the_thresholds():
    """x' = rows of kernel_utils.threshold_rows exactly (no transform; a clip count given, which INT4 heads skip): the
    INT4 mirror's codes and params equal the oracle's, the floor's correction included (0.5 − 2^-25: floor(u + 0.5) =
    1, the count 0)."""
    for group in (32, 64, 128):
        x = threshold_rows(D, group)
        ref = quantize_side(x, group, 1.0, 4)
        got = [emulate_side(row, None, None, 12, group, int4_thresholds(), k4=True) for row in x]
        assert torch.equal(torch.stack([r[3] for r in got]), ref.codes.long())
        assert torch.equal(torch.stack([r[1] for r in got]), ref.scale.float())
        assert torch.equal(torch.stack([r[2] for r in got]), ref.minv.float())
