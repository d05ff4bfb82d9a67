// The quantized history splits of OSCAR decode attention and, in the same grid, its BF16 sink and ring rows,
// hand-written (kernels/history_cuda.py builds, checks and launches it; kernels/decode.py runs the LSE merge after it).
//
// Why CUDA for this one stage: the Triton history loop is issue-bound; this loop spends ~0.7x of its instructions and,
// on a paged pool (kernels/records.py, pages of 64), reads at 86-101% of a streaming read of its bytes at batch >= 8
// on H100 (benchmark/NOTES.md "A hand-written history loop").
//
// Cache format (kernels/layout.py): INT2 codes in quarter planes, (scale, min) pairs of float8 e4m3 bytes (scale at the
// lower address; decoded exactly, fp8x2 below); some KV heads of a layer may have INT4 keys (template K4: Args.kh, the
// high two bits of each code in a second quarter-plane buffer of those heads only, code = lo | hi << 2 on uniform
// levels 0..15; values are always INT2). Layers without INT4 heads run the INT2 instances (K4 false), which hold no
// INT4 code; in a K4 instance a CTA's KV head is INT4 or INT2 (Args.k4_index, CTA-uniform): an INT2 head's high planes
// are zero-filled (cp.async of 0 bytes, nothing read), and its codes lo | 0 << 2 on the same uniform levels.
// Shapes: D 128 with K and V groups of 64 or 128 each, or D 64 (template D; SmolLM2) with groups of 32 or 64: a row
// has two groups (one (scale, min) pair per half row: a record's 4 bytes) or one (a group of the whole row: 2 bytes
// per record, copied as the 4-byte word of its record pair and picked by the record's parity, Stage::kSelOff; it
// serves both halves), uniform levels, GQA 1-8 per CTA
// column (history_cuda.py; GQA 9-16, GLM-4.x's 12, as head groups of 8). A warp's tile has 8 columns; HC (template)
// is the number of query heads per CTA column:
//   HC 4 (GQA <= 4): columns 0..3 are heads 0..3 with V group 0's scales, columns 4..7 repeat them with group 1's,
//        so one V-dot operand serves both V groups (half of the V dot's outputs are dropped);
//   HC 8 (GQA 5-8): one head per column; the V dot takes group 0's operand for the m-tiles of dims 0..63 and group
//        1's for 64..127 (two more movmatrix per tile), and every output is kept: the same MMA count per token as
//        HC 4 for twice the heads.
// A KV head with more query heads than HC is read by ceil(GQA / HC) CTA columns side by side in the grid (head
// groups; they run at the same time, so the second read of the same pages is mostly served by L2); spare columns
// (GQA % HC != 0) carry a zero query and store nothing.
// Each CTA owns one split of [sink, R) with R = min(max(L - window, sink, ring_start), L), the rows the
// Triton path reads as INT2 (kernels/decode.py _history_end); its warps take consecutive sub-ranges, run the
// loop below independently, and merge their (m, l, O) in shared memory at the end, so that the merge kernel
// reads one partial per CTA, not per warp.
// The CTA stores its partial like _store_split: o / l per (request, query head, split) in
// o_part [B, Hq, NS_TOTAL, 128] and lse = m + log2 l (-inf for an empty split) in lse_part [B, Hq, NS_TOTAL],
// splits [0, ns_hist).
//
// Window CTAs (nwin_sink + nwin_ring > 0; window_cta below): rows of the grid after the history CTAs that read the
// BF16 sink rows [0, min(L, S)) and ring rows [recent_lo, L) (win_tiles mma tiles of 16 per warp) and store partials
// ns_hist + j, the Triton window programs' layout (split NS + j for sink j < SS, then ring), so that the merge is
// unchanged. A sink position without a sink row is read from its INT2 record into the tile (store_int2_chunk), so no
// partial needs the merge's recompute. Without window CTAs (nwin 0) decode.py runs the Triton window programs after
// this kernel as its programmatic dependents, unless the window is folded into the history CTAs (fold_tiles > 0,
// history_cuda.folds: a split per window tile): then warp 0 of split i reads window tile i (the same helpers as the
// window CTAs) before its history range, and its CTA merges it as one more entry.
// Launch order (kernels/decode.py): this kernel lets its dependents launch at once; the merge (PDL) waits for it.
// In a served decode step this kernel is itself launched as the KV write's dependent (Args.pdl, kPdl* below).
//
// Per warp and 16-token tile (all in registers, no CTA barrier):
//   K dot  S^T[16 tokens, 8 cols] = codes[16, 128] . q'[128, 8] (at HC 4 cols 4..7 repeat heads 0..3), two
//          accumulators (groups): 8 x mma m16n8k32 u8 x s8, one AND per four codes and plane (bytes c.4^p), q as int8
//          hi and lo per plane (built per warp in the prologue, scale per plane group).
//   scores s' = acc0.sc0 + acc1.sc1/16 + mn0.Q0 + mn1.Q1 (units of 2^-24 log2; the integer dot's acc_g.sc_g.iS_g),
//          lazy max: the row-max shuffles and the rescale run only when a score passes m + 8 (a warp vote).
//   V dot  O^T[128 dims, 8 cols] += V^T codes[128, 16] . (p.vscale)^T[16, 8]: at HC 4 cols 0..3 carry p.scale
//          of V group 0, cols 4..7 of group 1; at HC 8 the m-tiles of each group take that group's operand.
//          The K accumulator becomes the B operand with movmatrix.trans (two per operand).
//   Token order inside a tile (sigma) makes every shared-memory load conflict-free.
//   Paired tiles (HC 4 at D 128, pair_tiles): a 32-token block's two tiles run one softmax between them, lanes t < 2
//   on tile 0's scores and t >= 2 on tile 1's, instead of each tile's softmax on all lanes with columns 4..7 repeating
//   0..3; O's columns 0..3 then hold tile 0's tokens and 4..7 tile 1's, merged after the loop.
// test/test_cuda_history_layouts.py emulates these register layouts, and the window CTAs' (window_cta), on the CPU.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

// tokens per pipeline stage of a warp (the D-64 WIDE instances: kWideTok)
constexpr int kTok = 32;
// A stage of TOK tokens at head_dim D: K codes D/4 + V codes D/4 (+ K4: the K codes' high planes D/4) + K params 4
// + V params 4 + selectors 4 bytes per token (76 / 108 at D 128, 44 / 60 at D 64), in five or six arrays. The
// selectors (kSelOff, written by the instances with a side of one group per row, !TWO_G) are the PRMT selectors of
// the token's K (low half) and V (high half) param words: 0x3210 for a record's own word (two groups), 0x1010 / 0x3232
// for the lower / upper half of a record pair's word (one group: 2 bytes per record, the half of the record's parity),
// repeated so that both halves of the word hold the row's pair.
template <int D, int TOK = kTok, bool K4 = false> struct Stage {
  static constexpr int kCode = D / 4;  // code bytes per token and side
  static constexpr int kVcOff = TOK * kCode, kKhOff = TOK * 2 * kCode;
  static constexpr int kKpOff = TOK * (K4 ? 3 : 2) * kCode, kVpOff = kKpOff + TOK * 4, kSelOff = kVpOff + TOK * 4;
  static constexpr int kBytes = kSelOff + TOK * 4;
};
template <bool K4> constexpr int kStageBytes = Stage<128, kTok, K4>::kBytes;
// WIDE (template; D 64 only, history_cuda.block_tokens): 64-token stages with the block's four tiles unrolled, so
// that the compiler overlaps one tile's K dot with the previous one's softmax and V dot, and the per-block code
// (slots, records, copies) is paid once per 64 tokens.
constexpr int kWideTok = 64;  // tokens per stage of the WIDE (D 64) instances
// Tiles of a block unrolled (tile_unroll). D 128: both tiles of a 32-token block, so that the compiler overlaps one
// tile's K dot with the other's softmax and V dot, as WIDE does at D 64. D 64's 32-token instances: one tile per
// iteration.
// Paired tiles (pair_tiles): at D 128 and HC 4 the two tiles of a 32-token block share one softmax. Why: at HC 4 the K
// dot's columns 4..7 repeat heads 0..3, so lanes t >= 2 would compute the same scores, exponentials and V-side
// products as lanes t < 2. Paired, a lane's accumulator columns take tile 0's scores where t < 2 and tile 1's where
// t >= 2 (a select of the two tiles' K accumulators), so that every lane does the softmax of 4 distinct (token, head)
// pairs per block instead of 8 with half of them repeated. The V dot then needs each tile's p with only its own
// columns: the p . vscale operands of both V groups are transposed once (movmatrix) and masked by column (lanes g < 4
// for tile 0, g >= 4 for tile 1); the O accumulator's columns 0..3 gather tile 0's tokens and 4..7 tile 1's, and the
// two halves of a warp (lanes t, t ^ 2: the same heads) merge as two softmax partials after the loop. q keeps its 14
// bits (hi and lo): an 8-bit q moved the attention output by 0.4-5%.
__host__ __device__ constexpr bool pair_tiles(int d, int hc, bool wide) {
  return d == 128 && hc == 4 && !wide;
}
__host__ __device__ constexpr int tile_unroll(int d, bool wide) {
  return wide ? kWideTok / 16 : d == 128 ? kTok / 16 : 1;
}
// The BF16 window rows in this kernel (window CTAs, the folded window) are read at D 128 only; at D 64 decode.py runs
// the Triton window programs after it (history_cuda.fuses_window).
// a warp's shared memory: its NSTAGE stages, and at D 128 at least the one K and one V tile of 16 BF16 rows (8 KB)
// that a window CTA's warp reads (window_cta)
template <bool K4>
constexpr int warp_smem(int nstage, int d = 128, bool wide = false) {
  return d == 64 ? nstage * (wide ? Stage<64, kWideTok, K4>::kBytes : Stage<64, kTok, K4>::kBytes)
                 : nstage * kStageBytes<K4> > 8192 ? nstage * kStageBytes<K4> : 8192;
}
// a CTA's shared memory: its warps', and with the window folded (Args.fold_tiles) 8 KB past the warps' stages for
// warp 0's window tile (inside the warps' 8 KB each at 2 stages of 32 tokens, INT4 keys too: no more than without)
template <bool K4>
constexpr int cta_smem(int nstage, int warps, bool fold, int d = 128, bool wide = false) {
  return d == 64 ? warps * warp_smem<K4>(nstage, 64, wide)
         : fold && warps * nstage * kStageBytes<K4> + 8192 > warps * warp_smem<K4>(nstage)
             ? warps * nstage * kStageBytes<K4> + 8192 : warps * warp_smem<K4>(nstage);
}
constexpr float kTwo24 = 16777216.0f;
constexpr float kLazy = 8.0f;            // log2 units a score may pass the running max without a rescale
// Args.pdl: how this grid was launched.
//   kPdlOff        a plain launch.
//   kPdlWaitFirst  a programmatic dependent of any kernel: every CTA waits for it (griddepcontrol.wait) first.
//   kPdlAfterWrite a programmatic dependent of this decode step's KV write (kernels/write.py, pdl_trigger), with q
//                  and every index written before that write: the history CTAs build q's operands, walk their
//                  index chain and stream their INT2 rows while the write runs, since the write stores only the new
//                  token (position L - 1: a ring or sink row, its INT2 record, the sink table), and history rows
//                  end at R <= L - 1 unless ring_start >= L (such a request's CTAs wait before their first copy).
//                  They wait before storing their partial, so that this grid ends after the write (the merge, a
//                  dependent of this grid, then sees the write too); the window CTAs, which read the new row,
//                  wait first.
//   kPdlAfterWriteQ the same, with q rotated by that write (oscar_write_kv q_out): the history CTAs walk their
//                  index chain and issue their first copies, then wait before they read q.
constexpr int kPdlOff = 0, kPdlWaitFirst = 1, kPdlAfterWrite = 2, kPdlAfterWriteQ = 3;

