// The decode-sized KV write of OSCAR in CUDA: per (token, KV head, side) one CTA of 128 threads transforms the row,
// copies it into the BF16 sink / ring rows where asked, clips it, quantizes it per group (INT2, or INT4 keys on the
// layer's k4_heads) and packs it into the pool; with q, more CTAs per (token, KV head) rotate that token's query heads (q . T_q), 4 heads each.
// kernels/write_cuda.py builds, checks and launches it; kernels/write.py (oscar_write_kv kernel="cuda") calls it.
// The oracle is quant/cache_ops.py:write_reference, the math that of kernels/write.py's module docstring.
//
// Why CUDA for this: a decode write is a handful of programs, each one row long, so its time is one program's
// dependent chain, not work (benchmark/NOTES.md "The decode write's one-token programs": the Triton one-token
// program issued ~1020 instructions per warp at ~5 cycles each; 4.6 us for 1 or 8 KV heads on H200 against SGLang's
// store_cache 1.7-2.1 us). Here the chain is: the index loads and the row's loads issued together, 32 FMAs per
// thread into 4 independent sums, one cross-warp sum in shared memory, the clip's pairwise count over the row, warp
// reductions (redux.sync) for the clip threshold and the group bounds, and the pack of four codes per byte.
//
// Thread layout (D 128, 4 warps): in x . T, warp w takes rows k of T in [32w, 32w + 32) and lane l the columns
// [4l, 4l + 4) (one 16-byte load per row: a warp reads 512 contiguous bytes of T); the four partial rows meet in
// shared memory and from there thread j owns column j of x', so a group of G columns is G / 32 whole warps.
//
// Arithmetic, as the Triton kernel and the oracle: x' in fp32 (IEEE products; the sum's order differs); the window
// rows x' rounded to nearest even; the clip threshold tau = min{|x'_j| : #{i : |x'_i| > |x'_j|} <= n} (the
// (n+1)-th largest |x'| with ties as torch.topk); per group scale = e4m3((max - min) / qmax) (IEEE division; qmax 3,
// INT4 keys 15), min = e4m3(min), float8 e4m3 saturated to +-448 and rounded to nearest even (cvt.rn.satfinite, the
// oracle's round_param), t = (c - min) / scale with the stored values (IEEE division; 0 where scale is 0),
// code = #{thresholds <= t} (INT4: k + 0.5, k = 0..14); byte b of a record = c[b] | c[b+32] << 2 | c[b+64] << 4 |
// c[b+96] << 6 (quarter planes, quant/pack.py), for INT4 keys of c & 3 into k_codes and of c >> 2 into k_hi (the
// head's row k4_index[h] of k_hi's heads). INT4 keys are chosen per (layer, KV head): a layer with INT4 heads runs the
// kernel's kHasK4 instance (layers without run the INT2 code only), where a head's width is CTA-uniform: INT4 heads
// are never clipped and have qmax 15; INT2 and INT4 heads both count thresholds k + 0.5 up to their qmax.
// q programs: fp32 products of q and T_q (bf16 x bf16 products are exact in fp32, so this is transform_query's GEMM up
// to the order of its fp32 sums), rounded to q's dtype.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr int kD = 128;       // head_dim (shapes.CUDA_WRITE_HEAD_DIM)
constexpr int kThreads = 128; // 4 warps; thread j owns column j of x'
constexpr int kQHeads = 4;    // query heads per q program (write_cuda.Q_HEADS_PER_CTA)

