"""CPU checks of the CUDA history kernel's register layouts (python/sglang_oscar/kernels/cuda/int2_history.cu).

The GPU tests compare the kernel with the float64 oracle; these tests pin its index scheme on CPU so that a change to
it (token order sigma, PRMT selectors, plane masks, the lane -> dims map of the in-kernel q fragments, the movmatrix
hand-over of p to the V dot, the window tiles' swizzle, the integer K dot, the paired tiles) fails in CI without a
GPU. They emulate one 16-token tile per PTX's fragment definitions of mma.m16n8k16 / m16n8k32 and of
movmatrix.m8n8.trans, compare the K and V dots with direct products on random codes (INT2 keys, and INT4 keys from
their two quarter-plane buffers), and check verbatim the source lines each emulation rests on; likewise the cache
format's float8 e4m3 (scale, min) pairs: the decode and the param words' selectors.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

from sglang_oscar.kernels.history_cuda import LOG2E

PRODUCTION_SOURCE = os.path.join(os.path.dirname(__file__), "..", "python", "sglang_oscar", "kernels", "cuda",
                                 "int2_history.cu")
K_SELECTORS = (0x1100, 0x3322)  # bytes (0, 1) / (2, 3) of a word -> low bytes of two halfwords
V_SELECTORS = (0x4400, 0x5511, 0x6622, 0x7733)  # byte k of word a and of word b -> two halfwords


def prmt(a, b, sel):
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    return sum(src[(sel >> (4 * i)) & 7] << (8 * i) for i in range(4))


def halves(u):
    return np.array([u], dtype=np.uint32).view(np.float16).astype(np.float64)


def pack(x0, x1):
    return int(np.array([x0, x1], dtype=np.float16).view(np.uint32)[0])


def mma(acc, a_regs, b_regs):
    """acc[lane][4] += A.B with A [16, 16] / B [16, 8] spread over lanes as PTX defines for m16n8k16."""
    A, B = np.zeros((16, 16)), np.zeros((16, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        a = [halves(r) for r in a_regs[lane]]
        A[g, 2 * t:2 * t + 2], A[g + 8, 2 * t:2 * t + 2] = a[0], a[1]
        A[g, 2 * t + 8:2 * t + 10], A[g + 8, 2 * t + 8:2 * t + 10] = a[2], a[3]
        b = [halves(r) for r in b_regs[lane]]
        B[2 * t:2 * t + 2, g], B[2 * t + 8:2 * t + 10, g] = b[0], b[1]
    C = A @ B
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        acc[lane] += np.array([C[g, 2 * t], C[g, 2 * t + 1], C[g + 8, 2 * t], C[g + 8, 2 * t + 1]])


def movmatrix_trans(regs):
    M = np.zeros((8, 8))
    for lane in range(32):
        M[lane >> 2, 2 * (lane & 3):2 * (lane & 3) + 2] = halves(regs[lane])
    return [pack(M.T[lane >> 2, 2 * (lane & 3)], M.T[lane >> 2, 2 * (lane & 3) + 1]) for lane in range(32)]


def sigma(g):
    return (g >> 1) + 4 * (g & 1)


def word(row, off):
    return sum(int(row[off + i]) << (8 * i) for i in range(4))


def codes(byts):
    return np.concatenate([(byts >> (2 * p)) & 3 for p in range(4)], 1)  # dims p*32 + j


def history_k_dot(kc, q_regs):
    """The history loop's K dot of one tile: codes [16 tokens, 32 bytes] as A (sigma token order, K_SELECTORS, plane
    masks) against q_regs[lane][2ks], [2ks + 1] as B per k-step ks = (plane p, half hh); accumulators of groups 0, 1."""
    acc = [np.zeros((32, 4)), np.zeros((32, 4))]
    for ks in range(8):
        p, hh = ks // 2, ks % 2
        m = 0x00030003 << (2 * p)
        a_regs = []
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            w0, w1 = word(kc[sigma(g)], t * 8 + 4 * hh), word(kc[sigma(g) + 8], t * 8 + 4 * hh)
            lo, hi = K_SELECTORS
            a_regs.append([prmt(w0, 0, lo) & m, prmt(w1, 0, lo) & m, prmt(w0, 0, hi) & m, prmt(w1, 0, hi) & m])
        mma(acc[p // 2], a_regs, [[int(q_regs[lane][2 * ks]), int(q_regs[lane][2 * ks + 1])] for lane in range(32)])
    return acc


def check_history_k_dot(acc, kc, qf, head_of_column, scale_tol=None, K=None):
    """Lane (g, t)'s accumulator entry e is token sigma(g) + 8 (e >> 1) and column 2t + (e & 1), i.e. that column's
    head; group 0 in units of 2^-24, group 1 of 2^-20 (the kernel's sc1 / 16 and exp2(s' 2^24 - m)). scale_tol: also
    |error| <= scale_tol . the dot's scale (the group's max |qf| over all heads . the row's code sum). K: the codes
    [16, 128] (default: the INT2 codes of kc)."""
    K = codes(kc) if K is None else K
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for e in range(4):
            row, head = sigma(g) + 8 * (e >> 1), head_of_column(2 * t + (e & 1))
            for grp, unit in ((0, 2.0 ** 24), (1, 2.0 ** 20)):
                want = (qf[head, 64 * grp:64 * grp + 64] * K[row, 64 * grp:64 * grp + 64]).sum()
                assert acc[grp][lane, e] * unit == pytest.approx(want, rel=2e-3, abs=2e-3)
                if scale_tol is not None:
                    scale = np.abs(qf[:, 64 * grp:64 * grp + 64]).max() * K[row, 64 * grp:64 * grp + 64].sum()
                    assert abs(acc[grp][lane, e] * unit - want) <= scale_tol * scale


def group_acc(ih, il, is0, is1):
    """The integer K dot's two group sums (hi . 128 + lo, each times its warp scale) in the fp16 path's units, as
    check_history_k_dot takes them: group 0 in 2^-24, group 1 in 2^-20, so group 1 carries 16 iS1."""
    return [(ih[0] * 128 + il[0]) * float(is0), (ih[1] * 128 + il[1]) * float(is1) * 16]


def p_operands(P, vs, head_of_column, group_of_lane):
    """The V dot's B operand pair: p.vscale from the K accumulator layout (lane (g, t): tokens sigma(g), sigma(g) + 8,
    columns 2t, 2t + 1) through movmatrix.trans, with the V scale of group group_of_lane(t)."""
    h01, h23 = [], []
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        grp, ra, rb = group_of_lane(t), sigma(g), sigma(g) + 8
        c0, c1 = head_of_column(2 * t), head_of_column(2 * t + 1)
        h01.append(pack(P[ra, c0] * vs[ra, grp], P[ra, c1] * vs[ra, grp]))
        h23.append(pack(P[rb, c0] * vs[rb, grp], P[rb, c1] * vs[rb, grp]))
    return movmatrix_trans(h01), movmatrix_trans(h23)


def history_v_dot(vc, operands_of_mtile):
    """The history loop's V dot of one tile: V codes [16 tokens, 32 bytes] as A (V_SELECTORS, plane masks) per
    m-tile mt against the B pair operands_of_mtile(mt)."""
    o = [np.zeros((32, 4)) for _ in range(8)]
    for mt in range(8):
        p, hb = mt >> 1, mt & 1
        m = 0x00030003 << (2 * p)
        b0, b1 = operands_of_mtile(mt)
        a_regs = []
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            wa, wb, wc, wd = (word(vc[r], 4 * g) for r in (t, t + 4, t + 8, t + 12))
            e = [prmt(wa, wb, s) for s in V_SELECTORS]
            f = [prmt(wc, wd, s) for s in V_SELECTORS]
            a_regs.append([e[2 * hb] & m, e[2 * hb + 1] & m, f[2 * hb] & m, f[2 * hb + 1] & m])
        mma(o[mt], a_regs, [[b0[lane], b1[lane]] for lane in range(32)])
    return o


def check_history_v_dot(o, P, vs, vc, head_of_column, mtiles_of_lane):
    """The kernel's epilogue: lane (g, t) keeps m-tiles mtiles_of_lane(t), whose rows g, g + 8 are dims d0, d0 + 1
    (d0 = p*32 + 4g + 2hb) of heads head0, head0 + 1 (columns 2t, 2t + 1). Returns the (head, dim) outputs seen."""
    V = codes(vc)
    seen = set()
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        head0 = head_of_column(2 * t)
        for mt in mtiles_of_lane(t):
            p, hb = mt >> 1, mt & 1
            d0 = p * 32 + 4 * g + 2 * hb
            for e, (head, d) in enumerate(((head0, d0), (head0 + 1, d0), (head0, d0 + 1), (head0 + 1, d0 + 1))):
                want = sum(P[tok, head] * vs[tok, d // 64] * V[tok, d] for tok in range(16))
                assert o[mt][lane, e] * 2.0 ** (24 - 2 * p) == pytest.approx(want, rel=3e-3, abs=1e-3)
                seen.add((head, d))
    return seen


def test_selectors_match_the_kernel_source():
    src = open(PRODUCTION_SOURCE).read()
    # the K dot is the integer one (its masks: test_integer_k_dot_with_the_kernels_int8_q); the V dot's selectors
    for sel in V_SELECTORS:
        assert f"0x{sel:04x}" in src.lower()
    assert "(g >> 1) + 4 * (g & 1)" in src  # sigma
    assert "0x00030003u << (2 * p)" in src  # plane masks


@pytest.mark.parametrize("seed", [0, 1])
def test_v_dot_from_the_k_accumulator_layout(seed):
    rng = np.random.default_rng(seed + 10)
    vc = rng.integers(0, 256, (16, 32))
    P = rng.random((16, 4))  # p of token (tile row) and head
    vs = rng.random((16, 2)) * 0.3 + 0.05  # V scale of token and group
    # columns 0..3 carry p.scale of V group 0, columns 4..7 of group 1 (lane t's group t >> 1): one pair for all
    b = p_operands(P, vs, lambda c: c & 3, lambda t: t >> 1)
    o = history_v_dot(vc, lambda mt: b)
    # lanes keep the m-tiles of their V group
    seen = check_history_v_dot(o, P, vs, vc, lambda c: c & 3, lambda t: range(4 * (t >> 1), 4 * (t >> 1) + 4))
    assert len(seen) == 4 * 128  # every output of the tile written once


def kernel_q_fragments(q, head_of_column, c0):
    """q as fp16 B fragments of the fp16 K dot (the probe's; the production kernel's integer K dot is checked against
    the same dot below, test_integer_k_dot_with_the_kernels_int8_q): lane (g, t), register
    2ks + w of k-step ks = (plane p, half hh) holds c0 q of column g's head at dims p*32 + t*8 + 4hh + 2w + (0, 1),
    times 1/4 on odd planes (q' = c0 q 4^(2g - p) with the codes' subnormal scale 2^(2p - 24))."""
    regs = []
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        row = []
        for r in range(16):
            ks, w = r >> 1, r & 1
            p, hh = ks >> 1, ks & 1
            d = p * 32 + t * 8 + 4 * hh + 2 * w
            f = 0.25 if p & 1 else 1.0
            row.append(pack(q[head_of_column(g), d] * c0 * f, q[head_of_column(g), d + 1] * c0 * f))
        regs.append(row)
    return regs


@pytest.mark.parametrize("hc", [4, 8])
def test_history_k_dot_with_the_kernels_q_fragments(hc):
    """The production kernel builds q's operands itself: column g is head g & 3 (HC 4) or head g (HC 8), and
    lane (g, t)'s accumulator columns 2t, 2t + 1 are the heads head0 = (2t) & 3 or 2t and head0 + 1."""
    rng = np.random.default_rng(30 + hc)
    kc = rng.integers(0, 256, (16, 32))
    q = rng.standard_normal((hc, 128)) * 0.5
    head = (lambda c: c) if hc == 8 else (lambda c: c & 3)
    c0 = 1 / math.sqrt(128) * LOG2E
    qb = kernel_q_fragments(q, head, c0)
    check_history_k_dot(history_k_dot(kc, qb), kc, q * c0, head)
    src = open(PRODUCTION_SOURCE).read()
    assert "const int qhead = HC == 8 ? g : (g & 3);" in src and "const int head0 = HC == 8 ? 2 * t : (2 * t) & 3;" in src
    assert "const int d = p * 32 + t * 8 + 4 * hh + 2 * w;" in src
    # 16-bit q arrives in one 16-byte load per plane p (dims p*32 + t*8 .. + 7): its 32-bit word 2hh + w holds
    # dims d, d + 1 of the fragment register (p, hh, w)
    assert "qraw[p] = load_q8(a, qvalid, qrow + p * 32 + t * 8);" in src
    assert "q_pair(a, qraw[p], 2 * hh + w, qvalid, qrow + d);" in src
    assert "const uint32_t wd = k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w;" in src  # word k: x, y, z, w
    for t in range(4):
        for p in range(4):
            for hh in range(2):
                for w in range(2):
                    word = 2 * hh + w  # x, y, z, w
                    assert p * 32 + t * 8 + 2 * word == p * 32 + t * 8 + 4 * hh + 2 * w