__device__ __forceinline__ void grid_dependency_wait() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int n) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, int n) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}
__device__ __forceinline__ uint32_t movm_trans(uint32_t a) {
  uint32_t d;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(d) : "r"(a));
  return d;
}
__device__ __forceinline__ void mma16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma16816_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                              uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// c[4] (s32) += A[16, 32] (u8) . B[32, 8] (s8): a0 / a2 rows g, k 4t..4t+3 / 16+4t..; a1 / a3 the same of row g + 8;
// b0 / b1 k 4t.. / 16+4t.. of column g; c as mma16816's (PTX ISA, m16n8k32 fragments)
__device__ __forceinline__ void imma16832(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// four int8 (x0 in the low byte) as one word
__device__ __forceinline__ uint32_t pack_s8(uint32_t x0, uint32_t x1, uint32_t x2, uint32_t x3) {
  return prmt(prmt(x0, x1, 0x0040), prmt(x2, x3, 0x0040), 0x5410);
}
// round-to-nearest-even of |x| < 2^22 through fp32 addition: x + 1.5 . 2^23 leaves the integer in the low mantissa bits
// (FMA-pipe ops; rintf + cvt are two conversions on the slow pipe each)
constexpr float kRoundMagic = 12582912.f;
__device__ __forceinline__ float bf_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ uint32_t h2u(__half2 h) { return *reinterpret_cast<uint32_t*>(&h); }
// The (scale, min) pair of float8 e4m3 bytes in the low 16 bits of w (scale in the low byte) as fp32, exactly (every
// e4m3 value is an fp16 value): one cvt to f16x2 on sm_89+; before that from the bits, byte b as the fp32
// ((b & 0x7f) << 20 | (b & 0x80) << 24) . 2^120 (the exponent rebased from 7 to 127, subnormals included: no ftz).
__device__ __forceinline__ float2 fp8x2(uint32_t w) {
#if __CUDA_ARCH__ >= 890
  uint32_t h;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(h) : "h"((unsigned short)w));
  return __half22float2(*reinterpret_cast<__half2*>(&h));
#else
  const uint32_t b0 = w & 0xffu, b1 = (w >> 8) & 0xffu;
  return make_float2(__uint_as_float((b0 & 0x7fu) << 20 | (b0 & 0x80u) << 24) * 0x1p120f,
                     __uint_as_float((b1 & 0x7fu) << 20 | (b1 & 0x80u) << 24) * 0x1p120f);
#endif
}

struct Args {
  const void* q;        // [B, Hq, 128] (transformed), bf16 / fp16 / fp32 (q_dtype 0 / 1 / 2)
  int q_dtype;
  float c0;             // sm_scale * log2(e)
  const uint8_t* kc;    // [records, D/4] (records: kernels/records.py), K4: the K codes' low two bits
  const uint8_t* vc;
  const uint8_t* kh;    // K4: [hi records, D/4], the INT4 heads' K codes' high two bits (cache.k_hi); else null
  const int* k4_index;  // K4: [Hkv] head h's row among k_hi's h4 heads (hi record: pool_record with h4), -1: INT2
  int h4;
  const uint32_t* kp;   // [records] (sc0, mn0, sc1, mn1) e4m3 (two groups per row), or [records / 2] the (sc, mn) of
  const uint32_t* vp;   // two records (kg_row / vg_row: one group per row)
  const int* r2t;
  const void* req_idx;  // [B] int32, or int64 when req_idx_64 (SGLang's req_pool_indices: no per-call cast)
  const int* seq_lens;  // [B]
  const int* ring_start;  // [max_reqs], by pool row
  float* o_part;        // [B, Hq, ns_total, 128]
  float* lse_part;      // [B, Hq, ns_total]
  int r2t_stride, hkv, sink, window, nsw, ns_total;
  int page_log2;        // the pool's page size P = 2^page_log2: record ((s >> k) * Hkv + h) * P + (s & (P - 1))
  int req_idx_64;
  int pdl;              // kPdlOff, kPdlWaitFirst, kPdlAfterWrite or kPdlAfterWriteQ (above)
  int gqa, hgroups;     // query heads per KV head; head groups of HC per KV head (grid x = (b * hkv + h) * hgroups + hg)
  int kg_row, vg_row;   // K / V groups of the whole row, D (params 4 bytes per row) instead of D / 2 (8 bytes)
  // the window CTAs (0 and 0: none, the Triton window programs read the window)
  const __nv_bfloat16* sk;  // sink rows [rows, Hkv, 128]
  const __nv_bfloat16* sv;
  const __nv_bfloat16* rk;  // ring rows [max_reqs * window, Hkv, 128]: position p of pool row r at r * window + p % window
  const __nv_bfloat16* rv;
  const int* sink_table;    // [slots]: sink row of a slot, -1 where none (the merge then recomputes the sink range)
  int nwin_sink, nwin_ring; // window CTAs per CTA column
  int win_tiles;            // 16-position tiles per warp of a window CTA
  // Dormant: history_cuda.launch always passes win_last 1 (the window CTAs after the history CTAs) and fused_merge 0
  // (the Triton merge follows this kernel). Both are kept, with merge_column, only because deleting them changes
  // nvcc 13.0's register allocation of the shipped instances (D 128: a spill in the epilogue; D 64 with 64-token
  // stages: 81-82 registers, 2 CTAs per SM instead of 3). Delete them only with a GPU A/B that checks every
  // instance's registers and spills (nvcc -Xptxas -v) and its time.
  int win_last;
  void* out;                // [B, Hq, 128], dtype code out_dtype (as q_dtype)
  int out_dtype;
  int* counters;            // [>= gridDim.x] zero between calls: CTAs of a column done (the last one resets it)
  int fused_merge;
  // the window folded into the history CTAs (no window CTAs): warp 0 of split i < fold_tiles reads window tile i
  // first (window_tile_*), see int2_history_kernel
  int fold_tiles;
};

// record of (pool slot s, KV head h): kernels/records.py pool_record (pages of 2^page_log2 slots; pmask = page - 1,
// passed in so that the history loop computes it once)
template <typename Slot>
__device__ __forceinline__ long long pool_record(const Args& a, Slot s, int h, int pmask) {
  return ((long long)(s >> a.page_log2) * a.hkv + h) * (pmask + 1) + (s & pmask);
}

// The same record in 32 bits, for the history loop's copies: one shift, one multiply-add, one shift and one
// three-input logic op per token and block (the 64-bit form above, with its sign handling, was ~3x that per use, and
// the loop used it three times per lane and block: about a quarter of the kernel's instructions at batch >= 8).
// history_cuda.launch refuses pools of 2^31 records or more, so that
// 2 * record + 1 (a record's 16-byte halves) fits 32 bits too.
__device__ __forceinline__ uint32_t pool_record32(const Args& a, int s, int h, uint32_t pmask) {
  const uint32_t u = (uint32_t)s;
  return (((u >> a.page_log2) * (uint32_t)a.hkv + (uint32_t)h) << a.page_log2) | (u & pmask);
}
// The record of (slot s, INT4 head row j) in k_hi (its h4 heads instead of Hkv).
__device__ __forceinline__ uint32_t hi_record32(const Args& a, int s, int j, uint32_t pmask) {
  const uint32_t u = (uint32_t)s;
  return (((u >> a.page_log2) * (uint32_t)a.h4 + (uint32_t)j) << a.page_log2) | (u & pmask);
}

// element i of q (dtype code q_dtype) as fp32
__device__ __forceinline__ float load_q(const Args& a, size_t i) {
  if (a.q_dtype == 0) return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(a.q)[i]);
  if (a.q_dtype == 1) return __half2float(reinterpret_cast<const __half*>(a.q)[i]);
  return reinterpret_cast<const float*>(a.q)[i];
}

// q's elements i .. i + 7 as one 16-byte load (16-bit q; i a multiple of 8), zeros for a spare column and for fp32 q
// (which q_pair reads element by element)
__device__ __forceinline__ uint4 load_q8(const Args& a, bool valid, size_t i) {
  if (!valid || a.q_dtype == 2) return make_uint4(0u, 0u, 0u, 0u);
  return __ldg(reinterpret_cast<const uint4*>(reinterpret_cast<const uint16_t*>(a.q) + i));
}

// q's elements i .. i + 3 as one 8-byte load into words x, y (16-bit q; i a multiple of 4; D 64), as load_q8
__device__ __forceinline__ uint4 load_q4(const Args& a, bool valid, size_t i) {
  if (!valid || a.q_dtype == 2) return make_uint4(0u, 0u, 0u, 0u);
  const uint2 v = __ldg(reinterpret_cast<const uint2*>(reinterpret_cast<const uint16_t*>(a.q) + i));
  return make_uint4(v.x, v.y, 0u, 0u);
}

// c0 q[i], c0 q[i + 1]: from 32-bit word k of v, the load_q8 of elements i - 2k .. (16-bit q), or read here (fp32 q)
__device__ __forceinline__ float2 q_pair(const Args& a, const uint4& v, int k, bool valid, size_t i) {
  const uint32_t wd = k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w;
  float x0, x1;
  if (a.q_dtype == 0) {
    x0 = bf_lo(wd); x1 = bf_hi(wd);
  } else if (a.q_dtype == 1) {
    x0 = __half2float(__ushort_as_half((unsigned short)(wd & 0xffffu)));
    x1 = __half2float(__ushort_as_half((unsigned short)(wd >> 16)));
  } else {
    x0 = valid ? load_q(a, i) : 0.f; x1 = valid ? load_q(a, i + 1) : 0.f;
  }
  return make_float2(x0 * a.c0, x1 * a.c0);
}

// The CTA's merge. Each warp has parked its unnormalised O (HC heads x D dims) and its (m, l) per head in shared
// memory (so, sml); thread e of the CTA combines output e (+ k.threads) over the warps: M = max m_w,
// O = sum 2^(m_w - M) O_w, L = sum 2^(m_w - M) l_w. An empty warp has l = 0 and m = -1e30, so it weighs 0 (or all
// weigh 1 and L = 0: an empty split, o 0 and lse -inf).
// xo: one more entry ([HC][128] O, then [HC] (m, l)) beside the warps' (a folded window tile's, D 128), or null.
template <int HC, int D = 128>
__device__ __forceinline__ void store_cta_partial(const Args& a, const float* so, const float* sml, int nwarps, int nh,
                                                  int hq_base, int split, const float* xo = nullptr) {
  for (int e = threadIdx.x; e < HC * D; e += blockDim.x) {
    const int hl = e / D, d = e % D;
    if (hl >= nh) continue;
    float M = -1e30f;
    for (int w = 0; w < nwarps; ++w) M = fmaxf(M, sml[(w * HC + hl) * 2]);
    if (xo) M = fmaxf(M, xo[HC * 128 + hl * 2]);
    float L = 0.f, O = 0.f;
    for (int w = 0; w < nwarps; ++w) {
      const float wt = ex2(sml[(w * HC + hl) * 2] - M);
      L = fmaf(wt, sml[(w * HC + hl) * 2 + 1], L);
      O = fmaf(wt, so[(w * HC + hl) * D + d], O);
    }
    if (xo) {
      const float wt = ex2(xo[HC * 128 + hl * 2] - M);
      L = fmaf(wt, xo[HC * 128 + hl * 2 + 1], L);
      O = fmaf(wt, xo[hl * 128 + d], O);
    }
    const size_t row = (size_t)hq_base + hl;
    a.o_part[(row * a.ns_total + split) * D + d] = L > 0.f ? O / L : 0.f;
    if (d == 0) a.lse_part[row * a.ns_total + split] = L > 0.f ? M + __log2f(L) : -INFINITY;
  }
}