struct Side {             // K (blockIdx.z 0) or V (1)
  const void* x;          // [T, Hkv, D] rows, element strides below (last dim contiguous)
  long long stride_t, stride_h;
  const float* mat;       // [D, D] or [Hkv, D, D] fp32, nullptr: x is already in its basis
  long long stride_mh;
  const float* mean;      // [D] or [Hkv, D] fp32, nullptr: none
  long long stride_meanh;
  uint32_t* codes;        // the pool's packed codes (D / 4 bytes per record); INT4 keys: their low two bits
  uint32_t* hi;           // INT4 keys: the high two bits of the codes (the pool's k_hi, h4 heads), else nullptr
  const int* k4_index;    // [Hkv]: head h's row among k_hi's heads, -1 for an INT2 head (nullptr without k_hi)
  int h4;
  uint16_t* params;       // (scale, min) float8 e4m3 pairs, one 16-bit word per group (scale in the low byte)
  __nv_bfloat16* sink;    // [rows, Hkv, D]
  __nv_bfloat16* ring;
  int group, clip_n;
  float th0, th1, th2;    // INT2 decision thresholds (write_cuda.INT2_THRESHOLDS: 0.5, 1.5, 2.5)
};

struct Args {
  Side side[2];
  const long long* slots;  // [T] pool slots
  const int* sink_dst;     // [T] sink row or -1
  const int* ring_dst;     // [T] ring row or -1
  int hkv, page_log2;
  int vec;                 // k, v and q rows 16-byte aligned with strides of whole 16-byte units: vector loads
  // q programs (blockIdx.z 2)
  const void* q;           // [T, Hq, D] of the input type
  long long q_stride_t, q_stride_h;
  const void* tq;          // [D, D] or [Hkv, D, D], the input type or fp32 (tq_fp32)
  long long tq_stride_h;
  int tq_fp32;
  void* q_out;             // [T, Hq, D] contiguous, the input type
  int gqa;
  int pdl_trigger;
};

struct QSmem {
  float q[kQHeads][kD];        // the program's query rows, fp32
  float part[kQHeads][4][kD];  // partial rows of q . T_q, one per warp
};