@pytest.mark.parametrize("seed", [0, 1])
def test_v_dot_eight_heads_per_column(seed):
    """HC 8: every column is its own head, so one operand pair cannot carry both V groups' scales: m-tiles 0..3
    (planes 0, 1: dims 0..63, V group 0) take p.scale of group 0, m-tiles 4..7 of group 1, and every lane keeps all
    eight m-tiles (heads 2t, 2t + 1)."""
    rng = np.random.default_rng(seed + 40)
    vc = rng.integers(0, 256, (16, 32))
    P = rng.random((16, 8))  # p of token (tile row) and head
    vs = rng.random((16, 2)) * 0.3 + 0.05  # V scale of token and group
    ops = [p_operands(P, vs, lambda c: c, lambda t, grp=grp: grp) for grp in range(2)]
    o = history_v_dot(vc, lambda mt: ops[0] if mt < 4 else ops[1])
    seen = check_history_v_dot(o, P, vs, vc, lambda c: c, lambda t: range(8))  # the epilogue (park) at HC 8
    assert len(seen) == 8 * 128  # every output of the tile written once
    src = open(PRODUCTION_SOURCE).read()
    assert "mt < 4 ? b0 : c0, mt < 4 ? b1 : c1" in src
    # the epilogue (park) at HC 8: m-tiles below G0 = NMT / 2 = 4 (D 128) add group 0's min sums, the others group 1's
    assert "constexpr int kSB = SL::kBytes, NMT = D / 16;" in src and "constexpr int G0 = NMT / 2;" in src
    assert "for (int mt = 0; mt < NMT; ++mt) park(mt, o[mt], mt < G0 ? lv0 : lw0, mt < G0 ? lv1 : lw1);" in src


# ---- the window CTAs of the production kernel (window_cta in kernels/cuda/int2_history.cu) ---------------------
# BF16 tiles of 16 rows x 128 dims in shared memory, 16-byte chunks XOR-swizzled by row; the layouts below are
# emulated with fp16 halves (the same 16-bit fragments; small integers, so every sum is exact).


def swz(r):
    return ((r & 1) << 2) ^ ((r >> 1) & 1) ^ (((r >> 2) & 1) << 2)


def tile_smem(x):
    """A [16, 128] tile as the window CTA's cp.async leaves it: chunk ch of row r at r * 256 + (ch ^ swz(r)) * 16."""
    raw = x.astype(np.float16).view(np.uint8).reshape(16, 16, 16)  # row, chunk, byte
    smem = np.zeros(16 * 256, np.uint8)
    for r in range(16):
        for ch in range(16):
            off = r * 256 + ((ch ^ swz(r)) << 4)
            smem[off:off + 16] = raw[r, ch]
    return smem


def lds128(smem, r, ch):
    """The four 32-bit words of chunk ch of row r (through the swizzle), and the chunk's shared-memory slot."""
    off = r * 256 + ((ch ^ swz(r)) << 4)
    return [int(w) for w in smem[off:off + 16].view(np.uint32)], off // 16


def assert_conflict_free(slots_per_lane):
    """A 128-bit shared load is served a quarter warp (8 lanes) at a time; 8 distinct 16-byte slots mod 8 (one
    128-byte bank row) are conflict-free."""
    for q in range(4):
        assert len({slots_per_lane[lane] % 8 for lane in range(8 * q, 8 * q + 8)}) == 8


def test_window_tile_layouts_match_the_kernel_source():
    src = open(PRODUCTION_SOURCE).read()
    assert "((r & 1) << 2) ^ ((r >> 1) & 1) ^ (((r >> 2) & 1) << 2)" in src  # swz
    assert "(((4 * jj + t) ^ swz(g)) << 4)" in src  # K chunks 4jj + t of rows g, g + 8
    assert "(((2 * g + sc) ^ swz(2 * t)) << 4)" in src  # V chunks 2g + sc of rows 2t, 2t + 1, 2t + 8, 2t + 9
    for sel in ("0x5410", "0x7632"):
        assert sel in src


@pytest.mark.parametrize("hc", [4, 8])
@pytest.mark.parametrize("seed", [0, 1])
def test_window_tile_k_and_v_dots(seed, hc):
    """hc: query heads per CTA column (the kernel's HC): at 4, columns 4..7 repeat heads 0..3; at 8 column g is
    head g."""
    src = open(PRODUCTION_SOURCE).read()  # 16-bit q in one 16-byte load per jj (dims 32jj + 8t .. + 7): word k = dims 2k, 2k + 1
    assert "qraw[jj] = load_q8(a, qvalid, qrow + 32 * jj + 8 * t);" in src
    assert "q_pair(a, qraw[jj], k, qvalid, qrow + 32 * jj + 8 * t + 2 * k);" in src
    rng = np.random.default_rng(seed + 20 + hc)
    K = rng.integers(-4, 5, (16, 128)).astype(np.float64)
    V = rng.integers(-4, 5, (16, 128)).astype(np.float64)
    q = rng.integers(-3, 4, (hc, 128)).astype(np.float64)  # c0 q of the CTA's heads
    head = (lambda c: c) if hc == 8 else (lambda c: c & 3)  # the head of column c
    P = rng.integers(0, 4, (16, 8)).astype(np.float64)  # p of token and column
    ks, vs = tile_smem(K), tile_smem(V)
    # S^T[16 tokens, 8 cols] = K . q^T over the permuted k order: k-step 2jj + e, lane t's k-values are dims
    # 32jj + 8t + 4e + 0..3 (a0 / a1: + 0, 1; a2 / a3: + 2, 3), q's B fragments the same dims of head g & 3
    acc = np.zeros((32, 4))
    for jj in range(4):
        k0s, k1s, a_e, b_e = [], [], [[], []], [[], []]
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            k0, s0 = lds128(ks, g, 4 * jj + t)
            k1, s1 = lds128(ks, g + 8, 4 * jj + t)
            k0s.append(s0)
            k1s.append(s1)
            qw = [pack(q[head(g), 32 * jj + 8 * t + 2 * k], q[head(g), 32 * jj + 8 * t + 2 * k + 1]) for k in range(4)]
            for e in range(2):
                a_e[e].append([k0[2 * e], k1[2 * e], k0[2 * e + 1], k1[2 * e + 1]])
                b_e[e].append([qw[2 * e], qw[2 * e + 1]])
        assert_conflict_free(k0s)
        assert_conflict_free(k1s)
        for e in range(2):
            mma(acc, a_e[e], b_e[e])
    S = K @ q.T
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        np.testing.assert_array_equal(acc[lane], [S[g, head(2 * t)], S[g, head(2 * t + 1)], S[g + 8, head(2 * t)],
                                                  S[g + 8, head(2 * t + 1)]])
    # O^T[128 dims, 8 cols] += V^T . P^T: m-row g of m-tile mt is dim 16g + 2mt, row g + 8 dim 16g + 2mt + 1; P^T
    # from the accumulator layout (tokens g, g + 8; columns 2t, 2t + 1) through movmatrix.trans
    b0 = movmatrix_trans([pack(P[lane >> 2, 2 * (lane & 3)], P[lane >> 2, 2 * (lane & 3) + 1]) for lane in range(32)])
    b1 = movmatrix_trans([pack(P[8 + (lane >> 2), 2 * (lane & 3)], P[8 + (lane >> 2), 2 * (lane & 3) + 1])
                          for lane in range(32)])
    o = [np.zeros((32, 4)) for _ in range(8)]
    for sc in range(2):
        words, slots = [], {r: [] for r in range(4)}
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            rows = [lds128(vs, r, 2 * g + sc) for r in (2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9)]
            for i, (_, slot) in enumerate(rows):
                slots[i].append(slot)
            words.append([w for w, _ in rows])
        for i in range(4):
            assert_conflict_free(slots[i])
        for w in range(4):
            a_regs = []
            for lane in range(32):
                wa, wb, wc, wd = (words[lane][i][w] for i in range(4))
                a_regs.append([prmt(wa, wb, 0x5410), prmt(wa, wb, 0x7632), prmt(wc, wd, 0x5410), prmt(wc, wd, 0x7632)])
            mma(o[4 * sc + w], a_regs, [[b0[lane], b1[lane]] for lane in range(32)])
    O = V.T @ P  # [128 dims, 8 cols]
    for mt in range(8):
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            d = 16 * g + 2 * mt
            np.testing.assert_array_equal(o[mt][lane], [O[d, 2 * t], O[d, 2 * t + 1], O[d + 1, 2 * t],
                                                        O[d + 1, 2 * t + 1]])