// Dormant (Args.fused_merge is always 0, see Args). The merge in this kernel: every CTA of column col (one (request, KV head, head group)) counts itself
// done after its partial is visible device-wide (the fence-then-count pattern of CUDA's threadFenceReduction); the
// last one reduces the column's ns_total partials per query head, o = sum 2^(lse_s - M) o_s / sum 2^(lse_s - M), in
// split order (the same bits whichever CTA is last), writes out and resets the counter for the next call.
template <int HC, int D = 128>
__device__ __forceinline__ void merge_column(const Args& a, uint8_t* smem, int col, int hq_base, int nh) {
  __shared__ int last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    last = atomicAdd(a.counters + col, 1) == (int)gridDim.y - 1;
    if (last) a.counters[col] = 0;  // every other CTA of the column has counted: no one touches it until the next call
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  // the weights 2^(lse_s - M) / L of each head's partials into shared memory (one warp per head, lanes striding
  // over the splits), then every output reads its partials with independent loads
  const int n = a.ns_total, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float* sw = reinterpret_cast<float*>(smem);  // [HC][n]; the CTA's own merge is done with this memory
  for (int hw = warp; hw < nh; hw += (int)(blockDim.x >> 5)) {  // head hw (CTAs of fewer than 4 warps loop)
    const float* lse = a.lse_part + (size_t)(hq_base + hw) * n;
    float M = -INFINITY;
    for (int s = lane; s < n; s += 32) {
      const float x = __ldcg(lse + s);
      sw[hw * n + s] = x;
      M = fmaxf(M, x);
    }
#pragma unroll
    for (int x = 16; x > 0; x >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, x));
    float L = 0.f;
    if (M != -INFINITY) {
      for (int s = lane; s < n; s += 32) L += ex2(sw[hw * n + s] - M);  // 0 for an empty split (lse -inf)
    }
#pragma unroll
    for (int x = 16; x > 0; x >>= 1) L += __shfl_xor_sync(0xffffffffu, L, x);
    const float inv = L > 0.f ? 1.f / L : 0.f;
    for (int s = lane; s < n; s += 32) sw[hw * n + s] = M != -INFINITY ? ex2(sw[hw * n + s] - M) * inv : 0.f;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < HC * D; e += blockDim.x) {
    const int hl = e / D, d = e % D;
    if (hl >= nh) continue;
    const size_t row = (size_t)hq_base + hl;
    const float* op = a.o_part + row * n * D + d;
    const float* w = sw + hl * n;
    float x = 0.f;
#pragma unroll 8
    for (int s = 0; s < n; ++s) x = fmaf(w[s], __ldcg(op + (size_t)s * D), x);  // an empty split's o is 0
    if (a.out_dtype == 0) reinterpret_cast<__nv_bfloat16*>(a.out)[row * D + d] = __float2bfloat16_rn(x);
    else if (a.out_dtype == 1) reinterpret_cast<__half*>(a.out)[row * D + d] = __float2half_rn(x);
    else reinterpret_cast<float*>(a.out)[row * D + d] = x;
  }
}

// XOR swizzle of the 16-byte chunks of a 256-byte BF16 row in shared memory: the K reads (rows g and g + 1 of a
// quarter warp, chunks 4j + t) and the V reads (rows 2t, chunks 2g + s) are then free of bank conflicts
__device__ __forceinline__ int swz(int r) { return ((r & 1) << 2) ^ ((r >> 1) & 1) ^ (((r >> 2) & 1) << 2); }

// Dims 8ch .. 8ch + 7 of the K and V rows of pool slot `slot`, head h, dequantized from their records (min + scale .
// code, the oracle's form) as BF16 into the tile chunk at dst (K) and dst + 4096 (V): a sink position without a sink
// row. Codes: byte j of a record holds dims j + 32p in bits 2p, 2p + 1 (kernels/layout.py); K4: the K code is that
// of kc | that of kh << 2.
template <bool K4>
__device__ __forceinline__ void store_int2_chunk(const Args& a, uint32_t dst, long long slot, int h, int ch) {
  const long long rec = pool_record(a, slot, h, (1 << a.page_log2) - 1);
  const int p = ch >> 2, j0 = (ch & 3) * 8;
#pragma unroll
  for (int kv = 0; kv < 2; ++kv) {
    const uint8_t* codes = (kv ? a.vc : a.kc) + rec * 32 + j0;
    const int kj = K4 && !kv ? __ldg(a.k4_index + h) : -1;  // an INT2 head of a K4 layer: no high planes
    const uint8_t* hi = kj >= 0 ? a.kh + (((slot >> a.page_log2) * a.h4 + kj) * (1ll << a.page_log2) +
                                          (slot & ((1 << a.page_log2) - 1))) * 32 + j0 : nullptr;
    const bool g_row = kv ? a.vg_row : a.kg_row;
    // the (scale, min) pair of this chunk's group: one per row at G = 128, two at G = 64 (dims 0..63, 64..127)
    const uint16_t* prm = reinterpret_cast<const uint16_t*>(kv ? a.vp : a.kp);
    const float2 sm = fp8x2(g_row ? prm[rec] : prm[rec * 2 + (ch >> 3)]);
    const float sc = sm.x, mn = sm.y;
    auto code = [&](int i) {
      const int c = (codes[i] >> (2 * p)) & 3;
      return (float)(hi ? c | ((hi[i] >> (2 * p)) & 3) << 2 : c);
    };
    uint32_t out[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float x0 = fmaf(sc, code(2 * i), mn);
      const float x1 = fmaf(sc, code(2 * i + 1), mn);
      __nv_bfloat162 v = __floats2bfloat162_rn(x0, x1);
      out[i] = *reinterpret_cast<uint32_t*>(&v);
    }
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst + kv * 4096), "r"(out[0]), "r"(out[1]),
                 "r"(out[2]), "r"(out[3]) : "memory");
  }
}

// One window tile: positions [first, first + 16) of the sink range [0, min(L, S)) or of the ring range
// [max(L - W, S), L) (positions below ring_start: copied, then zeroed and masked), read by one warp (a window CTA's,
// or a history CTA's folded warp).
struct WinTile {
  int first, range_lo, range_hi;  // range_lo: the range's first valid position (ring_start applied)
  bool is_sink;
};

// Tile k (from 0) of the sink (is_sink) or ring range of a request of length L whose ring starts at ring_lo.
__device__ __forceinline__ WinTile window_tile(const Args& a, bool is_sink, int k, int L, int ring_lo) {
  // ring tiles from max(L - W, S), which needs no ring_start, so that its load is off the copies' chain (under the
  // history CTAs' copies each dependent load of a window CTA waits ~2 us)
  const int base_lo = is_sink ? 0 : min(max(L - a.window, a.sink), L);
  WinTile w;
  w.first = base_lo + 16 * k;
  w.range_hi = is_sink ? min(L, a.sink) : L;
  w.range_lo = is_sink ? 0 : min(max(base_lo, ring_lo), L);
  w.is_sink = is_sink;
  return w;
}

// This lane's row of the tile (lanes 0..15: position first + lane): >= 0 a BF16 row, -1 none (masked), <= -2 a sink
// position without a sink row (rare: no sink row was free), whose INT2 record at slot -2 - row is read instead. An
// int: pool slots are int32 (req_to_token) and a pool of 2^31 - 2 slots would not fit a GPU.
__device__ __forceinline__ int window_row(const Args& a, const WinTile& w, int req, int lane) {
  const int pos = w.first + (lane & 15);
  int row = -1;
  if (lane < 16 && pos < w.range_hi) {
    if (w.is_sink) {
      const int slot = __ldg(a.r2t + (size_t)req * a.r2t_stride + pos);
      const int sr = __ldg(a.sink_table + slot);
      row = sr >= 0 ? sr : -2 - slot;
    } else {
      row = req * a.window + pos % a.window;
    }
  }
  return row;
}

// The tile's K and V rows of KV head h into the warp's 8 KB at st (K tile, V tile 4 KB on), one cp.async group.
template <bool K4>
__device__ __forceinline__ void window_issue(const Args& a, const WinTile& w, int row, int h, uint32_t st,
                                             int lane) {
  const __nv_bfloat16* kbase = w.is_sink ? a.sk : a.rk;
  const __nv_bfloat16* vbase = w.is_sink ? a.sv : a.rv;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int c = lane + 32 * i, r = c >> 4, ch = c & 15;
    const int rr = __shfl_sync(0xffffffffu, row, r);
    const long long off = rr < 0 ? 0 : ((long long)rr * a.hkv + h) * 128 + ch * 8;
    const uint32_t dst = st + r * 256 + ((ch ^ swz(r)) << 4);
    if (rr > -2) {
      cp_async16(dst, kbase + off, rr < 0 ? 0 : 16);
      cp_async16(dst + 4096, vbase + off, rr < 0 ? 0 : 16);
    }
  }
  cp_commit();
  // sink positions without a sink row (rare): their INT2 records, dequantized into the tile here, in a rolled loop
  // (unrolled, its 8 copies were ~1000 instructions per use of this function)
  if (__any_sync(0xffffffffu, lane < 16 && row <= -2)) {
#pragma unroll 1
    for (int i = 0; i < 8; ++i) {
      const int c = lane + 32 * i, r = c >> 4, ch = c & 15;
      const int rr = __shfl_sync(0xffffffffu, row, r);
      if (rr <= -2) store_int2_chunk<K4>(a, st + r * 256 + ((ch ^ swz(r)) << 4), -2 - (long long)rr, h, ch);
    }
  }
}

// c0 q as BF16 B fragments: qw[j][k] = dims 32j + 8t + 2k, +1 of this lane's column's head (zero for a spare column),
// from its four 16-byte loads qraw (load_q8).
__device__ __forceinline__ void window_q(const Args& a, const uint4 (&qraw)[4], bool qvalid, size_t qrow, int t,
                                         uint32_t (&qw)[4][4]) {
#pragma unroll
  for (int jj = 0; jj < 4; ++jj) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      // word k of qraw[jj] holds dims 32jj + 8t + 2k, + 1
      const float2 x = q_pair(a, qraw[jj], k, qvalid, qrow + 32 * jj + 8 * t + 2 * k);
      __nv_bfloat162 v = __floats2bfloat162_rn(x.x, x.y);
      qw[jj][k] = *reinterpret_cast<uint32_t*>(&v);
    }
  }
}

// The tile's dots and the running (m, l, O) of this warp, once its group has landed (the caller waited): rows
// below range_lo are zeroed first (ring rows of positions below ring_start hold stale bits), masked rows score -inf.
__device__ __forceinline__ void window_compute(const WinTile& w, int row, uint32_t st, const uint8_t* sts,
                                               const uint32_t (&qw)[4][4], float (&o)[8][4], float& m0, float& m1,
                                               float& l0, float& l1) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int first = w.first, range_lo = w.range_lo;
  const bool tok_a = __shfl_sync(0xffffffffu, row, g) != -1 && first + g >= range_lo;
  const bool tok_b = __shfl_sync(0xffffffffu, row, g + 8) != -1 && first + g + 8 >= range_lo;
  __syncwarp();
  if (first < range_lo) {  // uniform per warp
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int c = lane + 32 * i, r = c >> 4, ch = c & 15;
      if (first + r < range_lo) {
        const uint32_t dst = st + r * 256 + ((ch ^ swz(r)) << 4);
        asm volatile("st.shared.v4.b32 [%0], {%1, %1, %1, %1};\n" ::"r"(dst), "r"(0u) : "memory");
        asm volatile("st.shared.v4.b32 [%0], {%1, %1, %1, %1};\n" ::"r"(dst + 4096), "r"(0u) : "memory");
      }
    }
    __syncwarp();
  }
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int jj = 0; jj < 4; ++jj) {
    const uint4 k0 = *reinterpret_cast<const uint4*>(sts + g * 256 + (((4 * jj + t) ^ swz(g)) << 4));
    const uint4 k1 = *reinterpret_cast<const uint4*>(sts + (g + 8) * 256 + (((4 * jj + t) ^ swz(g + 8)) << 4));
    mma16816_bf16(acc, k0.x, k1.x, k0.y, k1.y, qw[jj][0], qw[jj][1]);
    mma16816_bf16(acc, k0.z, k1.z, k0.w, k1.w, qw[jj][2], qw[jj][3]);
  }
  const float s0 = tok_a ? acc[0] : -INFINITY, s1 = tok_a ? acc[1] : -INFINITY;
  const float s2 = tok_b ? acc[2] : -INFINITY, s3 = tok_b ? acc[3] : -INFINITY;
  float c0 = fmaxf(s0, s2), c1 = fmaxf(s1, s3);
#pragma unroll
  for (int x = 4; x < 32; x <<= 1) {
    c0 = fmaxf(c0, __shfl_xor_sync(0xffffffffu, c0, x));
    c1 = fmaxf(c1, __shfl_xor_sync(0xffffffffu, c1, x));
  }
  const float n0 = fmaxf(m0, c0), n1 = fmaxf(m1, c1);  // a tile of masked rows leaves m as it was
  const float al0 = ex2(m0 - n0), al1 = ex2(m1 - n1);
  m0 = n0; m1 = n1;
  const float p0 = ex2(s0 - m0), p1 = ex2(s1 - m1), p2 = ex2(s2 - m0), p3 = ex2(s3 - m1);
  float t0 = p0 + p2, t1 = p1 + p3;