template <typename T> __device__ __forceinline__ float to_f(T v);
template <> __device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> __device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ __nv_bfloat16 from_f(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_f(float v) { return __float2half_rn(v); }

// eight consecutive 16-bit elements as fp32: one 16-byte load where the caller knows p is 16-byte aligned (vec)
template <typename T>
__device__ __forceinline__ void load8(const T* p, bool vec, float* f) {
  if (vec) {
    const uint4 u = __ldg(reinterpret_cast<const uint4*>(p));
    const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = to_f<T>(e[i]);
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = to_f<T>(p[i]);
  }
}

// fp32 <-> an unsigned key with the same order (for redux.sync, which takes integers); -0 sorts below +0
__device__ __forceinline__ uint32_t order_key(float f) {
  const uint32_t b = __float_as_uint(f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float from_key(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// record of (slot, KV head h): kernels/records.py pool_record
__device__ __forceinline__ long long pool_record(long long slot, int h, int hkv, int page_log2) {
  const long long pmask = (1ll << page_log2) - 1;
  return (((slot >> page_log2) * hkv + h) << page_log2) | (slot & pmask);
}

struct Smem {
  float part[4][kD];       // x . T partial rows, one per warp
  float absx[kD];          // |x'| for the clip's count
  uint32_t tau[4];         // per-warp minimum of the clip candidates (order keys of |x'|)
  uint32_t bound[4][2];    // per-warp (min, max) order keys of the clipped row
  uint32_t code[kD / 4];   // code j in byte j (little endian: word j / 4, byte j % 4)
};

template <typename TI, bool kHasK4>
__device__ void write_side(const Args& a, const Side& s, Smem& sm, int t, int h) {
  const int tid = threadIdx.x, w = tid >> 5, l = tid & 31;
  // the indices first: nothing below depends on them until the stores (j: the head's row of k_hi, else -1)
  const long long slot = a.slots[t];
  const int sink_row = a.sink_dst[t], ring_row = a.ring_dst[t];
  const int j = kHasK4 ? s.k4_index[h] : -1;
  const bool is4 = kHasK4 && j >= 0;  // CTA-uniform
  const TI* xrow = static_cast<const TI*>(s.x) + t * s.stride_t + h * s.stride_h;

  float xt;  // x'_tid
  if (s.mat != nullptr) {
    float xk[32];  // x_k - mean_k for k in [32w, 32w + 32)
#pragma unroll
    for (int i = 0; i < 4; ++i) load8<TI>(xrow + 32 * w + 8 * i, a.vec, xk + 8 * i);
    if (s.mean != nullptr) {
      const float4* mv = reinterpret_cast<const float4*>(s.mean + h * s.stride_meanh + 32 * w);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float4 m = __ldg(mv + i);
        xk[4 * i] -= m.x; xk[4 * i + 1] -= m.y; xk[4 * i + 2] -= m.z; xk[4 * i + 3] -= m.w;
      }
    }
    const float4* tm = reinterpret_cast<const float4*>(s.mat + h * s.stride_mh + (32 * w) * kD) + l;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int k = 0; k < 32; ++k) {
      const float4 r = __ldg(tm + k * (kD / 4));
      acc.x = fmaf(xk[k], r.x, acc.x); acc.y = fmaf(xk[k], r.y, acc.y);
      acc.z = fmaf(xk[k], r.z, acc.z); acc.w = fmaf(xk[k], r.w, acc.w);
    }
    reinterpret_cast<float4*>(sm.part[w])[l] = acc;
    __syncthreads();
    xt = ((sm.part[0][tid] + sm.part[1][tid]) + sm.part[2][tid]) + sm.part[3][tid];
  } else {
    xt = to_f<TI>(xrow[tid]);
  }

  // BF16 window copies (coalesced: a warp stores 64 contiguous bytes)
  const __nv_bfloat16 xb = __float2bfloat16_rn(xt);
  if (sink_row >= 0) s.sink[((long long)sink_row * a.hkv + h) * kD + tid] = xb;
  if (ring_row >= 0) s.ring[((long long)ring_row * a.hkv + h) * kD + tid] = xb;

  // clip at the (n + 1)-th largest |x'|: count the row's values above each, keep the smallest with <= n above (INT4
  // heads are never clipped)
  if (s.clip_n > 0 && !is4) {
    const float ax = fabsf(xt);
    sm.absx[tid] = ax;
    __syncthreads();
    int c0 = 0, c1 = 0, c2 = 0, c3 = 0;
    const float4* av = reinterpret_cast<const float4*>(sm.absx);
#pragma unroll 8
    for (int i = 0; i < kD / 4; ++i) {
      const float4 v = av[i];  // the same address in every lane: a broadcast
      c0 += v.x > ax; c1 += v.y > ax; c2 += v.z > ax; c3 += v.w > ax;
    }
    // |x'| >= 0, so its bits order like its values; +inf for a non-candidate
    uint32_t cand = (c0 + c1) + (c2 + c3) <= s.clip_n ? __float_as_uint(ax) : 0x7f800000u;
    cand = __reduce_min_sync(0xffffffffu, cand);
    if (l == 0) sm.tau[w] = cand;
    __syncthreads();
    const float tau = __uint_as_float(min(min(sm.tau[0], sm.tau[1]), min(sm.tau[2], sm.tau[3])));
    xt = fminf(fmaxf(xt, -tau), tau);
  }

  // group bounds: one redux per warp, then the warps of a group (G / 32 of them) through shared memory
  const uint32_t key = order_key(xt);
  uint32_t kmin = __reduce_min_sync(0xffffffffu, key), kmax = __reduce_max_sync(0xffffffffu, key);
  const int wpg = s.group >> 5;
  if (wpg > 1) {
    if (l == 0) { sm.bound[w][0] = kmin; sm.bound[w][1] = kmax; }
    __syncthreads();
    const int w0 = w - w % wpg;
    kmin = sm.bound[w0][0]; kmax = sm.bound[w0][1];
    for (int i = 1; i < wpg; ++i) { kmin = min(kmin, sm.bound[w0 + i][0]); kmax = max(kmax, sm.bound[w0 + i][1]); }
  }
  const float lo = from_key(kmin), hi = from_key(kmax);
  const float qmax = is4 ? 15.f : 3.f;
  // (scale, min) -> e4m3 (scale in the low byte: the lower address), then their exact values back through fp16
  const __nv_fp8x2_storage_t pair =
      __nv_cvt_float2_to_fp8x2(make_float2(__fdiv_rn(hi - lo, qmax), lo), __NV_SATFINITE, __NV_E4M3);
  const float2 stored = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3)));
  const float scale = stored.x, mn = stored.y;
  const float u = scale > 0.f ? __fdiv_rn(xt - mn, scale) : 0.f;
  uint32_t code;
  if constexpr (kHasK4) {
    // #{k + 0.5 <= u, k < qmax}: u + 0.5 rounds up to the next integer where u lies just below a threshold (never
    // down: the integers are exact); c - 0.5 and the comparison are exact, so the correction makes it the count
    float c = fminf(fmaxf(floorf(u + 0.5f), 0.f), qmax);
    if (c > 0.f && u < c - 0.5f) c -= 1.f;
    code = (uint32_t)c;
  } else {
    code = (u >= s.th0) + (u >= s.th1) + (u >= s.th2);
  }

  const long long rec = pool_record(slot, h, a.hkv, a.page_log2);
  if (tid % s.group == 0) s.params[rec * (kD / s.group) + tid / s.group] = pair;
  reinterpret_cast<uint8_t*>(sm.code)[tid] = (uint8_t)code;
  __syncthreads();
  // word i of the record: bytes 4i..4i+3, each c[b] | c[b+32] << 2 | c[b+64] << 4 | c[b+96] << 6
  if constexpr (kHasK4) {
    if (tid < (is4 ? 16 : 8)) {  // threads 0-7: the words of c & 3 (k_codes); 8-15, INT4 heads: of c >> 2 (k_hi)
      const int i = tid & 7, sh = (tid >> 3) * 2;
      const uint32_t m = 0x03030303u;  // two bits of each byte
      const uint32_t word = ((sm.code[i] >> sh) & m) | (((sm.code[i + 8] >> sh) & m) << 2) |
                            (((sm.code[i + 16] >> sh) & m) << 4) | (((sm.code[i + 24] >> sh) & m) << 6);
      if (tid < 8) s.codes[rec * (kD / 16) + i] = word;
      else s.hi[pool_record(slot, j, s.h4, a.page_log2) * (kD / 16) + i] = word;
    }
  } else if (tid < 8) {
    const uint32_t word = sm.code[tid] | (sm.code[tid + 8] << 2) | (sm.code[tid + 16] << 4) | (sm.code[tid + 24] << 6);
    s.codes[rec * (kD / 16) + tid] = word;
  }
}