def test_folded_cta_warp_ranges_tile_the_cta_range():
    """The folded window's hand-off (int2_history_kernel): in a CTA whose warp 0 reads a window tile, warp 0 gives
    k = min(7, nwarps - 1, chunk / 16) of its 16-row units to warps 1..k. Emulated from the source's expressions
    (checked verbatim below): for every warp count and chunk, the warps' ranges are contiguous, disjoint, in 16-row
    steps, cover exactly the range of a CTA without the tile, and warp 0 keeps chunk - 16k >= 0 rows, clamped at the
    history's end as the kernel clamps them."""
    src = open(PRODUCTION_SOURCE).read()
    assert "? min(min(7, nwarps - 1), chunk >> 4) : 0;" in src
    assert "const int lo0 = hist_lo + widx * chunk + (warp == 0 ? 0 : 16 * (min(warp - 1, k) - k));" in src
    assert "const int hi = min(lo0 + chunk + (warp == 0 ? -16 * k : warp <= k ? 16 : 0), hist_hi);" in src
    assert "const int lo = min(lo0, hist_hi);" in src

    def ranges(nwarps, chunk, split, hist_lo, hist_hi, folded):
        k = min(min(7, nwarps - 1), chunk >> 4) if folded else 0
        out = []
        for warp in range(nwarps):
            widx = split * nwarps + warp
            lo0 = hist_lo + widx * chunk + (0 if warp == 0 else 16 * (min(warp - 1, k) - k))
            hi = min(lo0 + chunk + (-16 * k if warp == 0 else 16 if warp <= k else 0), hist_hi)
            out.append((min(lo0, hist_hi), hi))
        return out, k

    for nwarps in (1, 2, 4, 8):
        for chunk in range(0, 400, 16):
            for split, hist_hi in ((0, 10**6), (3, 10**6), (2, 64 + 2 * nwarps * chunk + 37)):
                plain, _ = ranges(nwarps, chunk, split, 64, hist_hi, False)
                folded, k = ranges(nwarps, chunk, split, 64, hist_hi, True)
                assert folded[0][0] == plain[0][0] and folded[-1][1] == plain[-1][1]  # the CTA's range is unchanged
                for (lo_a, hi_a), (lo_b, _) in zip(folded, folded[1:]):
                    assert lo_a <= hi_a and hi_a == lo_b or hi_a == lo_b == hist_hi  # contiguous, disjoint
                assert sum(max(0, hi - lo) for lo, hi in folded) == sum(max(0, hi - lo) for lo, hi in plain)
                if hist_hi == 10**6:
                    assert folded[0][1] - folded[0][0] == chunk - 16 * k >= 0
                    assert k == (min(7, nwarps - 1, chunk // 16))
                    assert all((hi - lo) % 16 == 0 for lo, hi in folded)


def test_pool_record32_is_the_records_rule():
    """The history loop's copies index (slot, KV head) records in 32 bits (pool_record32, int2_history.cu), emulated
    from the source's expression (checked verbatim): the same record as kernels/records.py's rule
    ((slot // P) * H + h) * P + slot % P for pages of 1-256 slots (the served 128 and 256 included), 1-8 KV heads,
    slots up to a pool of 2^31 records, and 2 * record + 1 (a record's second 16-byte half) still fits 32 bits there
    (history_cuda.launch refuses larger pools)."""
    src = open(PRODUCTION_SOURCE).read()
    assert "return (((u >> a.page_log2) * (uint32_t)a.hkv + (uint32_t)h) << a.page_log2) | (u & pmask);" in src
    assert "const uint32_t hrec = 2u * __shfl_sync(0xffffffffu, k < 2 ? r0 : r1, tok & 31) + (uint32_t)half;" in src
    m32 = (1 << 32) - 1

    def rec32(s, h, hkv, plog):
        u = s & m32
        return ((((u >> plog) * hkv + h) & m32) << plog & m32) | (u & ((1 << plog) - 1))

    rng = np.random.default_rng(0)
    for plog in (0, 4, 6, 7, 8):
        page = 1 << plog
        for hkv in (1, 3, 8):
            max_slots = ((1 << 31) // hkv) // page * page  # a pool just under 2^31 records
            slots = np.concatenate([rng.integers(0, max_slots, 2000), [0, page - 1, page, max_slots - 1]])
            for s in slots.tolist():
                for h in {0, hkv - 1}:
                    ref = ((s // page) * hkv + h) * page + s % page
                    assert rec32(s, h, hkv, plog) == ref < 1 << 31
                    assert 2 * ref + 1 <= m32


@pytest.mark.parametrize("head_dim", [128, 64])
def test_cuda_history_refuses_pools_past_32bit_records(head_dim):
    """history_cuda.launch: a pool of 2^31 or more records (the loop's 32-bit record index) is refused with the way
    out, before anything is launched (meta tensors stand in for q and the codes; a record is head_dim / 4 code
    bytes, so q's head_dim decides the count)."""
    from types import SimpleNamespace

    from sglang_oscar.kernels import history_cuda

    q = torch.empty(1, 1, head_dim, dtype=torch.bfloat16, device="meta")
    cache = SimpleNamespace(k_codes=torch.empty(1 << 31, 1, head_dim // 4, dtype=torch.uint8, device="meta"))
    with pytest.raises(ValueError, match="32 bits.*history_kernel='triton'"):
        history_cuda.launch(q, cache, None, None, None, None, sink=64, window=256, sm_scale=1.0, ns=1,
                            ns_total=1, o_part=None, lse_part=None)


def _f32(x):
    return np.float32(x)


def _fma32(a, b, c):
    """fp32 fused multiply-add (the exact product of two fp32 values fits a float64; one rounding to fp32)."""
    return np.float32(np.float64(a) * np.float64(b) + np.float64(c))


def _int8_hi_lo(x, kp):
    """The kernel's fp32 rounding of v = x kp into int8 hi, lo with v ~ 128 hi + lo (the hm / lm lines: the low byte
    of magic + n is n mod 256, read as int8)."""
    magic = _f32(12582912.0)
    hm = _fma32(x, kp * _f32(1 / 128), magic)
    lm = _f32(_fma32(x, kp, _fma32(hm, _f32(-128.0), _f32(128.0) * magic)) + magic)
    hb = int(np.array([hm], dtype=np.float32).view(np.uint32)[0]) & 0xFF
    lb = int(np.array([lm], dtype=np.float32).view(np.uint32)[0]) & 0xFF
    return hb - 256 if hb > 127 else hb, lb - 256 if lb > 127 else lb


def kernel_int8_q(q, head_of_column, c0, k4=False):
    """The production kernel's q for the integer K dot (int2_history_kernel's prologue), in fp32 as the
    kernel rounds it: lane (g, t), register 2p + w holds c0 q 4^-p S_gp of column g's head at dims p*32 + t*8 + 4w +
    0..3 as int8 hi (qhi) and lo (qlo), v = 128 hi + lo, with S_gp = 16256 / (the warp's max |c0 q 4^-p| over plane
    group gp); k4 (INT4 keys): PLANE_F_K4[p] in place of 4^-p. Returns (qhi, qlo) as int arrays [32 lanes, 8
    registers, 4 bytes] and (iS0, iS1)."""
    xs = np.zeros((32, 4, 8), dtype=np.float32)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for p in range(4):
            xs[lane, p] = (q[head_of_column(g), p * 32 + t * 8:p * 32 + t * 8 + 8] * c0).astype(np.float32)
    return int8_q_of_xs(xs, k4)


PLANE_F = (1.0, 0.25, 0.0625, 0.015625)  # int2_history.cu plane_f(false, p) = 4^-p: the INT2 A bytes are c 4^p
PLANE_F_K4 = (1.0, 1.0, 0.0625, 0.0625)  # plane_f(true, p): the INT4 A bytes (int4_nibbles) are c, c, 16c, 16c


def int8_q_of_xs(xs, k4=False):
    """The kernel's int8 q from the lanes' fp32 values xs [32 lanes, 4 planes, n] (n = 8 at D 128, 4 at D 64): the
    warp's max per plane, S_gp = 16256 / max over plane group gp (0 below 1e-30), and per element _int8_hi_lo of
    xs . 4^-p S_gp; register QW p + w (QW = n / 4, the kernel's QW) holds plane p's values 4w .. 4w + 3. Returns qhi,
    qlo [32, 4 QW, 4] and (iS0, iS1). k4: the plane factors PLANE_F_K4 in place of 4^-p."""
    f = [_f32(x) for x in (PLANE_F_K4 if k4 else PLANE_F)]
    qw = xs.shape[2] // 4
    mq = np.abs(xs).max(axis=(0, 2))  # the warp's max per plane
    mx0, mx1 = max(mq[0], f[1] * mq[1]), max(f[2] * mq[2], f[3] * mq[3])
    S = [_f32(16256.0) / m if m > _f32(1e-30) else _f32(0.0) for m in (mx0, mx1)]
    qhi, qlo = np.zeros((32, 4 * qw, 4), dtype=np.int64), np.zeros((32, 4 * qw, 4), dtype=np.int64)
    for lane in range(32):
        for p in range(4):
            kp = f[p] * S[p // 2]
            for w in range(qw):
                for i in range(4):
                    qhi[lane, qw * p + w, i], qlo[lane, qw * p + w, i] = _int8_hi_lo(xs[lane, p, 4 * w + i], kp)
    kt = _f32(16777216.0)
    return qhi, qlo, (mx0 / (_f32(16256.0) * kt), mx1 / (_f32(16256.0) * kt))


def imma(acc, a_regs, b_regs):
    """acc[lane][4] += A.B for mma.m16n8k32 (u8 A [16, 32], s8 B [32, 8], PTX ISA fragments): a0 / a2 row g,
    k 4t..4t+3 / 16+4t..; a1 / a3 the same for row g + 8; b0 / b1 k 4t.. / 16+4t.. of column g. Registers as
    lists of 4 byte values."""
    A, B = np.zeros((16, 32), dtype=np.int64), np.zeros((32, 8), dtype=np.int64)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        a = a_regs[lane]
        A[g, 4 * t:4 * t + 4], A[g + 8, 4 * t:4 * t + 4] = a[0], a[1]
        A[g, 16 + 4 * t:20 + 4 * t], A[g + 8, 16 + 4 * t:20 + 4 * t] = a[2], a[3]
        B[4 * t:4 * t + 4, g], B[16 + 4 * t:20 + 4 * t, g] = b_regs[lane][0], b_regs[lane][1]
    C = A @ B
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        acc[lane] += np.array([C[g, 2 * t], C[g, 2 * t + 1], C[g + 8, 2 * t], C[g + 8, 2 * t + 1]])


def int4_nibbles(lo, hi):
    """int2_history.cu int4_nibbles: a word of INT4 keys' code bytes, lo (k_codes') and hi (k_hi's), as (n02, n13),
    bytes c_0 | c_2 << 4 and c_1 | c_3 << 4 with c_p = lo_p | hi_p << 2."""
    m = 0xFFFFFFFF
    n02 = (lo & 0x33333333) | ((hi << 2) & m & 0xCCCCCCCC)
    n13 = ((lo >> 2) & 0x33333333) | (hi & 0xCCCCCCCC)
    return n02, n13


def k_plane_words(lo, hi, p):
    """The A word of plane p (u8 bytes c / PLANE_F[p]) from one code word, as k_dot_d128 / the D-64 K dot mask it:
    INT2 (hi None): lo & 0x03030303 << 2p (c 4^p); INT4: (n13 if p odd else n02) & 0x0f0f0f0f (p < 2) or 0xf0f0f0f0
    (c 16)."""
    if hi is None:
        return lo & (0x03030303 << (2 * p))
    n02, n13 = int4_nibbles(lo, hi)
    return (n13 if p & 1 else n02) & (0x0F0F0F0F if p < 2 else 0xF0F0F0F0)


def integer_k_dot(kc, qhi, qlo, kh=None):
    """The D-128 integer K dot of one tile (k_dot_d128): codes kc [16 tokens, 32 bytes] (kh: the high planes of INT4
    keys, or None); lane (g, t)'s code words of bytes 8t .. 8t + 3 and 8t + 4 .. 8t + 7 of tokens sigma(g),
    sigma(g) + 8, masked per plane p (k_plane_words: c 4^p, or INT4 c / PLANE_F_K4[p]) as u8 A, against qhi /
    qlo[2p], [2p + 1] as B. Returns the s32 accumulators (ih, il) of plane groups 0 (planes 0, 1) and 1 (planes 2,
    3)."""
    ih = [np.zeros((32, 4), dtype=np.int64) for _ in range(2)]
    il = [np.zeros((32, 4), dtype=np.int64) for _ in range(2)]
    for p in range(4):
        a_regs = []
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            regs = []
            for off, row in ((8 * t, sigma(g)), (8 * t, sigma(g) + 8), (8 * t + 4, sigma(g)), (8 * t + 4, sigma(g) + 8)):
                regs.append(u8s(k_plane_words(word(kc[row], off), None if kh is None else word(kh[row], off), p)))
            a_regs.append(regs)
        imma(ih[p // 2], a_regs, [[qhi[lane, 2 * p], qhi[lane, 2 * p + 1]] for lane in range(32)])
        imma(il[p // 2], a_regs, [[qlo[lane, 2 * p], qlo[lane, 2 * p + 1]] for lane in range(32)])
    return ih, il


@pytest.mark.parametrize("hc", [4, 8])
def test_integer_k_dot_with_the_kernels_int8_q(hc):
    """The K dot as the production kernel runs it: the lane's code bytes 8t .. 8t + 7
    of tokens sigma(g), sigma(g) + 8 masked per plane (c 4^p in each byte) as u8 A, q as int8 hi / lo (kernel_int8_q)
    as B, hi . 128 + lo per plane group, times iS_gp: the same dot as the fp16 path (check_history_k_dot, both groups in
    units of 2^-24 after the fp16 path's 1/16), within the 14-bit quantization of q. The source's expressions are
    checked verbatim."""
    src = open(PRODUCTION_SOURCE).read()
    for line in ("const uint32_t M = K4 ? (p < 2 ? 0x0f0f0f0fu : 0xf0f0f0f0u) : 0x03030303u << (2 * p);",
                 "uint2 e0 = kw0, e1 = kw1, f0 = kw0, f1 = kw1;",
                 "const uint2 u0 = p & 1 ? f0 : e0, u1 = p & 1 ? f1 : e1;",
                 "const uint32_t a0 = u0.x & M, a1 = u1.x & M, a2 = u0.y & M, a3 = u1.y & M;",
                 "imma16832(p < 2 ? ih0 : ih1, a0, a1, a2, a3, qhi[2 * p], qhi[2 * p + 1]);",
                 "imma16832(p < 2 ? il0 : il1, a0, a1, a2, a3, qlo[2 * p], qlo[2 * p + 1]);",
                 "acc0[e] = (float)(ih0[e] * 128 + il0[e]);",
                 "q_pair(a, qraw[p], 2 * hh + w, qvalid, qrow + d);",
                 "xs[p][4 * hh + 2 * w] = x0;",
                 "for (int i = 0; i < 8; ++i) mq[p] = fmaxf(mq[p], fabsf(xs[p][i]));",
                 "float mx0 = fmaxf(mq[0], plane_f(K4, 1) * mq[1]), mx1 = fmaxf(plane_f(K4, 2) * mq[2], "
                 "plane_f(K4, 3) * mq[3]);",
                 "const float kp = plane_f(K4, p) * (p < 2 ? S0 : S1);",
                 "const float S0 = mx0 > 1e-30f ? 16256.f / mx0 : 0.f, S1 = mx1 > 1e-30f ? 16256.f / mx1 : 0.f;",
                 "const float hm = fmaf(x, kp * (1.f / 128.f), kRoundMagic);",
                 "const float lm = fmaf(x, kp, fmaf(hm, -128.f, 128.f * kRoundMagic)) + kRoundMagic;",
                 "qhi[(D / 64) * p + w] = pack_s8(hb[0], hb[1], hb[2], hb[3]);",  # 2p + w at D 128
                 "return prmt(prmt(x0, x1, 0x0040), prmt(x2, x3, 0x0040), 0x5410);",
                 "iS0 = mx0 / (16256.f * kTwo24);",
                 "const float sc0a = k0a.x * iS0, mn0a = k0a.y, sc1a = k1a.x * iS1, mn1a = k1a.y;"):
        assert line in src, line
    assert "return p == 0 ? 1.f : p == 1 ? (k4 ? 1.f : 0.25f) : p == 2 ? 0.0625f : (k4 ? 0.0625f : 0.015625f);" in src
    rng = np.random.default_rng(40 + hc)
    kc = rng.integers(0, 256, (16, 32))
    q = rng.standard_normal((hc, 128)) * 0.5
    q[0] *= 0.01  # a head of much smaller norm shares the warp's scale
    head = (lambda c: c) if hc == 8 else (lambda c: c & 3)
    c0 = 1 / math.sqrt(128) * LOG2E
    qhi, qlo, (is0, is1) = kernel_int8_q(q, head, c0)
    assert np.abs(qhi).max() <= 127 and np.abs(qlo).max() <= 64
    zhi, zlo, _ = kernel_int8_q(np.zeros_like(q), head, c0)  # an all-zero q: S 0, no inf . 0
    assert not zhi.any() and not zlo.any()
    ih, il = integer_k_dot(kc, qhi, qlo)
    assert max(np.abs(ih[i] * 128 + il[i]).max() for i in range(2)) < 2 ** 31
    # in the fp16 path's units: group 0 2^-24, group 1 2^-20 (check_history_k_dot), so group 1 carries 16 iS1
    acc = group_acc(ih, il, is0, is1)
    # and tighter than that check's tolerance: the error of 14-bit q against the float64 dot, relative to the dot's
    # scale (max |q| . sum |codes|) per group
    check_history_k_dot(acc, kc, q * c0, head, scale_tol=2e-4)


# ---- head_dim 64 (int2_history_kernel<NSTAGE, HC, TWO_G, 64>, SmolLM2) -----------------------------------------------
# Planes of 16 dims: a token's codes are 16 bytes, byte j holding dims j + 16p in bits 2p, 2p + 1 (quant/pack.py's
# quarter planes at D 64; codes() above reads them as dims p*16 + j); K and V groups of 32 dims (planes 0, 1 and 2, 3).
# The K dot pairs planes 2pp, 2pp + 1 in one m16n8k32 per plane group; the V dot has 4 m-tiles, m-tile p = plane p.
# The K dot is the integer one at D 64 too.


def d64_branches(src):
    """The text of every braced `if constexpr (D == 64) { ... }` block of the source (comments dropped, braces
    matched), so that a verbatim check of a D-64 line cannot be met by the same line of the D-128 branch."""
    code = "\n".join(line.split("//")[0] for line in src.splitlines())
    out, key = [], "if constexpr (D == 64) {"
    i = code.find(key)
    while i >= 0:
        j, depth = i + len(key), 1
        while depth:
            depth += {"{": 1, "}": -1}.get(code[j], 0)
            j += 1
        out.append(code[i:j])
        i = code.find(key, j)
    return "\n".join(out)


def word16(row, off):
    """The 16-bit load at byte off of a code row, zero-extended to 32 bits (the V loads' uint16_t -> uint32_t)."""
    return int(row[off]) | int(row[off + 1]) << 8


def u8s(w):
    return [(w >> (8 * i)) & 0xFF for i in range(4)]


def kernel_int8_q_d64(q, head_of_column, c0, k4=False):
    """The D-64 q for the integer K dot, as int2_history_kernel<.., 64> builds it, in fp32 as the kernel rounds it:
    lane (g, t) holds xs[p][i] = c0 q of column g's head at dims p*16 + t*4 + i (load_q4 per plane p, q_pair words
    x, y), and register p (= 2pp + w: plane pair pp, k-half w of its m16n8k32) holds plane p's four values
    c0 q 4^-p S_gp as int8 hi (qhi) and lo (qlo), with kernel_int8_q's scales and rounding (S_gp = 16256 / the warp's
    max over plane group gp). Returns qhi, qlo [32 lanes, 4 registers, 4 bytes], (iS0, iS1) and the lanes' group
    sums (gs0, gs1) [32] before the quad's shuffles."""
    xs = np.zeros((32, 4, 4), dtype=np.float32)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for p in range(4):
            xs[lane, p] = (q[head_of_column(g), p * 16 + t * 4:p * 16 + t * 4 + 4] * c0).astype(np.float32)
    gs = xs.astype(np.float64)[:, :2].sum((1, 2)), xs.astype(np.float64)[:, 2:].sum((1, 2))
    return (*int8_q_of_xs(xs, k4), gs)


def history_k_dot_d64(kc, qhi, qlo, m1_shift=2, kh=None):
    """The D-64 integer K dot of one tile: codes kc [16 tokens, 16 bytes]; lane (g, t) reads the word of bytes
    4t .. 4t + 3 of tokens sigma(g), sigma(g) + 8 (kx0, kx1); per plane pair pp, M0 = 0x03030303 << 4pp takes plane 2pp
    and M1 = M0 << m1_shift (the kernel's 2: plane 2pp + 1) as u8 A (a0 = kx0 & M0, a1 = kx1 & M0, a2 = kx0 & M1,
    a3 = kx1 & M1: c 4^p per byte), against B = qhi / qlo[2pp], [2pp + 1]. kh (INT4 keys' high planes): the words
    int4_nibbles(kx, hx) = (e, f), M0 = M1 = 0x0f0f0f0f << 4pp, a0 = e0 & M0, a2 = f0 & M1 (c, or c 16 at pp 1).
    Returns the s32 accumulators (ih, il) of plane groups 0 and 1."""
    ih = [np.zeros((32, 4), dtype=np.int64) for _ in range(2)]
    il = [np.zeros((32, 4), dtype=np.int64) for _ in range(2)]
    for pp in range(2):
        M0 = (0x0F0F0F0F << (4 * pp)) if kh is not None else 0x03030303 << (4 * pp)
        M1 = M0 if kh is not None else (M0 << m1_shift) & 0xFFFFFFFF  # uint32
        a_regs = []
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            kx0, kx1 = word(kc[sigma(g)], 4 * t), word(kc[sigma(g) + 8], 4 * t)
            e0, f0, e1, f1 = kx0, kx0, kx1, kx1
            if kh is not None:
                (e0, f0), (e1, f1) = (int4_nibbles(kx, word(kh[row], 4 * t))
                                      for kx, row in ((kx0, sigma(g)), (kx1, sigma(g) + 8)))
            a_regs.append([u8s(e0 & M0), u8s(e1 & M0), u8s(f0 & M1), u8s(f1 & M1)])
        imma(ih[pp], a_regs, [[qhi[lane, 2 * pp], qhi[lane, 2 * pp + 1]] for lane in range(32)])
        imma(il[pp], a_regs, [[qlo[lane, 2 * pp], qlo[lane, 2 * pp + 1]] for lane in range(32)])
    return ih, il


def check_history_k_dot_d64(acc, kc, qf, head_of_column, scale_tol=None, K=None):
    """check_history_k_dot at D 64: lane (g, t)'s accumulator entry e is token sigma(g) + 8 (e >> 1) and column
    2t + (e & 1); group 0 = dims 0..31 (planes 0, 1), group 1 = dims 32..63 (planes 2, 3), in the same units as
    check_history_k_dot (2^-24, 2^-20: the caller's group 1 carries 16 iS1, as the D-128 integer test's), so that the
    two checks read alike. scale_tol: |error| <= scale_tol . (the group's max |qf| over all heads . the row's code
    sum). K: the codes [16, 64] (default: the INT2 codes of kc)."""
    K = codes(kc) if K is None else K  # [16, 64]: dims p*16 + j
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for e in range(4):
            row, head = sigma(g) + 8 * (e >> 1), head_of_column(2 * t + (e & 1))
            for grp, unit in ((0, 2.0 ** 24), (1, 2.0 ** 20)):
                dims = slice(32 * grp, 32 * grp + 32)
                want = (qf[head, dims] * K[row, dims]).sum()
                assert acc[grp][lane, e] * unit == pytest.approx(want, rel=2e-3, abs=2e-3)
                if scale_tol is not None:
                    scale = np.abs(qf[:, dims]).max() * K[row, dims].sum()
                    assert abs(acc[grp][lane, e] * unit - want) <= scale_tol * scale


@pytest.mark.parametrize("hc", [4, 8])
def test_d64_int8_q_layout(hc):
    """Pins the D-64 q build (kernel_int8_q_d64, the D == 64 branches of the prologue): lane (g, t)'s register p,
    byte i is c0 q of column g's head (g & 3 at HC 4, g at HC 8) at dim p*16 + t*4 + i, as 128 hi + lo = rint(c0 q
    4^-p S_gp) (hi in [-127, 127], lo in [-64, 64]), with S_gp from the warp's max over plane group gp (planes 0, 1:
    dims 0..31; 2, 3: dims 32..63, the K groups of 32); the quad's group sums gs0 / gs1 (the min terms' Q0, Q1) are
    the head's sums over dims 0..31 / 32..63; an all-zero q gives S 0, all-zero int8 and no NaN."""
    rng = np.random.default_rng(60 + hc)
    q = rng.standard_normal((hc, 64)) * 0.5
    q[1] *= 0.01
    head = (lambda c: c) if hc == 8 else (lambda c: c & 3)
    c0 = 1 / math.sqrt(64) * LOG2E
    qhi, qlo, (is0, is1), (gs0, gs1) = kernel_int8_q_d64(q, head, c0)
    assert np.abs(qhi).max() <= 127 and np.abs(qlo).max() <= 64
    qf = q * c0
    S = [1 / (float(is0) * 2.0 ** 24), 1 / (float(is1) * 2.0 ** 24)]
    assert max(np.abs(qf[:, :16]).max(), np.abs(qf[:, 16:32]).max() / 4) * S[0] == pytest.approx(16256, rel=1e-6)
    assert max(np.abs(qf[:, 32:48]).max() / 16, np.abs(qf[:, 48:]).max() / 64) * S[1] == pytest.approx(16256, rel=1e-6)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for p in range(4):
            for i in range(4):
                v = qf[head(g), p * 16 + t * 4 + i] * 4.0 ** -p * S[p // 2]
                assert abs(128 * qhi[lane, p, i] + qlo[lane, p, i] - v) <= 0.5 + 1e-3 * abs(v) / 16256 + 1e-3
    for g in range(8):  # the quad's shuffle-xor sums
        quad = range(4 * g, 4 * g + 4)
        assert sum(gs0[ln] for ln in quad) == pytest.approx(qf[head(g), :32].sum(), rel=1e-5, abs=1e-6)
        assert sum(gs1[ln] for ln in quad) == pytest.approx(qf[head(g), 32:].sum(), rel=1e-5, abs=1e-6)
    zhi, zlo, (z0, z1), _ = kernel_int8_q_d64(np.zeros_like(q), head, c0)  # S 0, no inf . 0
    assert not zhi.any() and not zlo.any() and z0 == 0 and z1 == 0


@pytest.mark.parametrize("hc", [4, 8])
def test_d64_integer_k_dot_with_the_kernels_int8_q(hc):
    """Pins the D-64 integer K dot (the D == 64 branch of the tile's K dot): the lane's bytes 4t .. 4t + 3 of tokens
    sigma(g), sigma(g) + 8 masked with M0 / M1 for planes 2pp / 2pp + 1 as A's k 4t.. / 16 + 4t.. of one m16n8k32 per
    plane group, against qhi / qlo[2pp], [2pp + 1] (kernel_int8_q_d64), hi . 128 + lo times iS_gp: the direct dot of
    c0 q with the codes per group of 32 dims, within the 14-bit quantization of q, for a head of much smaller norm
    sharing the warp's scale too. An all-zero q gives an all-zero dot. Negative control: with M1 = M0 << 4 (plane
    2pp + 2 in place of 2pp + 1) the same check fails, so it does see the plane masks."""
    rng = np.random.default_rng(70 + hc)
    kc = rng.integers(0, 256, (16, 16))
    q = rng.standard_normal((hc, 64)) * 0.5
    q[0] *= 0.01  # a head of much smaller norm shares the warp's scale
    head = (lambda c: c) if hc == 8 else (lambda c: c & 3)
    c0 = 1 / math.sqrt(64) * LOG2E
    qhi, qlo, (is0, is1), _ = kernel_int8_q_d64(q, head, c0)

    def acc_of(ih, il):  # group 1 in the fp16 path's units of 2^-20 (check_history_k_dot_d64), as the D-128 test
        assert max(np.abs(ih[i] * 128 + il[i]).max() for i in range(2)) < 2 ** 31
        return group_acc(ih, il, is0, is1)

    check_history_k_dot_d64(acc_of(*history_k_dot_d64(kc, qhi, qlo)), kc, q * c0, head, scale_tol=2e-4)
    with pytest.raises(AssertionError):  # the mutated mask: the check catches it
        check_history_k_dot_d64(acc_of(*history_k_dot_d64(kc, qhi, qlo, m1_shift=4)), kc, q * c0, head)
    zhi, zlo, _, _ = kernel_int8_q_d64(np.zeros_like(q), head, c0)
    zh, zl = history_k_dot_d64(kc, zhi, zlo)
    assert not any(a.any() for a in zh + zl)


def history_v_dot_d64(vc, operands_of_mtile, mask_shift=lambda p: 2 * p):
    """The D-64 V dot of one tile: V codes vc [16 tokens, 16 bytes]; lane (g, t) reads the 16-bit value at bytes 2g,
    2g + 1 (dims 16p + 2g, + 1) of tokens t, t + 4, t + 8, t + 12 (wA .. wD); e0 / e1 = prmt(wA, wB, 0x4400 / 0x5511)
    put byte 0 / 1 of tokens t, t + 4 into two halfwords (f0 / f1 the same of wC, wD), and m-tile p (= plane p) masks
    them with 0x00030003 << mask_shift(p) (the kernel's 2p: fp16 subnormals c 4^p 2^-24) as A = (e0, e1, f0, f1)
    against the B pair operands_of_mtile(p)."""
    o = [np.zeros((32, 4)) for _ in range(4)]
    for mt in range(4):
        M = 0x00030003 << mask_shift(mt)
        b0, b1 = operands_of_mtile(mt)
        a_regs = []
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            wa, wb, wc, wd = (word16(vc[r], 2 * g) for r in (t, t + 4, t + 8, t + 12))
            e0, e1 = prmt(wa, wb, 0x4400), prmt(wa, wb, 0x5511)
            f0, f1 = prmt(wc, wd, 0x4400), prmt(wc, wd, 0x5511)
            a_regs.append([e0 & M, e1 & M, f0 & M, f1 & M])
        mma(o[mt], a_regs, [[b0[lane], b1[lane]] for lane in range(32)])
    return o


def check_history_v_dot_d64(o, P, vs, vc, head_of_column, mtiles_of_lane, d0_of=lambda p, g: 16 * p + 2 * g):
    """The D-64 epilogue (park at D 64): lane (g, t) keeps m-tiles mtiles_of_lane(t); m-tile p's rows g, g + 8 are dims
    d0, d0 + 1 (d0 = d0_of(p, g), the kernel's 16p + 2g) of heads head0, head0 + 1 (columns 2t, 2t + 1), and
    o . 2^(24 - 2p) is sum over tokens of P[tok, head] . vs[tok, d // 32] . V[tok, d]. Returns the (head, dim) list
    of every output written."""
    V = codes(vc)  # [16, 64]: dims p*16 + j
    written = []
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        head0 = head_of_column(2 * t)
        for p in mtiles_of_lane(t):
            d0 = d0_of(p, g)
            for e, (head, d) in enumerate(((head0, d0), (head0 + 1, d0), (head0, d0 + 1), (head0 + 1, d0 + 1))):
                assert 0 <= d < 64
                want = sum(P[tok, head] * vs[tok, d // 32] * V[tok, d] for tok in range(16))
                assert o[p][lane, e] * 2.0 ** (24 - 2 * p) == pytest.approx(want, rel=3e-3, abs=1e-3)
                written.append((head, d))
    return written


@pytest.mark.parametrize("hc", [4, 8])
@pytest.mark.parametrize("seed", [0, 1])
def test_d64_v_dot_from_the_k_accumulator_layout(seed, hc):
    """Pins the D-64 V dot and its epilogue (the D == 64 branches of the V dot and of park): the 16-bit V loads at
    bytes 2g of tokens t, t + 4, t + 8, t + 12, the 0x4400 / 0x5511 PRMTs, m-tile p = plane p, and park's D-64 dims
    16p + 2g, + 1. HC 4: one p.vscale operand pair (columns 0..3 group 0's scale, 4..7 group 1's) for all four
    m-tiles, lanes t < 2 keep m-tiles 0, 1 (dims 0..31, V group 0), t >= 2 m-tiles 2, 3; HC 8: m-tiles 0, 1 take
    group 0's operands, 2, 3 group 1's, and every lane keeps all four. Every (head, dim) output of the tile is
    written exactly once. Negative control: d0 = 16p + 4g in the epilogue fails the check."""
    rng = np.random.default_rng(seed + 80 + hc)
    vc = rng.integers(0, 256, (16, 16))
    P = rng.random((16, hc))  # p of token (tile row) and head
    vs = rng.random((16, 2)) * 0.3 + 0.05  # V scale of token and group (dims 0..31, 32..63)
    if hc == 4:
        head = lambda c: c & 3  # noqa: E731
        b = p_operands(P, vs, head, lambda t: t >> 1)
        operands = lambda mt: b  # noqa: E731  (one pair serves both V groups)
        kept = lambda t: range(2 * (t >> 1), 2 * (t >> 1) + 2)  # noqa: E731  (park(G0 * gsel + i, ..), G0 2)
    else:
        head = lambda c: c  # noqa: E731
        ops = [p_operands(P, vs, head, lambda t, grp=grp: grp) for grp in range(2)]
        operands = lambda mt: ops[0] if mt < 2 else ops[1]  # noqa: E731  (mt < 2 ? b0 : c0)
        kept = lambda t: range(4)  # noqa: E731
    o = history_v_dot_d64(vc, operands)
    written = check_history_v_dot_d64(o, P, vs, vc, head, kept)
    assert len(written) == len(set(written)) == hc * 64  # every output of the tile written exactly once
    with pytest.raises(AssertionError):  # a mutated epilogue map: the check catches it
        check_history_v_dot_d64(o, P, vs, vc, head, kept, d0_of=lambda p, g: 16 * p + 4 * g)
    with pytest.raises(AssertionError):  # a mutated plane mask (m-tile p reading plane p + 1's bits)
        check_history_v_dot_d64(history_v_dot_d64(vc, operands, mask_shift=lambda p: 2 * p + 2), P, vs, vc, head,
                                kept)


def test_d64_layouts_match_the_kernel_source():
    """The D-64 lines the emulations above rest on, verbatim: inside the `if constexpr (D == 64)` blocks (so that the
    D-128 branch's same-looking lines cannot satisfy them) the stage's 16-byte code rows, the K words kx0 / kx1, the
    masks M0 / M1, the A registers and both m16n8k32 calls, the V loads' offsets, the PRMTs, the V mask and m16n8k16
    call, the q build's q_pair words and group sums; outside them, load_q4 per plane, the shared int8 q loop (one
    register per plane at D 64) and the epilogue shared with D 128 (park: D 64's dims, its m-tile selection)."""
    src = open(PRODUCTION_SOURCE).read()
    d64 = d64_branches(src)
    for line in ("cp_async16(st + tok * 16, a.kc + (size_t)r * 16u, n);",
                 "cp_async16(st + SL::kVcOff + tok * 16, a.vc + (size_t)r * 16u, n);",
                 "const float2 xq = q_pair(a, qraw[p], w, qvalid, qrow + p * 16 + t * 4 + 2 * w);",
                 "if (p < 2) gs0 += xq.x + xq.y; else gs1 += xq.x + xq.y;",
                 "xs[p][2 * w] = xq.x;",
                 "xs[p][2 * w + 1] = xq.y;",
                 "for (int i = 0; i < 4; ++i) mq[p] = fmaxf(mq[p], fabsf(xs[p][i]));",
                 "const uint8_t* kcs = st + j * 16 * 16;",
                 "const uint32_t kx0 = *reinterpret_cast<const uint32_t*>(kcs + sg * 16 + t * 4);",
                 "const uint32_t kx1 = *reinterpret_cast<const uint32_t*>(kcs + (sg + 8) * 16 + t * 4);",
                 "for (int pp = 0; pp < 2; ++pp) {",
                 "uint32_t e0 = kx0, e1 = kx1, f0 = kx0, f1 = kx1;",
                 "const uint8_t* khs = st + SL::kKhOff + j * 16 * 16;",
                 "int4_nibbles(kx0, *reinterpret_cast<const uint32_t*>(khs + sg * 16 + t * 4), e0, f0);",
                 "int4_nibbles(kx1, *reinterpret_cast<const uint32_t*>(khs + (sg + 8) * 16 + t * 4), e1, f1);",
                 "const uint32_t M0 = K4 ? (pp ? 0xf0f0f0f0u : 0x0f0f0f0fu) : 0x03030303u << (4 * pp);",
                 "const uint32_t M1 = K4 ? M0 : M0 << 2;",
                 "const uint32_t a0 = e0 & M0, a1 = e1 & M0, a2 = f0 & M1, a3 = f1 & M1;",
                 "imma16832(pp ? ih1 : ih0, a0, a1, a2, a3, qhi[2 * pp], qhi[2 * pp + 1]);",
                 "imma16832(pp ? il1 : il0, a0, a1, a2, a3, qlo[2 * pp], qlo[2 * pp + 1]);",
                 "acc0[e] = (float)(ih0[e] * 128 + il0[e]);",
                 "acc1[e] = (float)(ih1[e] * 128 + il1[e]);",
                 "const uint8_t* vcs = st + SL::kVcOff + j * 16 * 16 + 2 * g;",
                 "const uint32_t wA = *reinterpret_cast<const uint16_t*>(vcs + t * 16);",
                 "const uint32_t wB = *reinterpret_cast<const uint16_t*>(vcs + (t + 4) * 16);",
                 "const uint32_t wC = *reinterpret_cast<const uint16_t*>(vcs + (t + 8) * 16);",
                 "const uint32_t wD = *reinterpret_cast<const uint16_t*>(vcs + (t + 12) * 16);",
                 "const uint32_t e0 = prmt(wA, wB, 0x4400), e1 = prmt(wA, wB, 0x5511);",
                 "const uint32_t f0 = prmt(wC, wD, 0x4400), f1 = prmt(wC, wD, 0x5511);",
                 "for (int mt = 0; mt < 4; ++mt) {",
                 "const uint32_t M = 0x00030003u << (2 * mt);",
                 "mma16816(o[mt], e0 & M, e1 & M, f0 & M, f1 & M, mt < 2 ? b0 : c0, mt < 2 ? b1 : c1);"):
        assert line in d64, line
    # the epilogue, shared with D 128: NMT = 4 m-tiles at D 64, G0 = 2 of V group 0; HC 4 lanes keep G0 of them
    for line in ("constexpr int kSB = SL::kBytes, NMT = D / 16;",
                 "constexpr int G0 = NMT / 2;",
                 "for (int e = 0; e < 4; ++e) c[e] = gsel ? o[G0 + i][e] : o[i][e];",
                 "park(G0 * gsel + i, c, lv0, lv1);",
                 "for (int mt = 0; mt < NMT; ++mt) park(mt, o[mt], mt < G0 ? lv0 : lw0, mt < G0 ? lv1 : lw1);"):
        assert line in src, line
    park = src[src.index("auto park = "):]
    park = park[:park.index("\n  };")]
    for line in ("const int p = D == 64 ? mt : mt >> 1, hb = mt & 1;",
                 "const float fac = __int_as_float((127 + 24 - 2 * p) << 23);",
                 "const int d0 = D == 64 ? p * 16 + 2 * g : p * 32 + 4 * g + 2 * hb;",
                 "ow[head0 * D + d0] = fmaf(c[0], fac, v0);",
                 "ow[(head0 + 1) * D + d0] = fmaf(c[1], fac, v1);",
                 "ow[head0 * D + d0 + 1] = fmaf(c[2], fac, v0);",
                 "ow[(head0 + 1) * D + d0 + 1] = fmaf(c[3], fac, v1);"):
        assert line in park, line
    for line in ("if constexpr (D == 64) qraw[p] = load_q4(a, qvalid, qrow + p * 16 + t * 4);",
                 "const uint2 v = __ldg(reinterpret_cast<const uint2*>(reinterpret_cast<const uint16_t*>(a.q) + i));",
                 "return make_uint4(v.x, v.y, 0u, 0u);",  # words x, y: elements i, i + 1 and i + 2, i + 3
                 "const uint32_t wd = k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w;",
                 "uint32_t qhi[D / 16], qlo[D / 16];",
                 "for (int w = 0; w < D / 64; ++w) {",
                 "const float x = xs[p][4 * w + i];",
                 "qhi[(D / 64) * p + w] = pack_s8(hb[0], hb[1], hb[2], hb[3]);",
                 "qlo[(D / 64) * p + w] = pack_s8(lb[0], lb[1], lb[2], lb[3]);",
                 "const int head0 = HC == 8 ? 2 * t : (2 * t) & 3;",
                 "const int qhead = HC == 8 ? g : (g & 3);",
                 "const float sc0a = k0a.x * iS0, mn0a = k0a.y, sc1a = k1a.x * iS1, mn1a = k1a.y;"):
        assert line in src, line
    # the D-128 branch keeps its own lines (the blocks above are not the whole kernel)
    assert "const uint32_t M = K4 ? (p < 2 ? 0x0f0f0f0fu : 0xf0f0f0f0u) : 0x03030303u << (2 * p);" not in d64


# ---- paired tiles (int2_history.cu pair_tiles: D 128, HC 4) ----------------------------------------------------------
# The two 16-token tiles of a 32-token block share one softmax: lane (g, t) keeps tile t >> 1's K accumulator (columns
# 2t, 2t + 1 are heads (2t) & 3, + 1 of that tile), the V operands of both groups are transposed once and masked by
# column (g < 4: tile 0), O's columns 0..3 gather tile 0's tokens and 4..7 tile 1's, and lanes t, t ^ 2 merge after
# the loop. The emulation below runs one block that way, from the kernel's int8 q to the parked outputs, and compares
# them with a float64 attention over the block's 32 dequantized rows.


def paired_block(kc, vc, kp, vp, q, c0):
    """One 32-token block through the paired-tile path of the history loop (HC 4, groups of 64). kc / vc: codes
    [32 tokens, 32 bytes] (tile 0 = tokens 0..15, in the stage's order); kp / vp: (scale, min) per token and group
    [32, 2, 2] (as e4m3-exact floats, the kernel's fp8x2 decode); q [4 heads, 128]; c0 = sm_scale log2 e. Returns out [4, 128] = o / l as the
    CTA merge of this single warp would store it, lse [4] = m + log2 l (log2 units) as the lanes t < 2 of row g 0
    hand it to the CTA merge, and the (head, dim) outputs each lane parked."""
    head = lambda c: c & 3  # noqa: E731  (HC 4: columns 4..7 repeat heads 0..3)
    qhi, qlo, (is0, is1) = kernel_int8_q(q, head, c0)
    qf = q * c0
    # the min terms' group sums per head (q00 .. q11: the quad's shuffled sums / 2^24)
    qsum = [(qf[:, 64 * grp:64 * grp + 64].sum(-1) / 2.0 ** 24) for grp in range(2)]
    acc = {}
    for tile in range(2):  # both tiles' K dots, as the kernel runs them (k_dot_d128 twice)
        ih, il = integer_k_dot(kc[16 * tile:16 * tile + 16], qhi, qlo)
        acc[tile] = [(ih[i] * 128 + il[i]).astype(np.float64) for i in range(2)]
    # per lane: its tile tj = t >> 1 (the select), scores in units of 2^-24 log2, p with the tile's max per column
    s = np.zeros((32, 4))
    tok_of = np.zeros((32, 4), dtype=np.int64)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        tj = t >> 1
        for e in range(4):
            tok = 16 * tj + sigma(g) + 8 * (e >> 1)
            h = head(2 * t + (e & 1))
            tok_of[lane, e] = tok
            s[lane, e] = (acc[tj][0][lane, e] * kp[tok, 0, 0] * float(is0) + acc[tj][1][lane, e] * kp[tok, 1, 0]
                          * float(is1) + kp[tok, 0, 1] * qsum[0][h] + kp[tok, 1, 1] * qsum[1][h])
    m = np.zeros((32, 2))
    for lane in range(32):  # the rescale's max: over the 8 lanes of the same t (rows g, g + 8: the tile's 16 tokens)
        t = lane & 3
        same = [ln for ln in range(32) if ln & 3 == t]
        m[lane] = [max(s[ln, c] for ln in same for c in (c0_, c0_ + 2)) * 2.0 ** 24 for c0_ in (0, 1)]
    P = np.exp2(s * 2.0 ** 24 - m[:, [0, 1, 0, 1]])
    # the V operands of both groups: p . vscale of the lane's tokens, movmatrix.trans, then masked by column
    ops = []
    for grp in range(2):
        h01 = [pack(P[ln, 0] * vp[tok_of[ln, 0], grp, 0], P[ln, 1] * vp[tok_of[ln, 0], grp, 0]) for ln in range(32)]
        h23 = [pack(P[ln, 2] * vp[tok_of[ln, 2], grp, 0], P[ln, 3] * vp[tok_of[ln, 2], grp, 0]) for ln in range(32)]
        ops.append((movmatrix_trans(h01), movmatrix_trans(h23)))
    cmask = [0xFFFFFFFF if (ln >> 2) < 4 else 0 for ln in range(32)]
    o = [np.zeros((32, 4)) for _ in range(8)]
    for tile in range(2):
        mask = [cm if tile == 0 else (~cm & 0xFFFFFFFF) for cm in cmask]
        masked = [tuple([b[ln] & mask[ln] for ln in range(32)] for b in pair) for pair in ops]
        ot = history_v_dot(vc[16 * tile:16 * tile + 16], lambda mt: masked[0] if mt < 4 else masked[1])
        for mt in range(8):
            o[mt] += ot[mt]
    # l, lv (group 0), lw (group 1) of the lane's two columns, summed over the lanes of the same t
    l, lv, lw = np.zeros((32, 2)), np.zeros((32, 2)), np.zeros((32, 2))
    for lane in range(32):
        t = lane & 3
        for ln in (x for x in range(32) if x & 3 == t):
            for c in range(2):
                for e in (c, c + 2):
                    l[lane, c] += P[ln, e]
                    lv[lane, c] += P[ln, e] * vp[tok_of[ln, e], 0, 1]
                    lw[lane, c] += P[ln, e] * vp[tok_of[ln, e], 1, 1]
    # the merge of lanes t, t ^ 2 (same heads, the other tile's tokens)
    part = lambda x: x[[ln ^ 2 for ln in range(32)]]  # noqa: E731
    n = np.maximum(m, part(m))
    a, z = np.exp2(m - n), np.exp2(part(m) - n)
    l, lv, lw = (x * a + part(x) * z for x in (l, lv, lw))
    o = [x * a[:, [0, 1, 0, 1]] + part(x) * z[:, [0, 1, 0, 1]] for x in o]
    m = n
    lse = np.array([m[lane, hh] + np.log2(l[lane, hh]) for lane in (0, 1) for hh in (0, 1)])  # g 0, t < 2: heads 0..3
    # park: lane (g, t) stores the m-tiles of group t >> 1 with that group's min sums (lv or lw), heads head0, + 1
    out = np.full((4, 128), np.nan)
    seen = set()
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        gsel, head0 = t >> 1, (2 * t) & 3
        for i in range(4):
            mt = 4 * gsel + i
            p, hb = mt >> 1, mt & 1
            d0 = p * 32 + 4 * g + 2 * hb
            vmin = lw[lane] if gsel else lv[lane]
            for e, (hh, d) in enumerate(((0, d0), (1, d0), (0, d0 + 1), (1, d0 + 1))):
                out[head0 + hh, d] = (o[mt][lane, e] * 2.0 ** (24 - 2 * p) + vmin[hh]) / l[lane, hh]
                seen.add((head0 + hh, d))
    return out, lse, seen


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_paired_tiles_block_is_attention_over_its_32_rows(seed):
    rng = np.random.default_rng(70 + seed)
    kc, vc = rng.integers(0, 256, (32, 32)), rng.integers(0, 256, (32, 32))
    # (scale, min) per token and group, e4m3-exact (the cache's params)
    def e4m3(x):
        return torch.from_numpy(x).to(torch.float8_e4m3fn).double().numpy()
    kp = np.stack([e4m3(rng.random((32, 2)) * 0.4 + 0.05), e4m3(-rng.random((32, 2)) * 0.6)], -1)
    vp = np.stack([e4m3(rng.random((32, 2)) * 0.4 + 0.05), e4m3(rng.standard_normal((32, 2)) * 0.3)], -1)
    q = rng.standard_normal((4, 128)) * (1.5 if seed == 2 else 0.5)  # seed 2: a peaked softmax
    c0 = 1 / math.sqrt(128) * LOG2E
    out, lse, seen = paired_block(kc, vc, kp, vp, q, c0)
    assert len(seen) == 4 * 128 and np.isfinite(out).all()  # every (head, dim) parked once
    K, V = codes(kc).astype(np.float64), codes(vc).astype(np.float64)  # dims p*32 + j
    grp = np.arange(128) // 64
    Kh = kp[:, grp, 1] + kp[:, grp, 0] * K
    Vh = vp[:, grp, 1] + vp[:, grp, 0] * V
    sc = (q * c0) @ Kh.T  # log2 units
    p = np.exp2(sc - sc.max(-1, keepdims=True))
    want = (p @ Vh) / p.sum(-1, keepdims=True)
    # fp16 p . vscale operands and the 14-bit q: well under the GPU tests' 1e-2
    err = np.linalg.norm(out - want) / np.linalg.norm(want)
    assert err < 2e-3, err
    # the merged max and sum: the block's log2-sum-exp per head, which the CTA and split merges weigh it by
    np.testing.assert_allclose(lse, np.log2(np.exp2(sc).sum(-1)), rtol=0, atol=1e-3)


def test_paired_tiles_match_the_kernel_source():
    """The lines paired_block rests on, verbatim in the kernel: the instances it applies to, the select of tile tj's
    accumulator, tile tj's K / V params, the column mask of the transposed V operands and the two tiles' V dots, the
    halves' merge and the park of lv / lw by group."""
    src = open(PRODUCTION_SOURCE).read()
    for line in ("return d == 128 && hc == 4 && !wide;",
                 "for (int j = 0; j < (kPair ? 1 : kTok / 16); ++j) {",
                 "const int tj = kPair ? gsel : j;",
                 "k_dot_d128<K4>(st + j * 16 * 32, st + SL::kKhOff + j * 16 * 32, sg, t, qhi, qlo, ih0, il0, ih1, "
                 "il1);",
                 "k_dot_d128<K4>(st + 16 * 32, st + SL::kKhOff + 16 * 32, sg, t, qhi, qlo, jh0, jl0, jh1, jl1);",
                 "ih0[e] = tj ? jh0[e] : ih0[e]; il0[e] = tj ? jl0[e] : il0[e];",
                 "ih1[e] = tj ? jh1[e] : ih1[e]; il1[e] = tj ? jl1[e] : il1[e];",
                 "const int ta = tj * 16 + sg;",
                 "const uint32_t kpa = pword(0, ta), kpb = pword(0, ta + 8);",
                 "const int pa = pos0 + tj * 16 + sg;",
                 "const uint32_t vpa = pword(1, ta), vpb = pword(1, ta + 8);",
                 "if (HC == 4 && !kPair) {",
                 "[[maybe_unused]] const uint32_t cmask = g < 4 ? 0xffffffffu : 0u;",
                 "v_dot_d128(st + SL::kVcOff + 4 * g, t, o, b0 & cmask, b1 & cmask, c0 & cmask, c1 & cmask);",
                 "v_dot_d128(st + SL::kVcOff + 16 * 32 + 4 * g, t, o, b0 & ~cmask, b1 & ~cmask, c0 & ~cmask, "
                 "c1 & ~cmask);",
                 "if (HC == 8 || kPair) { lw0 *= al0; lw1 *= al1; }",
                 "const float pm0 = __shfl_xor_sync(0xffffffffu, m0, 2), pm1 = __shfl_xor_sync(0xffffffffu, m1, 2);",
                 "const float a0 = ex2(m0 - n0), z0 = ex2(pm0 - n0), a1 = ex2(m1 - n1), z1 = ex2(pm1 - n1);",
                 "auto mix = [](float& x, float ax, float zx) { x = fmaf(x, ax, __shfl_xor_sync(0xffffffffu, x, 2) "
                 "* zx); };",
                 "if constexpr (kPair) park(G0 * gsel + i, c, gsel ? lw0 : lv0, gsel ? lw1 : lv1);"):
        assert line in src, line
    # the HC-8 branch's V operands (both groups, every column its own) are the ones the paired tiles use
    assert "const float2 va0 = fp8x2(vpa), vb0 = fp8x2(vpb), va1 = fp8x2(vpa >> 16), vb1 = fp8x2(vpb >> 16);" in src
    assert "lw0 = fmaf(p0, va1.y, fmaf(p2, vb1.y, lw0));" in src
    assert "c0 = movm_trans(h2u(__floats2half2_rn(p0 * va1.x, p1 * va1.x)));" in src


# ---- the v2 cache format: INT4 keys (template K4) and float8 e4m3 (scale, min) pairs ---------------------------------
# INT4 keys arrive as two INT2 quarter-plane buffers (k_codes: code & 3, k_hi: code >> 2; quant/pack.py
# pack_int4_planes); the K dot turns each code word pair into nibble words (int4_nibbles) and masks them per plane.


def int4_rows(rng, rows, d):
    """Random INT4 key codes [rows, d] and their (lo, hi) quarter-plane bytes [rows, d / 4] (the cache's k_codes,
    k_hi)."""
    from sglang_oscar.quant.pack import pack_int4_planes

    c = rng.integers(0, 16, (rows, d))
    lo, hi = pack_int4_planes(torch.from_numpy(c))
    return c, lo.numpy().astype(np.int64), hi.numpy().astype(np.int64)


def test_int4_nibbles_are_the_codes():
    """int4_nibbles: byte k of n02 is c_0 | c_2 << 4 and of n13 c_1 | c_3 << 4, with c_p = lo_p | hi_p << 2 the INT4
    code of plane p in that byte (quant/pack.py unpack_int4_planes), for every byte pair; the plane masks then give
    c . 16^(p >> 1) <= 240 (fits the u8 A operand; c 4^3 would not)."""
    src = open(PRODUCTION_SOURCE).read()
    assert "n02 = (lo & 0x33333333u) | ((hi << 2) & 0xccccccccu);" in src
    assert "n13 = ((lo >> 2) & 0x33333333u) | (hi & 0xccccccccu);" in src
    lo_b, hi_b = np.meshgrid(np.arange(256), np.arange(256))
    for lo_byte, hi_byte in zip(lo_b.ravel()[::7], hi_b.ravel()[::7]):
        for k in range(4):  # the byte in each position of the word, the others random-ish
            lo = (int(lo_byte) << (8 * k)) | (0x5A5A5A5A & ~(0xFF << (8 * k)) & 0xFFFFFFFF)
            hi = (int(hi_byte) << (8 * k)) | (0xA5A5A5A5 & ~(0xFF << (8 * k)) & 0xFFFFFFFF)
            for p in range(4):
                c = (int(lo_byte) >> (2 * p) & 3) | (int(hi_byte) >> (2 * p) & 3) << 2
                a = k_plane_words(lo, hi, p) >> (8 * k) & 0xFF
                assert a == c * (16 if p >= 2 else 1) <= 240
                assert a * PLANE_F_K4[p] == c


@pytest.mark.parametrize("hc", [4, 8])
def test_integer_k_dot_int4_keys(hc):
    """K4 at D 128: the K dot of INT4 codes from their lo / hi planes (k_dot_d128 with khs: int4_nibbles, the K4 plane
    masks) against the kernel's int8 q with the K4 plane factors is the direct dot of c0 q with the INT4 codes, within
    the 14-bit quantization of q; a head of much smaller norm shares the warp's scale."""
    rng = np.random.default_rng(90 + hc)
    K, kc, kh = int4_rows(rng, 16, 128)
    q = rng.standard_normal((hc, 128)) * 0.5
    q[0] *= 0.01
    head = (lambda c: c) if hc == 8 else (lambda c: c & 3)
    c0 = 1 / math.sqrt(128) * LOG2E
    qhi, qlo, (is0, is1) = kernel_int8_q(q, head, c0, k4=True)
    assert np.abs(qhi).max() <= 127 and np.abs(qlo).max() <= 64
    ih, il = integer_k_dot(kc, qhi, qlo, kh=kh)
    acc = group_acc(ih, il, is0, is1)
    check_history_k_dot(acc, kc, q * c0, head, scale_tol=2e-4, K=K)
    with pytest.raises(AssertionError):  # the INT2 q factors on INT4 words: the check sees the plane factors
        qhi2, qlo2, (j0, j1) = kernel_int8_q(q, head, c0)
        ih2, il2 = integer_k_dot(kc, qhi2, qlo2, kh=kh)
        check_history_k_dot([(ih2[0] * 128 + il2[0]) * float(j0), (ih2[1] * 128 + il2[1]) * float(j1) * 16], kc,
                            q * c0, head, K=K)


def test_integer_k_dot_int4_keys_int32_bound():
    """The int32 bound of int2_history.cu's q comment at its worst case: every INT4 code 15 against a q whose every
    element is the group's max (|hi| 127 in every byte): hi . 128 + lo stays below 2^28 and the dot is still the
    direct one."""
    kc = np.full((16, 32), 0xFF)
    kh = np.full((16, 32), 0xFF)
    q = np.ones((4, 128))
    q[:, 64:] *= 3.0
    head = lambda c: c & 3  # noqa: E731
    c0 = 1 / math.sqrt(128) * LOG2E
    qhi, qlo, (is0, is1) = kernel_int8_q(q, head, c0, k4=True)
    ih, il = integer_k_dot(kc, qhi, qlo, kh=kh)
    top = max(np.abs(ih[i] * 128 + il[i]).max() for i in range(2))
    assert 2 ** 27 < top < 2 ** 28  # group 1: 32 dims x (240 + 240) x 127 x 128
    acc = group_acc(ih, il, is0, is1)
    check_history_k_dot(acc, kc, q * c0, head, K=np.full((16, 128), 15))


@pytest.mark.parametrize("hc", [4, 8])
def test_d64_integer_k_dot_int4_keys(hc):
    """K4 at D 64: the D-64 K dot's K4 branch (int4_nibbles of kx0 / kx1 with the k_hi words, masks 0x0f0f0f0f / 0xf0f0f0f0
    for both planes of a pair) against the K4 int8 q is the direct dot with the INT4 codes."""
    rng = np.random.default_rng(95 + hc)
    K, kc, kh = int4_rows(rng, 16, 64)
    q = rng.standard_normal((hc, 64)) * 0.5
    q[0] *= 0.01
    head = (lambda c: c) if hc == 8 else (lambda c: c & 3)
    c0 = 1 / math.sqrt(64) * LOG2E
    qhi, qlo, (is0, is1), _ = kernel_int8_q_d64(q, head, c0, k4=True)
    ih, il = history_k_dot_d64(kc, qhi, qlo, kh=kh)
    assert max(np.abs(ih[i] * 128 + il[i]).max() for i in range(2)) < 2 ** 28
    acc = group_acc(ih, il, is0, is1)
    check_history_k_dot_d64(acc, kc, q * c0, head, scale_tol=2e-4, K=K)


def test_k4_copies_and_window_fill_match_the_kernel_source():
    """The K4 lines beside the dots: the stage keeps the high planes at kKhOff, copied with the low ones from the
    token's record among k_hi's h4 heads (the CTA's head row kj = k4_index[h]; an INT2 head of the layer, kj -1, has
    its high planes zero-filled: 0 bytes read, codes lo | 0), and a sink position without a sink row dequantizes its
    INT4 key code as lo | hi << 2. The hi record is records.py's rule with h4 heads (emulated as pool_record32's)."""
    src = open(PRODUCTION_SOURCE).read()
    for line in ("if constexpr (K4) cp_async16(st + SL::kKhOff + tok * 16, a.kh + (size_t)(k ? rh1 : rh0) * 16u, "
                 "hi_in ? n : 0);",
                 "const uint32_t hh = 2u * __shfl_sync(0xffffffffu, k < 2 ? rh0 : rh1, tok & 31) + (uint32_t)half;",
                 "cp_async16(st + SL::kKhOff + tok * 32 + 16 * half, a.kh + (size_t)hh * 16u, hi_in ? n : 0);",
                 "[[maybe_unused]] const uint32_t rh0 = K4 ? hi_record32(a, s0, max(kj, 0), pmask) : 0u;",
                 "[[maybe_unused]] const bool hi_in = kj >= 0;",
                 "[[maybe_unused]] const int kj = K4 ? __ldg(a.k4_index + h) : -1;",
                 "return (((u >> a.page_log2) * (uint32_t)a.h4 + (uint32_t)j) << a.page_log2) | (u & pmask);",
                 "static constexpr int kVcOff = TOK * kCode, kKhOff = TOK * 2 * kCode;",
                 "const int kj = K4 && !kv ? __ldg(a.k4_index + h) : -1;",
                 "return (float)(hi ? c | ((hi[i] >> (2 * p)) & 3) << 2 : c);"):
        assert line in src, line


def fp8x2_fallback(w):
    """int2_history.cu fp8x2 before sm_89: byte b of the pair as the fp32 ((b & 0x7f) << 20 | (b & 0x80) << 24) .
    2^120 (numpy fp32, denormals kept as the kernel keeps them)."""
    out = []
    for b in (w & 0xFF, (w >> 8) & 0xFF):
        bits = np.array([((b & 0x7F) << 20) | ((b & 0x80) << 24)], dtype=np.uint32)
        out.append(float(bits.view(np.float32)[0] * np.float32(2.0 ** 120)))
    return out


def test_fp8x2_decodes_every_e4m3_byte_exactly():
    """The (scale, min) decode: the fallback's bit formula equals torch's float8_e4m3fn value for every finite byte
    (zeros, subnormals 2^-9 .. 2^-6, negatives, +-448), scale in the low byte; sm_89+ uses the exact hardware cvt."""
    src = open(PRODUCTION_SOURCE).read()
    assert 'asm("cvt.rn.f16x2.e4m3x2 %0, %1;\\n" : "=r"(h) : "h"((unsigned short)w));' in src
    assert ("return make_float2(__uint_as_float((b0 & 0x7fu) << 20 | (b0 & 0x80u) << 24) * 0x1p120f,") in src
    assert "const uint32_t b0 = w & 0xffu, b1 = (w >> 8) & 0xffu;" in src
    want = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    for b in range(256):
        if b & 0x7F == 0x7F:  # NaN: never written (the writers saturate to +-448)
            continue
        sc, mn = fp8x2_fallback(b | (((b * 37) & 0xFF) << 8) | 0xABCD0000)  # the high half is not read
        assert sc == want[b].item(), b
        if (b * 37) & 0x7F != 0x7F:
            assert mn == want[(b * 37) & 0xFF].item(), b


def param_words(prm_bytes, records, g_row):
    """The history loop's param words of `records` (int2_history_kernel issue + pword): the copied 4-byte word (the
    record's, or with one group per row its record pair's: index r >> g_row), the selector sel_base + (r & 1) .
    sel_odd of that side, and prmt(word, 0, selector): group 0's pair in the low half, group 1's in the high half
    (one group: the row's pair in both)."""
    words = np.frombuffer(prm_bytes, dtype=np.uint32)
    base, odd = (0x1010, 0x2222) if g_row else (0x3210, 0)
    return [prmt(int(words[r >> int(g_row)]), 0, base + (r & 1) * odd) for r in records]


@pytest.mark.parametrize("g_row", [False, True])
def test_param_words_pick_the_records_pairs(g_row):
    """(scale, min) pairs are 2 bytes (two e4m3); a row of two groups has a 4-byte record, a row of one group 2 bytes
    per record, copied as the aligned word of its record pair and picked by the record's parity through the token's
    PRMT selector (Stage::kSelOff). Against the params buffer read as [records, groups, 2] bytes: every record's
    pair(s), odd and even records, the buffer's last record included."""
    src = open(PRODUCTION_SOURCE).read()
    for line in ("cp_async4(st + SL::kKpOff + tok * 4, a.kp + (r >> (int)kg_row), n);",
                 "cp_async4(st + SL::kVpOff + tok * 4, a.vp + (r >> (int)vg_row), n);",
                 "\"r\"(sel_base + (r & 1u) * sel_odd)",
                 "[[maybe_unused]] const uint32_t sel_base = (kg_row ? 0x1010u : 0x3210u) | (vg_row ? 0x1010u : "
                 "0x3210u) << 16;",
                 "[[maybe_unused]] const uint32_t sel_odd = (kg_row ? 0x2222u : 0u) | (vg_row ? 0x2222u : 0u) << 16;",
                 "return prmt(w, 0u, reinterpret_cast<const uint16_t*>(st + SL::kSelOff)[2 * tok + v]);",
                 "const float2 k0a = fp8x2(kpa), k1a = fp8x2(kpa >> 16), k0b = fp8x2(kpb), k1b = fp8x2(kpb >> 16);"):
        assert line in src, line
    rng = np.random.default_rng(5 + g_row)
    n, groups = 64, 1 if g_row else 2
    prm = rng.integers(0, 256, (n, groups, 2), dtype=np.uint8)
    recs = list(range(n)) + rng.integers(0, n, 50).tolist()
    for r, w in zip(recs, param_words(prm.tobytes(), recs, g_row)):
        pair = lambda grp: int(prm[r, grp, 0]) | int(prm[r, grp, 1]) << 8  # noqa: E731  (scale in the low byte)
        assert w & 0xFFFF == pair(0) and w >> 16 == pair(0 if g_row else 1), r


def test_cuda_history_launch_refuses_bad_k_hi_and_short_params(monkeypatch):
    """history_cuda.launch, before anything is launched: a k_hi that is not uint8 of k_codes' shape, and a one-group
    side on a pool of an odd record count whose params end with their buffer (the last record pair's word would reach
    2 bytes past it); an even count, or 2 bytes of storage past the params, pass those checks (to the library load,
    stubbed here)."""
    import dataclasses

    from sglang_oscar.kernels import history_cuda
    from sglang_oscar.kernels.layout import LayerCache

    class Loaded(Exception):
        pass

    def load():
        raise Loaded

    monkeypatch.setattr(history_cuda, "library", load)
    q = torch.zeros(1, 4, 128, dtype=torch.bfloat16)
    kw = dict(sink=64, window=256, sm_scale=1.0, ns=1, ns_total=4, o_part=None, lse_part=None)
    cache = LayerCache.empty(6, 1, 128, k_group=64, v_group=64, k_bits=4)
    cache.k_hi = torch.zeros(6, 1, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="cache.k_hi"):
        history_cuda.launch(q, cache, None, None, None, None, **kw)
    odd = LayerCache.empty(5, 1, 128, k_group=128, v_group=64)  # 5 records, K of one group per row
    with pytest.raises(ValueError, match="k_params of an odd record count"):
        history_cuda.launch(q, odd, None, None, None, None, **kw)
    padded = torch.empty(5 * 2 + 2, dtype=odd.k_params.dtype)[:10].view(5, 1, 1, 2)
    for ok in (LayerCache.empty(6, 1, 128, k_group=128, v_group=128, k_bits=4),
               dataclasses.replace(odd, k_params=padded)):
        with pytest.raises(Loaded):
            history_cuda.launch(q, ok, None, None, None, None, **kw)