#pragma unroll
  for (int x = 4; x < 32; x <<= 1) {
    t0 += __shfl_xor_sync(0xffffffffu, t0, x);
    t1 += __shfl_xor_sync(0xffffffffu, t1, x);
  }
  l0 = fmaf(l0, al0, t0);
  l1 = fmaf(l1, al1, t1);
  __nv_bfloat162 pa = __floats2bfloat162_rn(p0, p1), pb = __floats2bfloat162_rn(p2, p3);
  const uint32_t b0 = movm_trans(*reinterpret_cast<uint32_t*>(&pa));
  const uint32_t b1 = movm_trans(*reinterpret_cast<uint32_t*>(&pb));
#pragma unroll
  for (int sc = 0; sc < 2; ++sc) {  // chunk 2g + sc of rows 2t, 2t + 1, 2t + 8, 2t + 9: dims 16g + 8sc .. + 7
    const uint8_t* vt = sts + 4096;
    const uint4 vA = *reinterpret_cast<const uint4*>(vt + (2 * t) * 256 + (((2 * g + sc) ^ swz(2 * t)) << 4));
    const uint4 vB = *reinterpret_cast<const uint4*>(vt + (2 * t + 1) * 256 + (((2 * g + sc) ^ swz(2 * t + 1)) << 4));
    const uint4 vC = *reinterpret_cast<const uint4*>(vt + (2 * t + 8) * 256 + (((2 * g + sc) ^ swz(2 * t + 8)) << 4));
    const uint4 vD = *reinterpret_cast<const uint4*>(vt + (2 * t + 9) * 256 + (((2 * g + sc) ^ swz(2 * t + 9)) << 4));
    const uint32_t wa[4] = {vA.x, vA.y, vA.z, vA.w}, wb[4] = {vB.x, vB.y, vB.z, vB.w};
    const uint32_t wc[4] = {vC.x, vC.y, vC.z, vC.w}, wd[4] = {vD.x, vD.y, vD.z, vD.w};
#pragma unroll
    for (int x = 0; x < 4; ++x) {
      const int mt = 4 * sc + x;
      o[mt][0] *= al0; o[mt][1] *= al1; o[mt][2] *= al0; o[mt][3] *= al1;
      mma16816_bf16(o[mt], prmt(wa[x], wb[x], 0x5410), prmt(wa[x], wb[x], 0x7632), prmt(wc[x], wd[x], 0x5410),
                    prmt(wc[x], wd[x], 0x7632), b0, b1);
    }
  }
  __syncwarp();  // the next tile's copies overwrite these buffers
}

// A window warp's (m, l, O) as one merge entry: O [HC][128] at ow, (m, l) of head i at ml[2i], ml[2i + 1]
// (store_cta_partial's layout). At HC 4 columns 4..7 repeat heads 0..3: lanes t < 2 hold the stored ones.
template <int HC>
__device__ __forceinline__ void window_park(float* ow, float* ml, const float (&o)[8][4], float m0, float m1,
                                            float l0, float l1) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  if (HC == 8 || t < 2) {
    const int head0 = 2 * t;
#pragma unroll
    for (int mt = 0; mt < 8; ++mt) {
      const int d = 16 * g + 2 * mt;
      ow[head0 * 128 + d] = o[mt][0];
      ow[(head0 + 1) * 128 + d] = o[mt][1];
      ow[head0 * 128 + d + 1] = o[mt][2];
      ow[(head0 + 1) * 128 + d + 1] = o[mt][3];
    }
    if (g == 0) {
      ml[head0 * 2] = m0; ml[head0 * 2 + 1] = l0; ml[head0 * 2 + 2] = m1; ml[head0 * 2 + 3] = l1;
    }
  }
}

// A window CTA: window CTA j of its column (sink CTAs j < nwin_sink, then ring CTAs). Warp w reads win_tiles tiles
// of 16 positions, ((j' * nwarps + w) * win_tiles + k) * 16 on from the range's start, one at a time (the warp's
// 8 KB of shared memory, warp_smem, hold one K and one V tile), as m16n8k16 dots with BF16 operands and fp32 sums:
//   S^T[16 tokens, 8 cols] = K[16, 128] . (c0 q)^T: the 128 dims in a permuted order (lane t's four k-values of
//     k-step 2j + e are dims 32j + 8t + 4e + 0..3, the same for q), so that a lane reads whole 16-byte chunks;
//   O^T[128 dims, 8 cols] += V^T[128, 16] . P^T[16, 8]: m-row g of m-tile mt is dim 16g + 2mt, row g + 8 dim
//     16g + 2mt + 1 (one 32-bit word of a row), P^T from the score accumulator with two movmatrix.trans.
// Columns 4..7 repeat heads 0..3 (as in the history loop); lanes t < 2 own the stored ones. Scores, p and the
// running max are in log2 units (c0 = sm_scale log2 e), as in the history warps, so the CTA merges both alike.
template <int HC, bool K4>
__device__ __forceinline__ void window_cta(const Args& a, uint8_t* smem, int j, int b, int h, int hq_base, int nh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const bool is_sink = j < a.nwin_sink;
  // q's elements of this lane (16-bit q: dims 32jj + 8t .. + 7 of column g's head, one 16-byte load per jj), issued
  // before the index loads so that they do not queue behind them (the history warps' reason, int2_history_kernel)
  const int qhead = HC == 8 ? g : (g & 3);
  const bool qvalid = qhead < nh;
  const size_t qrow = (size_t)(hq_base + (qvalid ? qhead : 0)) * 128;
  uint4 qraw[4];
#pragma unroll
  for (int jj = 0; jj < 4; ++jj) qraw[jj] = load_q8(a, qvalid, qrow + 32 * jj + 8 * t);
  const int L = a.seq_lens[b];
  const int req = a.req_idx_64 ? (int)reinterpret_cast<const long long*>(a.req_idx)[b]
                                : reinterpret_cast<const int*>(a.req_idx)[b];
  const int ring_lo = is_sink ? 0 : a.ring_start[req];  // used only in the mask, after the copies
  const int k0 = ((is_sink ? j : j - a.nwin_sink) * nwarps + warp) * a.win_tiles;
  const uint32_t st = (uint32_t)__cvta_generic_to_shared(smem) + warp * 8192;  // K tile 4 KB, V tile 4 KB
  const uint8_t* sts = smem + warp * 8192;
  uint32_t qw[4][4];
  window_q(a, qraw, qvalid, qrow, t, qw);
  float o[8][4];
#pragma unroll
  for (int mt = 0; mt < 8; ++mt) o[mt][0] = o[mt][1] = o[mt][2] = o[mt][3] = 0.f;
  float m0 = -1e30f, m1 = -1e30f, l0 = 0.f, l1 = 0.f;  // an empty warp keeps these: weighed 0 by the CTA merge
  for (int tile = 0; tile < a.win_tiles; ++tile) {
    const WinTile w = window_tile(a, is_sink, k0 + tile, L, ring_lo);
    if (w.first >= w.range_hi) break;  // uniform per warp
    const int row = window_row(a, w, req, lane);
    window_issue<K4>(a, w, row, h, st, lane);
    cp_wait<0>();
    window_compute(w, row, st, sts, qw, o, m0, m1, l0, l1);
  }
  // park O, m, l for the CTA merge (the tiles above are dead once every warp is past this barrier)
  __syncthreads();
  float* so = reinterpret_cast<float*>(smem);
  float* sml = so + nwarps * HC * 128;
  window_park<HC>(so + warp * HC * 128, sml + warp * HC * 2, o, m0, m1, l0, l1);
  __syncthreads();
  const int ns_hist = gridDim.y - a.nwin_sink - a.nwin_ring;
  store_cta_partial<HC>(a, so, sml, nwarps, nh, hq_base, ns_hist + j);
  if (a.fused_merge) merge_column<HC>(a, smem, blockIdx.x, hq_base, nh);
}

// INT4 keys (K4): the code bytes of one word, lo (kc's) and hi (kh's), as two words of 4-bit codes c_p = lo_p | hi_p << 2
// per byte: n02 = c_0 | c_2 << 4 (planes 0, 2), n13 = c_1 | c_3 << 4 (planes 1, 3): a shift and a select (LOP3) each.
// Plane p is then n & 0x0f0f0f0f (p < 2: c) or n & 0xf0f0f0f0 (p >= 2: c 16), one AND per word and plane as INT2's
// c 4^p (which at p = 3 would not fit a byte with c up to 15: 15 . 16 = 240 does), against q scaled by the plane
// factors (1, 1, 1/16, 1/16) (plane_f) in place of INT2's 4^-p.
__device__ __forceinline__ void int4_nibbles(uint32_t lo, uint32_t hi, uint32_t& n02, uint32_t& n13) {
  n02 = (lo & 0x33333333u) | ((hi << 2) & 0xccccccccu);
  n13 = ((lo >> 2) & 0x33333333u) | (hi & 0xccccccccu);
}
// q's factor at plane p for the integer K dot (the codes' A bytes are c / plane_f: INT2 c 4^p, K4 above)
__host__ __device__ constexpr float plane_f(bool k4, int p) {
  return p == 0 ? 1.f : p == 1 ? (k4 ? 1.f : 0.25f) : p == 2 ? 0.0625f : (k4 ? 0.0625f : 0.015625f);
}

// The K dot of one 16-token D-128 tile: the lane's code bytes 8t .. 8t + 7 of tokens sg, sg + 8 (the
// tile's rows g, g + 8) at kcs (K4: and at khs), masked per plane p as c 4^p (K4: c / plane_f) (A, u8: k 4t.. and
// 16 + 4t.., matching qhi / qlo) against q's int8 hi and lo; plane group 0 (planes 0, 1: dims 0..63) into ih0 / il0,
// group 1 into ih1 / il1 (added to them).
template <bool K4>
__device__ __forceinline__ void k_dot_d128(const uint8_t* kcs, const uint8_t* khs, int sg, int t,
                                           const uint32_t (&qhi)[8], const uint32_t (&qlo)[8], int (&ih0)[4],
                                           int (&il0)[4], int (&ih1)[4], int (&il1)[4]) {
  const uint2 kw0 = *reinterpret_cast<const uint2*>(kcs + sg * 32 + t * 8);
  const uint2 kw1 = *reinterpret_cast<const uint2*>(kcs + (sg + 8) * 32 + t * 8);
  uint2 e0 = kw0, e1 = kw1, f0 = kw0, f1 = kw1;  // the words planes 0, 2 (e) and 1, 3 (f) are masked from
  if constexpr (K4) {
    const uint2 hw0 = *reinterpret_cast<const uint2*>(khs + sg * 32 + t * 8);
    const uint2 hw1 = *reinterpret_cast<const uint2*>(khs + (sg + 8) * 32 + t * 8);
    int4_nibbles(kw0.x, hw0.x, e0.x, f0.x);
    int4_nibbles(kw0.y, hw0.y, e0.y, f0.y);
    int4_nibbles(kw1.x, hw1.x, e1.x, f1.x);
    int4_nibbles(kw1.y, hw1.y, e1.y, f1.y);
  }
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    const uint32_t M = K4 ? (p < 2 ? 0x0f0f0f0fu : 0xf0f0f0f0u) : 0x03030303u << (2 * p);
    const uint2 u0 = p & 1 ? f0 : e0, u1 = p & 1 ? f1 : e1;
    const uint32_t a0 = u0.x & M, a1 = u1.x & M, a2 = u0.y & M, a3 = u1.y & M;
    imma16832(p < 2 ? ih0 : ih1, a0, a1, a2, a3, qhi[2 * p], qhi[2 * p + 1]);
    imma16832(p < 2 ? il0 : il1, a0, a1, a2, a3, qlo[2 * p], qlo[2 * p + 1]);
  }
}