// q' = q . T_q[h] for query heads [r0, r0 + kQHeads) of KV head h of token t (a q program per kQHeads heads: the
// first version took all of a KV head's heads in one CTA, in passes of 8, and its FMA loop was the write's long pole
// at GQA >= 8, e.g. GLM-4.7's 12: 5.2 us against 3.9 for the K / V programs on H200). The q rows go to shared
// memory first (one coalesced load per thread and head, issued together) and each thread loads its 32 x 4 slice of
// T_q into registers before the loop, so the loop reads only registers and shared memory.
template <typename TI>
__device__ void rotate_q(const Args& a, QSmem& sm, int t, int h, int r0) {
  const int tid = threadIdx.x, w = tid >> 5, l = tid & 31;
  const int nr = min(kQHeads, a.gqa - r0);
  const TI* q0 = static_cast<const TI*>(a.q) + t * a.q_stride_t + (long long)(h * a.gqa + r0) * a.q_stride_h;
#pragma unroll
  for (int r = 0; r < kQHeads; ++r)
    if (r < nr) sm.q[r][tid] = to_f<TI>(q0[r * a.q_stride_h + tid]);
  float4 tr[32];  // T_q rows 32w .. 32w + 31, columns 4l .. 4l + 3
  const long long tq_off = h * a.tq_stride_h + (32 * w) * kD + 4 * l;
#pragma unroll
  for (int k = 0; k < 32; ++k) {
    const long long off = tq_off + (long long)k * kD;
    if (a.tq_fp32) {
      tr[k] = __ldg(reinterpret_cast<const float4*>(static_cast<const float*>(a.tq) + off));
    } else {
      const uint2 u = __ldg(reinterpret_cast<const uint2*>(static_cast<const TI*>(a.tq) + off));
      const TI* e = reinterpret_cast<const TI*>(&u);
      tr[k] = make_float4(to_f<TI>(e[0]), to_f<TI>(e[1]), to_f<TI>(e[2]), to_f<TI>(e[3]));
    }
  }
  __syncthreads();  // q staged
#pragma unroll
  for (int r = 0; r < kQHeads; ++r) {
    if (r < nr) {
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
      const float4* qv = reinterpret_cast<const float4*>(sm.q[r] + 32 * w);  // a broadcast per load
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float4 q4 = qv[i];
        const float qk[4] = {q4.x, q4.y, q4.z, q4.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float4& m = tr[4 * i + j];
          acc.x = fmaf(qk[j], m.x, acc.x); acc.y = fmaf(qk[j], m.y, acc.y);
          acc.z = fmaf(qk[j], m.z, acc.z); acc.w = fmaf(qk[j], m.w, acc.w);
        }
      }
      reinterpret_cast<float4*>(sm.part[r][w])[l] = acc;
    }
  }
  __syncthreads();
  TI* out = static_cast<TI*>(a.q_out) + ((long long)t * a.hkv * a.gqa + h * a.gqa + r0) * kD + tid;
  for (int r = 0; r < nr; ++r)
    out[r * kD] = from_f<TI>(((sm.part[r][0][tid] + sm.part[r][1][tid]) + sm.part[r][2][tid]) + sm.part[r][3][tid]);
}