// The V dot of one 16-token D-128 tile: O^T[128 dims, 8 cols] += V^T codes[128, 16] . B[16, 8], m-tiles 0..3 (V group
// 0) against the B pair (b0, b1), 4..7 (group 1) against (c0, c1). vcs: the tile's V codes + 4g; the lane reads code
// bytes 4g .. 4g + 3 of tokens t, t + 4, t + 8, t + 12 and pairs two tokens of one code byte per halfword pair
// (V_SELECTORS in test_cuda_history_layouts.py), one AND per two codes and plane (fp16 subnormals c 2^(2p - 24)).
__device__ __forceinline__ void v_dot_d128(const uint8_t* vcs, int t, float (&o)[8][4], uint32_t b0, uint32_t b1,
                                           uint32_t c0, uint32_t c1) {
  const uint32_t wA = *reinterpret_cast<const uint32_t*>(vcs + t * 32);
  const uint32_t wB = *reinterpret_cast<const uint32_t*>(vcs + (t + 4) * 32);
  const uint32_t wC = *reinterpret_cast<const uint32_t*>(vcs + (t + 8) * 32);
  const uint32_t wD = *reinterpret_cast<const uint32_t*>(vcs + (t + 12) * 32);
  const uint32_t e0 = prmt(wA, wB, 0x4400), e1 = prmt(wA, wB, 0x5511);
  const uint32_t e2 = prmt(wA, wB, 0x6622), e3 = prmt(wA, wB, 0x7733);
  const uint32_t f0 = prmt(wC, wD, 0x4400), f1 = prmt(wC, wD, 0x5511);
  const uint32_t f2 = prmt(wC, wD, 0x6622), f3 = prmt(wC, wD, 0x7733);
#pragma unroll
  for (int mt = 0; mt < 8; ++mt) {
    const int p = mt >> 1, hb = mt & 1;
    const uint32_t M = 0x00030003u << (2 * p);
    mma16816(o[mt], (hb ? e2 : e0) & M, (hb ? e3 : e1) & M, (hb ? f2 : f0) & M, (hb ? f3 : f1) & M,
             mt < 4 ? b0 : c0, mt < 4 ? b1 : c1);
  }
}

// TWO_G: K and V rows of two groups each (G = D / 2: 64 at D 128, the default format, 32 at D 64) known at compile
// time (launch picks this instance), so that the block's params copies and the tile's group selects are not issued
// both ways under a runtime flag (Args.kg_row / vg_row read only where TWO_G is false).
// D: head_dim 128, or 64 (planes of 16 dims: a token's codes are 16 bytes, one per lane of a 4-lane quad in the K dot;
// the K dot pairs planes 2pp and 2pp + 1 in one m16n8k32 (k 0..15 the first plane's bytes, 16..31 the second's);
// the V dot has 4 m-tiles, m-tile p = plane p; no window CTAs and no folded window: history_cuda refuses them).
// The paired-tile instances are held to 2 CTAs of 8 warps per SM (<= 128 registers) by their launch bounds: without
// them nvcc 13.0 gave the ones with runtime groups 149 registers (1 CTA per SM). The D-64 instances are held to 3
// (<= 80 registers; without, nvcc 13.0 gave the 64-token ones 81-82: 2 CTAs per SM). The D-128 HC-8 instances keep no
// minimum (0): they land at 128 on their own, and an explicit 1 gave 152-159 registers (a GPU A/B of a change here
// must check every instance against its register budget, nvcc -Xptxas -v).
// K4: the layer's keys are INT4 (Args.kh: their high planes, copied beside the low ones; int4_nibbles, plane_f); the
// INT2 instances (K4 false) compile without any of it.
template <int NSTAGE, int HC, bool TWO_G, int D, bool WIDE, bool K4>
__global__ void __launch_bounds__(256, pair_tiles(D, HC, WIDE) ? 2 : 0) int2_history_kernel(Args a) {
  static_assert(D == 128 || D == 64, "head_dim 128 or 64");
  static_assert(!WIDE || D == 64, "64-token stages (WIDE) at D 64 only");
  constexpr int kTok = WIDE ? kWideTok : ::kTok;  // tokens per stage of this instance
  using SL = Stage<D, kTok, K4>;
  constexpr int kSB = SL::kBytes, NMT = D / 16;  // stage bytes, V m-tiles
  constexpr int kTileUnroll = tile_unroll(D, WIDE);
  constexpr bool kPair = pair_tiles(D, HC, WIDE);  // the block's two tiles share one softmax
  static_assert(kTileUnroll >= 1 && kTileUnroll <= kTok / 16, "tiles unrolled: 1 .. the block's");
  // the CTA merge parks (O, m, l) in the warps' stages
  static_assert(NSTAGE * kSB >= HC * (D + 2) * 4, "a warp's stages hold its parked partial");
  extern __shared__ __align__(16) uint8_t smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int g = lane >> 2, t = lane & 3, gsel = t >> 1;
  const bool kg_row = !TWO_G && a.kg_row, vg_row = !TWO_G && a.vg_row;
  // a token's param selectors (Stage::kSelOff): sel_base + (record & 1) . sel_odd
  [[maybe_unused]] const uint32_t sel_base = (kg_row ? 0x1010u : 0x3210u) | (vg_row ? 0x1010u : 0x3210u) << 16;
  [[maybe_unused]] const uint32_t sel_odd = (kg_row ? 0x2222u : 0u) | (vg_row ? 0x2222u : 0u) << 16;
  const int bh = blockIdx.x / a.hgroups, hg = blockIdx.x - bh * a.hgroups, b = bh / a.hkv, h = bh - b * a.hkv;
  const int hq_base = b * a.hkv * a.gqa + h * a.gqa + hg * HC;  // query head of local head 0 of this group
  // K4: this CTA's KV head's row among k_hi's heads, -1 for an INT2 head (its high planes zero-filled: n 0 below)
  [[maybe_unused]] const int kj = K4 ? __ldg(a.k4_index + h) : -1;
  const int nh = min(HC, a.gqa - hg * HC);                        // valid local heads of this group
  const int nwin = a.nwin_sink + a.nwin_ring, ns_hist = (int)gridDim.y - nwin;
  // this CTA's history split (< 0: window CTA wj; win_last is always 1: the window CTAs follow the history CTAs)
  const int split = a.win_last ? ((int)blockIdx.y < ns_hist ? (int)blockIdx.y : -1) : (int)blockIdx.y - nwin;
  const int wj = a.win_last ? (int)blockIdx.y - ns_hist : (int)blockIdx.y;
  const int widx = split * nwarps + warp;
  const uint32_t sbase = (uint32_t)__cvta_generic_to_shared(smem) + warp * NSTAGE * kSB;
  const uint8_t* wbase = smem + warp * NSTAGE * kSB;
  // launched early: the previous kernel wrote q (kPdlWaitFirst) or the window's new row (kPdlAfterWrite)
  const bool after_write = a.pdl == kPdlAfterWrite || a.pdl == kPdlAfterWriteQ;
  if (a.pdl == kPdlWaitFirst || (after_write && split < 0)) grid_dependency_wait();
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");  // the window programs / merge may launch now
#endif
  if (split < 0) {  // uniform per CTA (D 64: never; history_cuda launches no window CTAs there)
    if constexpr (D == 128) window_cta<HC, K4>(a, smem, wj, b, h, hq_base, nh);
    return;
  }

  // q's elements of this lane (16-bit q: dims p*32 + t*8 .. + 7 of column g's head, one 16-byte load per plane p),
  // loaded before the index chain wherever q is written before this grid (not kPdlAfterWriteQ). Why: loads issued
  // after the first copies queue behind them, and the second stage's copies wait for the q build.
  const int qhead = HC == 8 ? g : (g & 3);  // column g's head
  const bool qvalid = qhead < nh;  // a spare column: zero query (its scores are 0; nothing is stored)
  const size_t qrow = (size_t)(hq_base + (qvalid ? qhead : 0)) * D;
  uint4 qraw[4];  // D 64: dims p*16 + t*4 .. + 3 in words x, y
  auto load_qraw = [&]() {
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      if constexpr (D == 64) qraw[p] = load_q4(a, qvalid, qrow + p * 16 + t * 4);
      else qraw[p] = load_q8(a, qvalid, qrow + p * 32 + t * 8);
    }
  };
  if (a.pdl != kPdlAfterWriteQ) load_qraw();

  const int L = a.seq_lens[b];
  const int req = a.req_idx_64 ? (int)reinterpret_cast<const long long*>(a.req_idx)[b]
                                : reinterpret_cast<const int*>(a.req_idx)[b];
  const int hist_lo = a.sink;
  const int hist_hi = min(max(max(L - a.window, a.sink), a.ring_start[req]), L);
  const int n = hist_hi - hist_lo;
  const int chunk = ((n + a.nsw - 1) / a.nsw + 15) & ~15;
  // In a CTA whose warp 0 reads a folded window tile (fold_tiles, below), warp 0 hands k <= min(7, nwarps - 1) of
  // its 16-row units to warps 1..k, one each: the tile's 8 KB of BF16 rows weigh ~100 INT2 rows, and the CTA ends
  // with its last warp. The CTA's range is unchanged.
  // a CTA of the folded window (fold_tiles, below): its warp 0 reads window tile `split` and parks it in wbuf, the 8 KB
  // past the warps' stages (cta_smem); uniform per CTA
  const bool fold_cta = D == 128 && a.fold_tiles > 0 && split < a.fold_tiles;
  uint8_t* const wbuf = smem + nwarps * NSTAGE * kSB;
  const int k = fold_cta ? min(min(7, nwarps - 1), chunk >> 4) : 0;
  const int lo0 = hist_lo + widx * chunk + (warp == 0 ? 0 : 16 * (min(warp - 1, k) - k));
  const int lo = min(lo0, hist_hi);
  const int hi = min(lo0 + chunk + (warp == 0 ? -16 * k : warp <= k ? 16 : 0), hist_hi);
  const int nblocks = (hi - lo + kTok - 1) / kTok;
  const int* r2t_row = a.r2t + (size_t)req * a.r2t_stride;
  const uint32_t pmask = (1u << a.page_log2) - 1u;

  // the slots of the next block to issue (lane's tokens: lane and, at kTok 64, lane + 32)
  int s0 = 0, s1 = 0;
  auto load_slots = [&](int blk) {
    const int p0 = lo + blk * kTok + lane, p1 = kTok == 64 ? p0 + 32 : hi;  // kTok 32: one token per lane
    s0 = (blk < nblocks && p0 < hi) ? __ldg(r2t_row + p0) : 0;
    s1 = (blk < nblocks && p1 < hi) ? __ldg(r2t_row + p1) : 0;
  };
  auto issue = [&](int blk) {
    if (blk < nblocks) {
      const uint32_t st = sbase + (blk % NSTAGE) * kSB;
      const int rem = hi - (lo + blk * kTok);  // tokens of this block inside the range (may exceed kTok)
      // each lane's token's record, once (its params' copies use it; the codes' copies take it by shuffle)
      const uint32_t r0 = pool_record32(a, s0, h, pmask);
      const uint32_t r1 = kTok == 64 ? pool_record32(a, s1, h, pmask) : 0u;
      // K4: the records of the same tokens in k_hi (an INT2 head: record 0, never read)
      [[maybe_unused]] const uint32_t rh0 = K4 ? hi_record32(a, s0, max(kj, 0), pmask) : 0u;
      [[maybe_unused]] const uint32_t rh1 = K4 && kTok == 64 ? hi_record32(a, s1, max(kj, 0), pmask) : 0u;
      [[maybe_unused]] const bool hi_in = kj >= 0;
      if constexpr (D == 64) {
        // codes: a token's 16-byte row per lane (lane i: token i + 32k)
#pragma unroll
        for (int k = 0; k < kTok / 32; ++k) {
          const int tok = lane + 32 * k;
          const int n = tok < rem ? 16 : 0;
          const uint32_t r = k ? r1 : r0;
          cp_async16(st + tok * 16, a.kc + (size_t)r * 16u, n);
          cp_async16(st + SL::kVcOff + tok * 16, a.vc + (size_t)r * 16u, n);
          if constexpr (K4) cp_async16(st + SL::kKhOff + tok * 16, a.kh + (size_t)(k ? rh1 : rh0) * 16u, hi_in ? n : 0);
        }
      } else {
        // codes: lanes 2i, 2i+1 copy the two 16-byte halves of token i (+16k), so that one instruction
        // covers 16 whole rows (contiguous where the layout and the slots are)
#pragma unroll
        for (int k = 0; k < kTok / 16; ++k) {
          const int tok = (lane >> 1) + 16 * k, half = lane & 1;
          const uint32_t hrec = 2u * __shfl_sync(0xffffffffu, k < 2 ? r0 : r1, tok & 31) + (uint32_t)half;
          const int n = tok < rem ? 16 : 0;
          cp_async16(st + tok * 32 + 16 * half, a.kc + (size_t)hrec * 16u, n);
          cp_async16(st + SL::kVcOff + tok * 32 + 16 * half, a.vc + (size_t)hrec * 16u, n);
          if constexpr (K4) {
            const uint32_t hh = 2u * __shfl_sync(0xffffffffu, k < 2 ? rh0 : rh1, tok & 31) + (uint32_t)half;
            cp_async16(st + SL::kKhOff + tok * 32 + 16 * half, a.kh + (size_t)hh * 16u, hi_in ? n : 0);
          }
        }
      }
      // params: the record's 4-byte word, or with one group per row the word of its record pair (2 bytes each; the
      // token's selectors, Stage::kSelOff, pick the half)
#pragma unroll
      for (int k = 0; k < kTok / 32; ++k) {
        const int tok = lane + 32 * k;
        const int n = tok < rem ? 4 : 0;
        const uint32_t r = k ? r1 : r0;
        cp_async4(st + SL::kKpOff + tok * 4, a.kp + (r >> (int)kg_row), n);
        cp_async4(st + SL::kVpOff + tok * 4, a.vp + (r >> (int)vg_row), n);
        if constexpr (!TWO_G) {
          asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(st + SL::kSelOff + tok * 4), "r"(sel_base + (r & 1u) * sel_odd)
                       : "memory");
        }
      }
    }
    cp_commit();  // an empty group past the end keeps the wait count uniform
  };

  float o[NMT][4];