// kHasK4: the layer has INT4-key heads (the pool's k_hi; the K side, z 0); V is always INT2
template <typename TI, bool kHasK4>
__global__ void __launch_bounds__(kThreads) int2_write_kernel(Args a) {
#if __CUDA_ARCH__ >= 900
  if (a.pdl_trigger) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");  // the decode may launch
#endif
  const int t = blockIdx.x, h = blockIdx.y, z = blockIdx.z;
  if (z >= 2) {  // q programs: heads [(z - 2) * kQHeads, + kQHeads) of KV head h
    __shared__ QSmem qs;
    rotate_q<TI>(a, qs, t, h, (z - 2) * kQHeads);
  } else {
    __shared__ Smem sm;
    if constexpr (kHasK4) {
      if (z == 0) write_side<TI, true>(a, a.side[0], sm, t, h);
      else write_side<TI, false>(a, a.side[1], sm, t, h);
    } else {
      write_side<TI, false>(a, a.side[z], sm, t, h);
    }
  }
}

}  // namespace

extern "C" {

// Once per process and device, before any graph capture (write_cuda.library): the largest shared-memory carveout for
// this kernel. Why: an SM runs the carveout of the kernels it holds, and the write's CTAs (13 KB of shared memory)
// otherwise leave their SM at a small one; a chained history CTA (its programmatic dependent, ~100 KB) then cannot
// start there until the write CTA has ended, so the block scheduler put two history CTAs on other SMs: GLM-4.7 TP8
// at batch 1, 5 write CTAs, 5 SMs with two history CTAs and 5 with none, the call's last CTA 3.7 us late at 128k.
int oscar_write_prepare() {
  const void* kernels[] = {(const void*)int2_write_kernel<__nv_bfloat16, false>,
                           (const void*)int2_write_kernel<__half, false>,
                           (const void*)int2_write_kernel<__nv_bfloat16, true>,
                           (const void*)int2_write_kernel<__half, true>};
  for (const void* k : kernels) {
    const int rc = (int)cudaFuncSetAttribute(k, cudaFuncAttributePreferredSharedMemoryCarveout,
                                             cudaSharedmemCarveoutMaxShared);
    if (rc) return rc;
  }
  return 0;
}

// x_dtype 0: bf16 k / v / q, 1: fp16. k_hi nullptr: INT2 keys; else the high planes of the k4_heads heads with INT4
// keys, k4_index [Hkv] each head's row there (-1: INT2). Returns a cudaError_t code (0: launched).
int oscar_write_launch(int num_tokens, int hkv, int x_dtype, int page_log2, const long long* slots,
                       const int* sink_dst, const int* ring_dst, int vec,
                       const void* k, long long k_stride_t, long long k_stride_h, const float* kmat,
                       long long kmat_stride_h, const float* kmean, long long kmean_stride_h, void* k_codes,
                       void* k_hi, const int* k4_index, int k4_heads, void* k_params, void* sink_k, void* ring_k, int k_group, int k_clip_n, float k_th0,
                       float k_th1, float k_th2,
                       const void* v, long long v_stride_t, long long v_stride_h, const float* vmat,
                       long long vmat_stride_h, void* v_codes, void* v_params, void* sink_v, void* ring_v, int v_group,
                       int v_clip_n, float v_th0, float v_th1, float v_th2,
                       const void* q, long long q_stride_t, long long q_stride_h, const void* tq,
                       long long tq_stride_h, int tq_fp32, void* q_out, int gqa, int pdl_trigger, void* stream) {
  Args a{};
  a.side[0] = Side{k, k_stride_t, k_stride_h, kmat, kmat_stride_h, kmean, kmean_stride_h, (uint32_t*)k_codes,
                   (uint32_t*)k_hi, k4_index, k4_heads, (uint16_t*)k_params, (__nv_bfloat16*)sink_k, (__nv_bfloat16*)ring_k, k_group, k_clip_n,
                   k_th0, k_th1, k_th2};
  a.side[1] = Side{v, v_stride_t, v_stride_h, vmat, vmat_stride_h, nullptr, 0, (uint32_t*)v_codes,
                   nullptr, nullptr, 0, (uint16_t*)v_params, (__nv_bfloat16*)sink_v, (__nv_bfloat16*)ring_v, v_group, v_clip_n,
                   v_th0, v_th1, v_th2};
  a.slots = slots; a.sink_dst = sink_dst; a.ring_dst = ring_dst;
  a.hkv = hkv; a.page_log2 = page_log2; a.vec = vec;
  a.q = q; a.q_stride_t = q_stride_t; a.q_stride_h = q_stride_h; a.tq = tq; a.tq_stride_h = tq_stride_h;
  a.tq_fp32 = tq_fp32; a.q_out = q_out; a.gqa = gqa; a.pdl_trigger = pdl_trigger;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(num_tokens, hkv, 2 + (q != nullptr ? (gqa + kQHeads - 1) / kQHeads : 0));  // write_cuda.grid
  cfg.blockDim = dim3(kThreads);
  cfg.stream = (cudaStream_t)stream;
  if (k_hi != nullptr)
    return (int)(x_dtype == 0 ? cudaLaunchKernelEx(&cfg, int2_write_kernel<__nv_bfloat16, true>, a)
                              : cudaLaunchKernelEx(&cfg, int2_write_kernel<__half, true>, a));
  return (int)(x_dtype == 0 ? cudaLaunchKernelEx(&cfg, int2_write_kernel<__nv_bfloat16, false>, a)
                            : cudaLaunchKernelEx(&cfg, int2_write_kernel<__half, false>, a));
}

}  // extern "C"