#pragma unroll
  for (int i = 0; i < NMT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  // lv: sum p.vmin of this lane's two columns, over V group gsel (HC 4) or group 0 (HC 8, paired tiles; lw: group 1)
  float m0 = -1e30f, m1 = -1e30f, l0 = 0.f, l1 = 0.f, lv0 = 0.f, lv1 = 0.f, lw0 = 0.f, lw1 = 0.f;
  float thr0 = (m0 + kLazy) / kTwo24, thr1 = thr0;

  const int sg = (g >> 1) + 4 * (g & 1);  // sigma(g): the tile row of M-row g
  // paired tiles: the V-dot operand columns of tile 0 (lanes g < 4 after the transpose; tile 1: the others)
  [[maybe_unused]] const uint32_t cmask = g < 4 ? 0xffffffffu : 0u;
  // The window folded into this grid (fold_tiles > 0, no window CTAs): warp 0 of split i < fold_tiles reads window
  // tile i (the sink's ceil(S / 16) tiles, then the ring's ceil(W / 16)) before its history range, into the 8 KB past
  // the warps' stages, and adds it to the CTA merge as one more entry. Why: at batch 1 the window CTAs did not fit
  // the grid's one round beside the history CTAs, and those of the second round ended the call. Uniform per warp.
  const int n_sink_tiles = (a.sink + 15) >> 4;
  const bool fold = fold_cta && warp == 0;
  WinTile wt{0, 0, 0, false};
  int wrow = -1;
  bool wnew = false;  // after the write, the tile holding row L - 1 (written by the write) waits for it
  if (fold) {
    const bool ws = split < n_sink_tiles;
    wt = window_tile(a, ws, ws ? split : split - n_sink_tiles, L, ws ? 0 : a.ring_start[req]);
    wnew = after_write && wt.first <= L - 1 && L - 1 < wt.first + 16;
    // the sink's index loads before the slots' and the copies (a load issued after the copies queues behind them)
    if (!wnew) wrow = window_row(a, wt, req, lane);
  }
  // after the write: row L - 1 (this step's token, its INT2 record being written) is history only where
  // ring_start >= L; uniform per CTA
  if (after_write && hist_hi >= L && n > 0) grid_dependency_wait();
  // the slots of the first NSTAGE blocks, all loaded before the first copy is issued: a load issued after the copies
  // waits behind them, and so does every instruction after it
  int ps0[NSTAGE], ps1[NSTAGE];
#pragma unroll
  for (int s = 0; s < NSTAGE; ++s) {
    load_slots(s);
    ps0[s] = s0;
    ps1[s] = s1;
  }
#pragma unroll
  for (int s = 0; s < NSTAGE - 1; ++s) {
    s0 = ps0[s];
    s1 = ps1[s];
    issue(s);
  }
  s0 = ps0[NSTAGE - 1];
  s1 = ps1[NSTAGE - 1];
  const uint32_t wst = (uint32_t)__cvta_generic_to_shared(wbuf);
  if (fold && wt.first < wt.range_hi) {
    if (wnew) {
      grid_dependency_wait();
      wrow = window_row(a, wt, req, lane);
    }
    window_issue<K4>(a, wt, wrow, h, wst, lane);
  }

  if (a.pdl == kPdlAfterWriteQ) {  // q' is the write's output
    grid_dependency_wait();
    load_qraw();
  }
  if (fold) {  // the folded window tile, parked as (O, m, l) in its own 8 KB until the CTA merge
    float* xo = reinterpret_cast<float*>(wbuf);
    if (wt.first < wt.range_hi) {
      uint32_t qw[4][4];
      window_q(a, qraw, qvalid, qrow, t, qw);
      float wo[8][4];
#pragma unroll
      for (int i = 0; i < 8; ++i) wo[i][0] = wo[i][1] = wo[i][2] = wo[i][3] = 0.f;
      float wm0 = -1e30f, wm1 = -1e30f, wl0 = 0.f, wl1 = 0.f;
      cp_wait<0>();  // the tile's group (and the stages issued before it)
      window_compute(wt, wrow, wst, wbuf, qw, wo, wm0, wm1, wl0, wl1);
      window_park<HC>(xo, xo + HC * 128, wo, wm0, wm1, wl0, wl1);
    } else {  // an empty tile: O 0, m -1e30, l 0, weighed 0 by the CTA merge (as an empty warp)
      for (int e = lane; e < HC * 128; e += 32) xo[e] = 0.f;
      if (lane < HC) {
        xo[HC * 128 + 2 * lane] = -1e30f;
        xo[HC * 128 + 2 * lane + 1] = 0.f;
      }
    }
  }
  // built while the first stages' copies are in flight
  // q' = c0 q 4^(2g - p) as this lane's B fragments: reg 2ks + w of k-step ks = (plane p, half hh) holds dims
  // p*32 + t*8 + 4hh + 2w + (0, 1) of column g's head; and the group sums of q. This lane's accumulator
  // columns 2t, 2t+1 are heads head0, head0 + 1 (HC 4: columns 4..7 repeat heads 0..3)
  const int head0 = HC == 8 ? 2 * t : (2 * t) & 3;
  float xs[4][D / 16];  // c0 q at dims p*32 + t*8 + i (D 64: p*16 + t*4 + i), for the int8 q below (read once, here)
  float gs0 = 0.f, gs1 = 0.f;
  if constexpr (D == 64) {  // four dims of each plane per lane (a quad holds the head's 64)
#pragma unroll
    for (int p = 0; p < 4; ++p) {
#pragma unroll
      for (int w = 0; w < 2; ++w) {
        // word w of plane p's 8 bytes holds dims p*16 + t*4 + 2w, + 1
        const float2 xq = q_pair(a, qraw[p], w, qvalid, qrow + p * 16 + t * 4 + 2 * w);
        if (p < 2) gs0 += xq.x + xq.y; else gs1 += xq.x + xq.y;
        xs[p][2 * w] = xq.x;
        xs[p][2 * w + 1] = xq.y;
      }
    }
  } else {
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      const int ks = r >> 1, w = r & 1, p = ks >> 1, hh = ks & 1;
      const int d = p * 32 + t * 8 + 4 * hh + 2 * w;
      // word 2hh + w of plane p's 16 bytes holds dims d, d + 1
      const float2 xq = q_pair(a, qraw[p], 2 * hh + w, qvalid, qrow + d);
      const float x0 = xq.x, x1 = xq.y;
      if (p < 2) gs0 += x0 + x1; else gs1 += x0 + x1;
      xs[p][4 * hh + 2 * w] = x0;
      xs[p][4 * hh + 2 * w + 1] = x1;
    }
  }
#pragma unroll
  for (int x = 1; x < 4; x <<= 1) {  // the quad's four lanes hold all D dims of head g & 3
    gs0 += __shfl_xor_sync(0xffffffffu, gs0, x);
    gs1 += __shfl_xor_sync(0xffffffffu, gs1, x);
  }
  const float q00 = __shfl_sync(0xffffffffu, gs0, head0 * 4) / kTwo24;  // quad g = head holds its sums
  const float q01 = __shfl_sync(0xffffffffu, gs0, (head0 + 1) * 4) / kTwo24;
  const float q10 = __shfl_sync(0xffffffffu, gs1, head0 * 4) / kTwo24;
  const float q11 = __shfl_sync(0xffffffffu, gs1, (head0 + 1) * 4) / kTwo24;
  // q for the integer K dot: register 2p + w holds c0 q 4^-p of column g's head at dims p*32 + t*8 + 4w + 0..3 (the
  // lane's bytes 8t + 4w .. + 3 of plane p, whose masked codes are c 4^p) as int8, scaled per plane group gp by
  // S_gp = 16256 / max |c0 q 4^-p| over the warp: v = x S = 128 hi + lo (hi in [-127, 127], lo in [-64, 64]).
  // iS_gp = 2^-24 / S_gp puts the dot in the fp16 path's units (2^-24 log2), so the score math is unchanged.
  // K4: the same with 4^-p replaced by plane_f(true, p) = 1, 1, 1/16, 1/16 (the INT4 codes' A bytes c, c, 16c, 16c).
  // int32 bound: a group's 64 dims (two planes of 32) of A bytes <= 240 (K4 planes 2, 3; INT2: 3 . 64 = 192) against
  // |hi| <= 127 give |ih| <= 32 . (240 + 240) . 127 < 2^21, so |ih . 128 + il| < 2^28.
  // D 64: register p (= 2pp + w: plane pair pp, k-half w of its m16n8k32) holds plane p's dims p*16 + t*4 + 0..3
  uint32_t qhi[D / 16], qlo[D / 16];
  float iS0, iS1;
  {
    // the group maxima of |c0 q 4^-p| over the warp, then per element four FMA-pipe ops: hm = v / 128 + magic (hi in
    // its low byte), -128 hi + 128 magic, v - 128 hi, + magic (lo in its low byte), with v = c0 q 4^-p S folded into
    // one constant per plane; the packs take the low bytes of the fp32 bits directly
    float mq[4];
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      mq[p] = 0.f;
      if constexpr (D == 64) {
#pragma unroll
        for (int i = 0; i < 4; ++i) mq[p] = fmaxf(mq[p], fabsf(xs[p][i]));
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) mq[p] = fmaxf(mq[p], fabsf(xs[p][i]));
      }
    }
    float mx0 = fmaxf(mq[0], plane_f(K4, 1) * mq[1]), mx1 = fmaxf(plane_f(K4, 2) * mq[2], plane_f(K4, 3) * mq[3]);
#pragma unroll
    for (int x = 1; x < 32; x <<= 1) {
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, x));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, x));
    }
    // a group whose q is all but zero (max below 1e-30: 16256 / max would overflow to inf, and 0 . inf is NaN)
    // gets S 0, i.e. zero codes' dot; its scores keep the min terms
    const float S0 = mx0 > 1e-30f ? 16256.f / mx0 : 0.f, S1 = mx1 > 1e-30f ? 16256.f / mx1 : 0.f;
    iS0 = mx0 / (16256.f * kTwo24);
    iS1 = mx1 / (16256.f * kTwo24);
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const float kp = plane_f(K4, p) * (p < 2 ? S0 : S1);
#pragma unroll
      for (int w = 0; w < D / 64; ++w) {
        uint32_t hb[4], lb[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float x = xs[p][4 * w + i];
          const float hm = fmaf(x, kp * (1.f / 128.f), kRoundMagic);  // rint(v / 128) + magic
          // rint(v - 128 hi) + magic
          const float lm = fmaf(x, kp, fmaf(hm, -128.f, 128.f * kRoundMagic)) + kRoundMagic;
          hb[i] = __float_as_uint(hm);
          lb[i] = __float_as_uint(lm);
        }
        // the low byte of magic + n is n mod 256 (the magic's low byte is 0): n as int8
        qhi[(D / 64) * p + w] = pack_s8(hb[0], hb[1], hb[2], hb[3]);
        qlo[(D / 64) * p + w] = pack_s8(lb[0], lb[1], lb[2], lb[3]);
      }
    }
  }

  for (int blk = 0; blk < nblocks; ++blk) {
    issue(blk + NSTAGE - 1);
    load_slots(blk + NSTAGE);
    cp_wait<NSTAGE - 1>();
    __syncwarp();
    const uint8_t* st = wbase + (blk % NSTAGE) * kSB;
    const int pos0 = lo + blk * kTok;
    const bool full = pos0 + kTok <= hi;
#pragma unroll (kTileUnroll)
    for (int j = 0; j < (kPair ? 1 : kTok / 16); ++j) {
      const int tj = kPair ? gsel : j;  // the tile whose tokens sg, sg + 8 this lane's accumulator holds
      float acc0[4], acc1[4];
      if constexpr (D == 64) {
        // the lane's code bytes 4t .. 4t + 3 of tokens sg, sg + 8 (dims 4t + i + 16p), masked for planes 2pp and
        // 2pp + 1: A's k 4t.. and 16 + 4t.. of one m16n8k32 (c 4^p in each byte, u8; K4: c / plane_f from the
        // int4_nibbles words), against qhi / qlo[2pp], [2pp + 1]
        const uint8_t* kcs = st + j * 16 * 16;
        const uint32_t kx0 = *reinterpret_cast<const uint32_t*>(kcs + sg * 16 + t * 4);
        const uint32_t kx1 = *reinterpret_cast<const uint32_t*>(kcs + (sg + 8) * 16 + t * 4);
        uint32_t e0 = kx0, e1 = kx1, f0 = kx0, f1 = kx1;  // the words planes 2pp (e) and 2pp + 1 (f) are masked from
        if constexpr (K4) {
          const uint8_t* khs = st + SL::kKhOff + j * 16 * 16;
          int4_nibbles(kx0, *reinterpret_cast<const uint32_t*>(khs + sg * 16 + t * 4), e0, f0);
          int4_nibbles(kx1, *reinterpret_cast<const uint32_t*>(khs + (sg + 8) * 16 + t * 4), e1, f1);
        }
        int ih0[4] = {0, 0, 0, 0}, il0[4] = {0, 0, 0, 0}, ih1[4] = {0, 0, 0, 0}, il1[4] = {0, 0, 0, 0};
#pragma unroll
        for (int pp = 0; pp < 2; ++pp) {
          const uint32_t M0 = K4 ? (pp ? 0xf0f0f0f0u : 0x0f0f0f0fu) : 0x03030303u << (4 * pp);
          const uint32_t M1 = K4 ? M0 : M0 << 2;
          const uint32_t a0 = e0 & M0, a1 = e1 & M0, a2 = f0 & M1, a3 = f1 & M1;
          imma16832(pp ? ih1 : ih0, a0, a1, a2, a3, qhi[2 * pp], qhi[2 * pp + 1]);
          imma16832(pp ? il1 : il0, a0, a1, a2, a3, qlo[2 * pp], qlo[2 * pp + 1]);
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          acc0[e] = (float)(ih0[e] * 128 + il0[e]);
          acc1[e] = (float)(ih1[e] * 128 + il1[e]);
        }
      } else {
      // hi and lo of each plane group in their own accumulators (k_dot_d128); paired tiles (kPair): both tiles' dots,
      // and this lane keeps tile tj's (a select in place of the other tile's combine)
      int ih0[4] = {0, 0, 0, 0}, il0[4] = {0, 0, 0, 0}, ih1[4] = {0, 0, 0, 0}, il1[4] = {0, 0, 0, 0};
      k_dot_d128<K4>(st + j * 16 * 32, st + SL::kKhOff + j * 16 * 32, sg, t, qhi, qlo, ih0, il0, ih1, il1);
      if constexpr (kPair) {
        int jh0[4] = {0, 0, 0, 0}, jl0[4] = {0, 0, 0, 0}, jh1[4] = {0, 0, 0, 0}, jl1[4] = {0, 0, 0, 0};
        k_dot_d128<K4>(st + 16 * 32, st + SL::kKhOff + 16 * 32, sg, t, qhi, qlo, jh0, jl0, jh1, jl1);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          ih0[e] = tj ? jh0[e] : ih0[e]; il0[e] = tj ? jl0[e] : il0[e];
          ih1[e] = tj ? jh1[e] : ih1[e]; il1[e] = tj ? jl1[e] : il1[e];
        }
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        acc0[e] = (float)(ih0[e] * 128 + il0[e]);
        acc1[e] = (float)(ih1[e] * 128 + il1[e]);
      }
      }
      // the (scale, min) pairs of this lane's tokens ta, ta + 8 of the stage (tile tj's rows sg, sg + 8)
      const int ta = tj * 16 + sg;
      // token tok's pairs of side v (0 K, 1 V): group 0's in the low half, group 1's (dims D/2 ..) in the high half;
      // a row of one group has its pair in both (its selector, Stage::kSelOff)
      auto pword = [&](int v, int tok) -> uint32_t {
        const uint32_t w = reinterpret_cast<const uint32_t*>(st + (v ? SL::kVpOff : SL::kKpOff))[tok];
        if constexpr (TWO_G) return w;
        return prmt(w, 0u, reinterpret_cast<const uint16_t*>(st + SL::kSelOff)[2 * tok + v]);
      };
      const uint32_t kpa = pword(0, ta), kpb = pword(0, ta + 8);
      const float2 k0a = fp8x2(kpa), k1a = fp8x2(kpa >> 16), k0b = fp8x2(kpb), k1b = fp8x2(kpb >> 16);
      const float sc0a = k0a.x * iS0, mn0a = k0a.y, sc1a = k1a.x * iS1, mn1a = k1a.y;
      const float sc0b = k0b.x * iS0, mn0b = k0b.y, sc1b = k1b.x * iS1, mn1b = k1b.y;
      float s[4];
      s[0] = fmaf(mn1a, q10, fmaf(mn0a, q00, fmaf(acc1[0], sc1a, acc0[0] * sc0a)));
      s[1] = fmaf(mn1a, q11, fmaf(mn0a, q01, fmaf(acc1[1], sc1a, acc0[1] * sc0a)));
      s[2] = fmaf(mn1b, q10, fmaf(mn0b, q00, fmaf(acc1[2], sc1b, acc0[2] * sc0b)));
      s[3] = fmaf(mn1b, q11, fmaf(mn0b, q01, fmaf(acc1[3], sc1b, acc0[3] * sc0b)));
      if (!full) {
        const int pa = pos0 + tj * 16 + sg;
        if (pa >= hi) s[0] = s[1] = -INFINITY;
        if (pa + 8 >= hi) s[2] = s[3] = -INFINITY;
      }
      const bool up = (s[0] > thr0) | (s[1] > thr1) | (s[2] > thr0) | (s[3] > thr1);
      if (__any_sync(0xffffffffu, up)) {  // rare after the first tiles: the exact max and a rescale
        float c0 = fmaxf(s[0], s[2]), c1 = fmaxf(s[1], s[3]);
#pragma unroll
        for (int x = 4; x < 32; x <<= 1) {
          c0 = fmaxf(c0, __shfl_xor_sync(0xffffffffu, c0, x));
          c1 = fmaxf(c1, __shfl_xor_sync(0xffffffffu, c1, x));
        }
        const float n0 = fmaxf(m0, c0 * kTwo24), n1 = fmaxf(m1, c1 * kTwo24);
        const float al0 = ex2(m0 - n0), al1 = ex2(m1 - n1);
        m0 = n0; m1 = n1;
        thr0 = (m0 + kLazy) / kTwo24; thr1 = (m1 + kLazy) / kTwo24;
        l0 *= al0; l1 *= al1; lv0 *= al0; lv1 *= al1;
        if (HC == 8 || kPair) { lw0 *= al0; lw1 *= al1; }
#pragma unroll
        for (int i = 0; i < NMT; ++i) { o[i][0] *= al0; o[i][1] *= al1; o[i][2] *= al0; o[i][3] *= al1; }
      }
      const float p0 = ex2(fmaf(s[0], kTwo24, -m0)), p1 = ex2(fmaf(s[1], kTwo24, -m1));
      const float p2 = ex2(fmaf(s[2], kTwo24, -m0)), p3 = ex2(fmaf(s[3], kTwo24, -m1));
      l0 += p0 + p2; l1 += p1 + p3;
      // the V dot's B operands: m-tiles 0..3 (V group 0) take b, 4..7 (group 1) c (D 64: 0..1 and 2..3)
      uint32_t b0, b1, c0, c1;
      if (HC == 4 && !kPair) {
        // columns 0..3 carry p.scale of V group 0, columns 4..7 of group 1: one operand pair serves both groups
        // (this lane's group gsel)
        const float2 vra = fp8x2(pword(1, ta) >> 16 * gsel), vrb = fp8x2(pword(1, ta + 8) >> 16 * gsel);
        const float vsa = vra.x, vma = vra.y, vsb = vrb.x, vmb = vrb.y;
        lv0 = fmaf(p0, vma, fmaf(p2, vmb, lv0));
        lv1 = fmaf(p1, vma, fmaf(p3, vmb, lv1));
        b0 = c0 = movm_trans(h2u(__floats2half2_rn(p0 * vsa, p1 * vsa)));
        b1 = c1 = movm_trans(h2u(__floats2half2_rn(p2 * vsb, p3 * vsb)));
      } else {
        // eight heads in eight columns (HC 8, or paired tiles: columns 0..3 tile 0's, 4..7 tile 1's): p.scale of
        // group 0 for m-tiles 0..3, of group 1 for 4..7 (the same word at G = 128)
        const uint32_t vpa = pword(1, ta), vpb = pword(1, ta + 8);
        const float2 va0 = fp8x2(vpa), vb0 = fp8x2(vpb), va1 = fp8x2(vpa >> 16), vb1 = fp8x2(vpb >> 16);
        lv0 = fmaf(p0, va0.y, fmaf(p2, vb0.y, lv0));
        lv1 = fmaf(p1, va0.y, fmaf(p3, vb0.y, lv1));
        lw0 = fmaf(p0, va1.y, fmaf(p2, vb1.y, lw0));
        lw1 = fmaf(p1, va1.y, fmaf(p3, vb1.y, lw1));
        b0 = movm_trans(h2u(__floats2half2_rn(p0 * va0.x, p1 * va0.x)));
        b1 = movm_trans(h2u(__floats2half2_rn(p2 * vb0.x, p3 * vb0.x)));
        c0 = movm_trans(h2u(__floats2half2_rn(p0 * va1.x, p1 * va1.x)));
        c1 = movm_trans(h2u(__floats2half2_rn(p2 * vb1.x, p3 * vb1.x)));
      }
      if constexpr (D == 64) {
        // the lane's two code bytes 2g, 2g + 1 (dims 16p + 2g, + 1) of tokens t, t + 4, t + 8, t + 12: byte 0 is
        // m-row g of m-tile p, byte 1 m-row g + 8, as V_SELECTORS' bytes 0 and 1 at D 128
        const uint8_t* vcs = st + SL::kVcOff + j * 16 * 16 + 2 * g;
        const uint32_t wA = *reinterpret_cast<const uint16_t*>(vcs + t * 16);
        const uint32_t wB = *reinterpret_cast<const uint16_t*>(vcs + (t + 4) * 16);
        const uint32_t wC = *reinterpret_cast<const uint16_t*>(vcs + (t + 8) * 16);
        const uint32_t wD = *reinterpret_cast<const uint16_t*>(vcs + (t + 12) * 16);
        const uint32_t e0 = prmt(wA, wB, 0x4400), e1 = prmt(wA, wB, 0x5511);
        const uint32_t f0 = prmt(wC, wD, 0x4400), f1 = prmt(wC, wD, 0x5511);
#pragma unroll
        for (int mt = 0; mt < 4; ++mt) {
          const uint32_t M = 0x00030003u << (2 * mt);
          mma16816(o[mt], e0 & M, e1 & M, f0 & M, f1 & M, mt < 2 ? b0 : c0, mt < 2 ? b1 : c1);
        }
      } else if constexpr (kPair) {
        // after the transpose lane (g, t) holds column g of the operand: tile 0's p where g < 4, tile 1's where g >= 4;
        // each tile's V dot takes its own columns (the others zero), so that O's columns 0..3 gather tile 0's tokens
        // and 4..7 tile 1's
        v_dot_d128(st + SL::kVcOff + 4 * g, t, o, b0 & cmask, b1 & cmask, c0 & cmask, c1 & cmask);
        v_dot_d128(st + SL::kVcOff + 16 * 32 + 4 * g, t, o, b0 & ~cmask, b1 & ~cmask, c0 & ~cmask, c1 & ~cmask);
      } else {
        v_dot_d128(st + SL::kVcOff + j * 16 * 32 + 4 * g, t, o, b0, b1, c0, c1);
      }
    }
    __syncwarp();  // this stage is refilled by the next iteration's issue
  }
  cp_wait<0>();

#pragma unroll
  for (int x = 4; x < 32; x <<= 1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, x);
    l1 += __shfl_xor_sync(0xffffffffu, l1, x);
    lv0 += __shfl_xor_sync(0xffffffffu, lv0, x);
    lv1 += __shfl_xor_sync(0xffffffffu, lv1, x);
    if (HC == 8 || kPair) {
      lw0 += __shfl_xor_sync(0xffffffffu, lw0, x);
      lw1 += __shfl_xor_sync(0xffffffffu, lw1, x);
    }
  }
  if constexpr (kPair) {
    // lanes t and t ^ 2 hold the same two heads, over tile 0's and tile 1's tokens of every block: merge the two as
    // softmax partials (both then hold the warp's (m, l, lv, lw, O) of those heads; an empty side has l 0)
    const float pm0 = __shfl_xor_sync(0xffffffffu, m0, 2), pm1 = __shfl_xor_sync(0xffffffffu, m1, 2);
    const float n0 = fmaxf(m0, pm0), n1 = fmaxf(m1, pm1);
    const float a0 = ex2(m0 - n0), z0 = ex2(pm0 - n0), a1 = ex2(m1 - n1), z1 = ex2(pm1 - n1);
    auto mix = [](float& x, float ax, float zx) { x = fmaf(x, ax, __shfl_xor_sync(0xffffffffu, x, 2) * zx); };
    mix(l0, a0, z0); mix(l1, a1, z1); mix(lv0, a0, z0); mix(lv1, a1, z1); mix(lw0, a0, z0); mix(lw1, a1, z1);
#pragma unroll
    for (int i = 0; i < NMT; ++i) {
      mix(o[i][0], a0, z0); mix(o[i][1], a1, z1); mix(o[i][2], a0, z0); mix(o[i][3], a1, z1);
    }
    m0 = n0; m1 = n1;
  }
  // The CTA's merge (store_cta_partial). Each warp parks its unnormalised O = c.2^(24-2p) + lv (HC heads x D
  // dims), m and l in shared memory (the pipeline stages are free now).
  __syncthreads();  // every warp is past its last stage read
  float* so = reinterpret_cast<float*>(smem);  // [nwarps][HC heads][D]
  float* sml = so + nwarps * HC * D;           // [nwarps][HC heads] (m, l)
  float* ow = so + warp * HC * D;
  // m-tile mt's rows g, g + 8 are dims d0, d0 + 1 of the V codes' plane p: at D 128 p = mt / 2, d0 = 32p + 4g + 2hb
  // (hb = mt & 1); at D 64 p = mt, d0 = 16p + 2g
  auto park = [&](int mt, const float (&c)[4], float v0, float v1) {
    const int p = D == 64 ? mt : mt >> 1, hb = mt & 1;
    const float fac = __int_as_float((127 + 24 - 2 * p) << 23);  // 2^(24 - 2p), undoes the subnormal codes
    const int d0 = D == 64 ? p * 16 + 2 * g : p * 32 + 4 * g + 2 * hb;
    ow[head0 * D + d0] = fmaf(c[0], fac, v0);
    ow[(head0 + 1) * D + d0] = fmaf(c[1], fac, v1);
    ow[head0 * D + d0 + 1] = fmaf(c[2], fac, v0);
    ow[(head0 + 1) * D + d0 + 1] = fmaf(c[3], fac, v1);
  };
  constexpr int G0 = NMT / 2;  // m-tiles of V group 0 (planes 0, 1: dims 0 .. D/2 - 1); the others are group 1's
  if (HC == 4) {
#pragma unroll
    for (int i = 0; i < G0; ++i) {
      // lanes t < 2 hold the dims of V group 0 (m-tiles 0 .. G0 - 1), t >= 2 those of group 1; a select,
      // not o[G0 * gsel + i], which would put o in local memory
      float c[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) c[e] = gsel ? o[G0 + i][e] : o[i][e];
      // paired: lv / lw are groups 0 / 1 of this lane's heads; unpaired: lv is group gsel's
      if constexpr (kPair) park(G0 * gsel + i, c, gsel ? lw0 : lv0, gsel ? lw1 : lv1);
      else park(G0 * gsel + i, c, lv0, lv1);
    }
  } else {
#pragma unroll
    for (int mt = 0; mt < NMT; ++mt) park(mt, o[mt], mt < G0 ? lv0 : lw0, mt < G0 ? lv1 : lw1);
  }
  if (g == 0 && (HC == 8 || t < 2)) {
    float* ml = sml + (warp * HC + head0) * 2;
    ml[0] = m0; ml[1] = l0; ml[2] = m1; ml[3] = l1;
  }
  __syncthreads();
  if (after_write) grid_dependency_wait();  // this grid ends after the write (long done by now)
  // a folded CTA's warp 0 parked its window tile's entry in wbuf
  store_cta_partial<HC, D>(a, so, sml, nwarps, nh, hq_base, split,
                           fold_cta ? reinterpret_cast<const float*>(wbuf) : nullptr);
  if (a.fused_merge) merge_column<HC, D>(a, smem, blockIdx.x, hq_base, nh);
}

template <int NSTAGE, int HC, int D, bool WIDE>
int launch(const Args& a, int bh, int warps, int grid_y, int pdl, cudaStream_t stream) {
  const bool k4 = a.kh != nullptr, two_g = !(a.kg_row || a.vg_row);
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(bh, grid_y);
  cfg.blockDim = dim3(warps * 32);
  cfg.dynamicSmemBytes = k4 ? cta_smem<true>(NSTAGE, warps, a.fold_tiles > 0, D, WIDE)
                            : cta_smem<false>(NSTAGE, warps, a.fold_tiles > 0, D, WIDE);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;  // start while the window programs run
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  return (int)cudaLaunchKernelEx(&cfg, k4 ? (two_g ? int2_history_kernel<NSTAGE, HC, true, D, WIDE, true>
                                                   : int2_history_kernel<NSTAGE, HC, false, D, WIDE, true>)
                                         : two_g ? int2_history_kernel<NSTAGE, HC, true, D, WIDE, false>
                                                 : int2_history_kernel<NSTAGE, HC, false, D, WIDE, false>, a);
}

template <int NSTAGE, int HC, int D, bool WIDE, bool TWO_G, bool K4>
int prepare_one() {
  // set for the largest CTA (8 warps), not the one asked for: the attribute belongs to the template instance, so
  // a smaller later configuration would lower it under an earlier larger one (cudaErrorInvalidValue at launch)
  return (int)cudaFuncSetAttribute(int2_history_kernel<NSTAGE, HC, TWO_G, D, WIDE, K4>,
                                   cudaFuncAttributeMaxDynamicSharedMemorySize, cta_smem<K4>(NSTAGE, 8, true, D, WIDE));
}

template <int NSTAGE, int HC, int D, bool WIDE>
int prepare(int) {  // the dynamic shared-memory limits of the four instances, once, before any graph capture
  int rc = prepare_one<NSTAGE, HC, D, WIDE, true, false>();
  if (!rc) rc = prepare_one<NSTAGE, HC, D, WIDE, false, false>();
  if (!rc) rc = prepare_one<NSTAGE, HC, D, WIDE, true, true>();
  return rc ? rc : prepare_one<NSTAGE, HC, D, WIDE, false, true>();
}

template <int NSTAGE, int HC, int D, bool WIDE, bool TWO_G, bool K4>
int occupancy_one(int warps) {
  int n = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, int2_history_kernel<NSTAGE, HC, TWO_G, D, WIDE, K4>, warps * 32,
                                                warps * warp_smem<K4>(NSTAGE, D, WIDE));
  return n;
}

// the fewest of the four instances' (groups per row, INT2 / INT4 keys): the split rule takes one count per shape
// (history_cuda.occupancy), and the instances are built to the same registers (128 at D 128, 80 at D 64)
template <int NSTAGE, int HC, int D, bool WIDE>
int occupancy(int warps) {
  const int n[4] = {occupancy_one<NSTAGE, HC, D, WIDE, true, false>(warps),
                    occupancy_one<NSTAGE, HC, D, WIDE, false, false>(warps),
                    occupancy_one<NSTAGE, HC, D, WIDE, true, true>(warps),
                    occupancy_one<NSTAGE, HC, D, WIDE, false, true>(warps)};
  int m = n[0];
  for (int i = 1; i < 4; ++i) m = n[i] < m ? n[i] : m;
  return m;
}

}  // namespace

// HC: query heads per CTA column, 4 (columns 4..7 of a warp's tile repeat heads 0..3) or 8 (one head per column);
// 2 stages (history_cuda.STAGES); D 64's WIDE instance at HC 4 only (at HC 8 it compiled to 82-84 registers: 2 CTAs
// per SM instead of 3)
#define DISPATCH(NS, HC, HD, WIDE, FN, ...)                                       \
  switch ((HD == 64 ? 512 : HD == 128 ? 0 : 1024) + (WIDE ? 256 : 0) + NS * 16 + HC) { \
    case 2 * 16 + 4: return FN<2, 4, 128, false>(__VA_ARGS__);           \
    case 2 * 16 + 8: return FN<2, 8, 128, false>(__VA_ARGS__);           \
    case 512 + 2 * 16 + 4: return FN<2, 4, 64, false>(__VA_ARGS__);      \
    case 512 + 2 * 16 + 8: return FN<2, 8, 64, false>(__VA_ARGS__);      \
    case 256 + 512 + 2 * 16 + 4: return FN<2, 4, 64, true>(__VA_ARGS__); \
    default: return -1;                                                  \
  }

extern "C" {

// wide: 64-token stages (the WIDE instances, D 64 only; -1 elsewhere)
int oscar_history_prepare(int nstage, int warps, int hc, int head_dim, int wide) {
  DISPATCH(nstage, hc, head_dim, wide, prepare, warps)
}
int oscar_history_occupancy(int nstage, int warps, int hc, int head_dim, int wide) {
  DISPATCH(nstage, hc, head_dim, wide, occupancy, warps)
}

// kh: the K codes' high planes of a layer's INT4-key heads (cache.k_hi, h4 heads; k4_index [Hkv]: head h's row among
// them, -1 for an INT2 head), or null (a layer of INT2 keys)
int oscar_history_launch(int nstage, int warps, int hc, int head_dim, int wide, int bh, int gqa, int kg_row, int vg_row, int grid_y, const void* q,
                         int q_dtype, float c0, const void* kc,
                         const void* vc, const void* kh, const int* k4_index, int h4, const void* kp, const void* vp, const int* r2t, int r2t_stride,
                         const void* req_idx, int req_idx_64, const int* seq_lens, const int* ring_start, int hkv,
                         int sink, int window, float* o_part, float* lse_part, int ns_total, int page_log2, int pdl,
                         const void* sk, const void* sv, const void* rk, const void* rv, const int* sink_table,
                         int nwin_sink, int nwin_ring, int win_tiles, int win_last, void* out, int out_dtype, int* counters, int fused_merge, int fold_tiles, void* stream) {
  // grid_y: history splits; the window CTAs (nwin_sink + nwin_ring rows of the grid) after them (win_last 1);
  // a KV head's query heads in ceil(gqa / hc) CTA columns (head groups)
  const int hgroups = (gqa + hc - 1) / hc;
  Args a{q, q_dtype, c0, (const uint8_t*)kc, (const uint8_t*)vc, (const uint8_t*)kh, k4_index, h4, (const uint32_t*)kp,
         (const uint32_t*)vp, r2t, req_idx, seq_lens, ring_start, o_part, lse_part, r2t_stride, hkv, sink, window,
         grid_y * warps, ns_total, page_log2, req_idx_64, pdl, gqa, hgroups, kg_row, vg_row,
         (const __nv_bfloat16*)sk, (const __nv_bfloat16*)sv, (const __nv_bfloat16*)rk, (const __nv_bfloat16*)rv,
         sink_table, nwin_sink, nwin_ring, win_tiles, win_last, out, out_dtype, counters, fused_merge, fold_tiles};
  DISPATCH(nstage, hc, head_dim, wide, launch, a, bh * hgroups, warps, grid_y + nwin_sink + nwin_ring, pdl,
           (cudaStream_t)stream)
}

}  // extern "C"
