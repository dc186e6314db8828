// Tensor-core paged attention kernels (mma.sync m16n8k16 f16 -> fp32, ldmatrix, cp.async; sm_80 and newer) and
// their launchers, templated on the tile configuration so dev/kernels/attention_bench.cu can time variants:
//   - prefill: FlashAttention-2 style. A block owns BM = 16 * NW * RM query rows of one head (each warp RM 16-row
//     m-tiles, Q in registers or re-read from shared memory; RM >= 2 reuses every K / V fragment RM times), streams BN-key K/V tiles of the rows' sequence through a
//     STAGES-deep cp.async ring in shared memory, computes S = Q K^T and O += P V with mma.sync, online softmax
//     in fp32 (log2 domain), causal tile skipping per warp. Rows of several sequences in one block are handled
//     by one pass per distinct sequence (rows outside the pass are masked); one pass in the common case.
//   - decode: flash-decoding. A block owns one row (token) and up to 16 q heads sharing one KV head (GQA: the
//     K/V bytes are read once for all of them; the heads fill the 16 mma rows), and the tiles z, z + n_splits,
//     ... of that row's keys; its BN / 16 warps take 16 keys of each tile each. Warp states merge in shared
//     memory; split partials merge in the last block to finish (per-row arrival counter reset by that block,
//     so the kernel is graph-safe without a memset). One launch, no separate combine kernel.
// Contract of the inputs: as cuda::attention_paged (backend/kernels.h), f16 activations and f16 cache, all
// pointers 16-byte aligned, head_dim = D, no soft-cap. Positions and page-table entries are trusted (validated by
// ops). A sliding window (window > 0: row at position p sees keys p - window + 1 .. p; kernels instantiated with
// WIN = true, so the plain kernels compile as before) skips the key tiles below every row's window and masks the keys
// below a row's window in the tiles it crosses, as the causal mask does above.
#pragma once

#include <functional>
#include <map>
#include <mutex>
#include <tuple>
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/pdl.cuh"

namespace exl2::cuda::attn {

constexpr float kLog2e = 1.4426950408889634f;
constexpr int kPad = 8;  // halves of padding per shared-memory row: ldmatrix rows land on distinct banks

// ---- PTX wrappers ------------------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, asynchronously; valid == false writes 16 zero bytes and reads nothing.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ float fast_exp2(float x) {  // ex2.approx: 2^-inf = 0, rel. error ~2^-22
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t pack_h2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);  // lo in the low 16 bits (the smaller column index)
  return *reinterpret_cast<const uint32_t*>(&h);
}

// ---- shared pieces -----------------------------------------------------------------------------------------

// Stage keys [kb, kb + BN) of one sequence's KV head hk into sK / sV ([BN][D + kPad] halves) with NT threads;
// keys >= kv_len become zeros (never read from the pages, so garbage beyond a sequence cannot leak in as NaN).
// ROLLED: keep the chunk loop rolled (RM >= 2 prefill: the unrolled loop's hoisted addresses cost registers the
// two m-tiles' accumulators need).
template <int D, int BN, int NT, bool ROLLED = false>
__device__ __forceinline__ void load_kv_tile(__half* sK, __half* sV, const __half* __restrict__ k_pages,
                                             const __half* __restrict__ v_pages,
                                             const int32_t* __restrict__ seq_pages, int kb, int kv_len,
                                             int page_size, int n_heads_kv, int hk) {
  constexpr int CPR = D / 8;  // 16-byte chunks per key row
  constexpr int S = D + kPad;
  const bool pow2 = (page_size & (page_size - 1)) == 0;  // the usual case: shift and mask, no division
  const int shift = __ffs(page_size) - 1;
  auto chunk = [&](int idx) {
    const int key = idx / CPR, c = idx % CPR;
    const int j = kb + key;
    const bool valid = j < kv_len;
    int64_t off = 0;
    if (valid) {
      const int pi = pow2 ? j >> shift : j / page_size;
      const int slot = pow2 ? j & (page_size - 1) : j - pi * page_size;
      off = ((int64_t(seq_pages[pi]) * page_size + slot) * n_heads_kv + hk) * D + c * 8;
    }
    cp_async16(smem_u32(sK + key * S + c * 8), k_pages + off, valid);
    cp_async16(smem_u32(sV + key * S + c * 8), v_pages + off, valid);
  };
  if constexpr (ROLLED) {
#pragma unroll 1
    for (int idx = threadIdx.x; idx < BN * CPR; idx += NT) chunk(idx);
  } else {
#pragma unroll
    for (int idx = threadIdx.x; idx < BN * CPR; idx += NT) chunk(idx);
  }
}

// One warp: its 16 query rows against KW keys staged at k_addr / v_addr (shared addresses of the warp's first
// key row, row stride D + kPad halves). Q A-fragments come from qa (QREG) or from shared memory at q_addr (this
// lane's ldmatrix row address). key0: index of the first key; a key of index j > pos_lo (row g) / pos_hi (row
// g + 8), or (window > 0) j <= pos - window (below the row's sliding window), is masked when `masked`. m: running
// max in the log2 domain (scaled), l: this lane's partial row sums,
// o: output accumulators (C fragments of D / 8 n-tiles).
template <int D, int KW, bool QREG>
__device__ __forceinline__ void warp_attend(const uint32_t (&qa)[D / 16][4], uint32_t q_addr, uint32_t k_addr,
                                            uint32_t v_addr, int key0, int pos_lo, int pos_hi, int window,
                                            bool masked, float scale_log2, float (&m)[2], float (&l)[2],
                                            float (&o)[D / 8][4]) {
  constexpr int SB = (D + kPad) * 2;  // row stride in bytes
  const int lane = threadIdx.x & 31;
  // ldmatrix lane offsets: K (non-trans) rows = keys, V (trans) rows = keys.
  const uint32_t k_lane = k_addr + ((lane & 7) + ((lane >> 4) << 3)) * SB + ((lane >> 3) & 1) * 16;
  const uint32_t v_lane = v_addr + ((lane & 7) + (((lane >> 3) & 1) << 3)) * SB + (lane >> 4) * 16;

  float s[KW / 8][4];
#pragma unroll
  for (int nt = 0; nt < KW / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t a[4];
    if constexpr (QREG) {
      a[0] = qa[kk][0], a[1] = qa[kk][1], a[2] = qa[kk][2], a[3] = qa[kk][3];
    } else {
      ldsm_x4(q_addr + kk * 32, a);
    }
#pragma unroll
    for (int np = 0; np < KW / 16; ++np) {
      uint32_t b[4];
      ldsm_x4(k_lane + np * 16 * SB + kk * 32, b);
      mma16816(s[2 * np], a, b[0], b[1]);
      mma16816(s[2 * np + 1], a, b[2], b[3]);
    }
  }

  // Online softmax over this tile (rows g = lane / 4 and g + 8; columns 2 * (lane % 4) + {0, 1} per n-tile).
  float mx0 = -INFINITY, mx1 = -INFINITY;
  const int q4 = lane & 3;
#pragma unroll
  for (int nt = 0; nt < KW / 8; ++nt) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      if (masked) {
        const int key = key0 + nt * 8 + 2 * q4 + e;
        if (key > pos_lo || (window > 0 && key + window <= pos_lo)) s[nt][e] = -INFINITY;
        if (key > pos_hi || (window > 0 && key + window <= pos_hi)) s[nt][2 + e] = -INFINITY;
      }
      mx0 = fmaxf(mx0, s[nt][e]);
      mx1 = fmaxf(mx1, s[nt][2 + e]);
    }
  }
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
  const float mn0 = fmaxf(m[0], mx0 * scale_log2), mn1 = fmaxf(m[1], mx1 * scale_log2);
  const float mu0 = mn0 == -INFINITY ? 0.f : mn0, mu1 = mn1 == -INFINITY ? 0.f : mn1;  // all masked so far
  const float c0 = fast_exp2(m[0] - mu0), c1 = fast_exp2(m[1] - mu1);                 // m = -inf: 0
  m[0] = mn0;
  m[1] = mn1;
  float ls0 = 0.f, ls1 = 0.f;
#pragma unroll
  for (int nt = 0; nt < KW / 8; ++nt) {
    s[nt][0] = fast_exp2(fmaf(s[nt][0], scale_log2, -mu0));
    s[nt][1] = fast_exp2(fmaf(s[nt][1], scale_log2, -mu0));
    s[nt][2] = fast_exp2(fmaf(s[nt][2], scale_log2, -mu1));
    s[nt][3] = fast_exp2(fmaf(s[nt][3], scale_log2, -mu1));
    ls0 += s[nt][0] + s[nt][1];
    ls1 += s[nt][2] + s[nt][3];
  }
  l[0] = fmaf(l[0], c0, ls0);
  l[1] = fmaf(l[1], c1, ls1);
#pragma unroll
  for (int dn = 0; dn < D / 8; ++dn) {
    o[dn][0] *= c0;
    o[dn][1] *= c0;
    o[dn][2] *= c1;
    o[dn][3] *= c1;
  }

  // O += P V: the C fragments of two adjacent key n-tiles are the A fragment of one k16 step.
#pragma unroll
  for (int kk = 0; kk < KW / 16; ++kk) {
    const uint32_t a[4] = {pack_h2(s[2 * kk][0], s[2 * kk][1]), pack_h2(s[2 * kk][2], s[2 * kk][3]),
                           pack_h2(s[2 * kk + 1][0], s[2 * kk + 1][1]), pack_h2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {
      uint32_t b[4];
      ldsm_x4_t(v_lane + kk * 16 * SB + dp * 32, b);
      mma16816(o[2 * dp], a, b[0], b[1]);
      mma16816(o[2 * dp + 1], a, b[2], b[3]);
    }
  }
}

// warp_attend for R >= 2 consecutive 16-row m-tiles of one warp (prefill RM = R; R = 1 uses warp_attend above):
// every K / V fragment read by ldmatrix feeds R mma (one per m-tile), so shared-memory traffic per FLOP drops
// by R (Q fragments come from qa[r] (QREG) or from shared memory at q_addr + r * 16 rows). Per m-tile r:
// pos_lo[r] / pos_hi[r] (rows g / g + 8 of the m-tile; -1: no key), window (> 0: keys <= pos - window are below a
// row's sliding window), masked[r] (some key of the tile exceeds a row's position or falls below its window),
// online-softmax state m[r], l[r] and accumulators o[r]; the arithmetic of each m-tile is the
// same as warp_attend's. An m-tile that sees no key of the tile (only at the diagonal of unaligned chunks) is
// masked to -inf and keeps its state (p = 0, correction 1) at the cost of its mma.
template <int D, int KW, bool QREG, int R>
__device__ __forceinline__ void warp_attend_rm(const uint32_t (&qa)[R][D / 16][4], uint32_t q_addr, uint32_t k_addr,
                                               uint32_t v_addr, int key0, const int (&pos_lo)[R],
                                               const int (&pos_hi)[R], int window, const bool (&masked)[R],
                                               float scale_log2,
                                               float (&m)[R][2], float (&l)[R][2], float (&o)[R][D / 8][4]) {
  constexpr int SB = (D + kPad) * 2;  // row stride in bytes
  const int lane = threadIdx.x & 31;
  const uint32_t k_lane = k_addr + ((lane & 7) + ((lane >> 4) << 3)) * SB + ((lane >> 3) & 1) * 16;
  const uint32_t v_lane = v_addr + ((lane & 7) + (((lane >> 3) & 1) << 3)) * SB + (lane >> 4) * 16;

  float s[R][KW / 8][4];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int nt = 0; nt < KW / 8; ++nt) s[r][nt][0] = s[r][nt][1] = s[r][nt][2] = s[r][nt][3] = 0.f;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t a[R][4];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if constexpr (QREG) {
        a[r][0] = qa[r][kk][0], a[r][1] = qa[r][kk][1], a[r][2] = qa[r][kk][2], a[r][3] = qa[r][kk][3];
      } else {
        ldsm_x4(q_addr + r * 16 * SB + kk * 32, a[r]);
      }
    }
#pragma unroll
    for (int np = 0; np < KW / 16; ++np) {
      uint32_t b[4];
      ldsm_x4(k_lane + np * 16 * SB + kk * 32, b);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        mma16816(s[r][2 * np], a[r], b[0], b[1]);
        mma16816(s[r][2 * np + 1], a[r], b[2], b[3]);
      }
    }
  }

  const int q4 = lane & 3;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < KW / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        if (masked[r]) {
          const int key = key0 + nt * 8 + 2 * q4 + e;
          if (key > pos_lo[r] || (window > 0 && key + window <= pos_lo[r])) s[r][nt][e] = -INFINITY;
          if (key > pos_hi[r] || (window > 0 && key + window <= pos_hi[r])) s[r][nt][2 + e] = -INFINITY;
        }
        mx0 = fmaxf(mx0, s[r][nt][e]);
        mx1 = fmaxf(mx1, s[r][nt][2 + e]);
      }
    }
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    const float mn0 = fmaxf(m[r][0], mx0 * scale_log2), mn1 = fmaxf(m[r][1], mx1 * scale_log2);
    const float mu0 = mn0 == -INFINITY ? 0.f : mn0, mu1 = mn1 == -INFINITY ? 0.f : mn1;
    const float c0 = fast_exp2(m[r][0] - mu0), c1 = fast_exp2(m[r][1] - mu1);
    m[r][0] = mn0;
    m[r][1] = mn1;
    float ls0 = 0.f, ls1 = 0.f;
#pragma unroll
    for (int nt = 0; nt < KW / 8; ++nt) {
      s[r][nt][0] = fast_exp2(fmaf(s[r][nt][0], scale_log2, -mu0));
      s[r][nt][1] = fast_exp2(fmaf(s[r][nt][1], scale_log2, -mu0));
      s[r][nt][2] = fast_exp2(fmaf(s[r][nt][2], scale_log2, -mu1));
      s[r][nt][3] = fast_exp2(fmaf(s[r][nt][3], scale_log2, -mu1));
      ls0 += s[r][nt][0] + s[r][nt][1];
      ls1 += s[r][nt][2] + s[r][nt][3];
    }
    l[r][0] = fmaf(l[r][0], c0, ls0);
    l[r][1] = fmaf(l[r][1], c1, ls1);
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn) {
      o[r][dn][0] *= c0;
      o[r][dn][1] *= c0;
      o[r][dn][2] *= c1;
      o[r][dn][3] *= c1;
    }
  }

  // O += P V, one V fragment for all R m-tiles.
#pragma unroll
  for (int kk = 0; kk < KW / 16; ++kk) {
    uint32_t a[R][4];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      a[r][0] = pack_h2(s[r][2 * kk][0], s[r][2 * kk][1]);
      a[r][1] = pack_h2(s[r][2 * kk][2], s[r][2 * kk][3]);
      a[r][2] = pack_h2(s[r][2 * kk + 1][0], s[r][2 * kk + 1][1]);
      a[r][3] = pack_h2(s[r][2 * kk + 1][2], s[r][2 * kk + 1][3]);
    }
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {
      uint32_t b[4];
      ldsm_x4_t(v_lane + kk * 16 * SB + dp * 32, b);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        mma16816(o[r][2 * dp], a[r], b[0], b[1]);
        mma16816(o[r][2 * dp + 1], a[r], b[2], b[3]);
      }
    }
  }
}

// This lane's ldmatrix row address for the A fragments of a 16-row tile at q_base (row stride D + kPad).
template <int D>
__device__ __forceinline__ uint32_t q_lane_addr(const __half* q_base) {
  const int lane = threadIdx.x & 31;
  return smem_u32(q_base) + ((lane & 7) + (((lane >> 3) & 1) << 3)) * (D + kPad) * 2 + (lane >> 4) * 16;
}

// ---- prefill -----------------------------------------------------------------------------------------------

template <int D, int NW, int BN, int STAGES, int RM = 1>
constexpr size_t prefill_smem_bytes() {
  return size_t(16 * NW * RM + 2 * STAGES * BN) * (D + kPad) * sizeof(__half);
}

// grid (n_heads, ceil(n / BM)), heaviest (last) row tiles first; block NW warps. Warp w owns the RM consecutive
// 16-row m-tiles of rows [16 RM w, 16 RM (w + 1)) (RM = 1: warp_attend, one m-tile; RM >= 2: warp_attend_rm, each
// K / V fragment feeds RM m-tiles). Shared: sQ [BM][D + kPad], then STAGES x (K [BN][D + kPad], V [BN][D + kPad]).
// (A min-blocks bound of 3 on <64, 4, 64, 2, Q, RM 2> spills 536 bytes, and any explicit min-blocks bound, even 1,
// raises the RM = 1 register use at 128 threads: none is given.)
template <int D, int NW, int BN, int STAGES, bool QREG, int RM = 1, bool WIN = false>
__global__ void __launch_bounds__(NW * 32)
    attention_prefill_mma_kernel(const __half* __restrict__ q, const __half* __restrict__ k_pages,
                                 const __half* __restrict__ v_pages, const int32_t* __restrict__ positions,
                                 const int32_t* __restrict__ seq_of_token, const int32_t* __restrict__ page_table,
                                 int64_t pages_per_seq, int64_t n, int n_heads, int n_heads_kv, int page_size,
                                 float scale_log2, __half* __restrict__ out, int window) {
  constexpr int BM = 16 * NW * RM, NT = 32 * NW, S = D + kPad, CPR = D / 8;
  if constexpr (!WIN) window = 0;  // the window code folds away
  static_assert(BN % 16 == 0 && STAGES >= 2 && RM >= 1, "tile config");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __half* sQ = reinterpret_cast<__half*>(smem_raw);
  __half* sKV = sQ + BM * S;  // stage st: K at sKV + 2 * st * BN * S, V right after
  __shared__ int s_seq[BM], s_pos[BM], s_first[BM], s_len[BM];
  pdl_wait();  // cuda/pdl.cuh: q, the cache rows and out belong to earlier kernels

  const int h = blockIdx.x;
  const int64_t t0 = int64_t(gridDim.y - 1 - blockIdx.y) * BM;
  const int hk = h / (n_heads / n_heads_kv);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

  for (int r = threadIdx.x; r < BM; r += NT) {  // one iteration (BM <= NT) or RM
    const int64_t t = t0 + r;
    s_seq[r] = t < n ? seq_of_token[t] : -1;
    s_pos[r] = t < n ? positions[t] : -1;
  }
#pragma unroll
  for (int idx = threadIdx.x; idx < BM * CPR; idx += NT) {
    const int r = idx / CPR, c = idx % CPR;
    const int64_t t = t0 + r;
    const bool valid = t < n;
    cp_async16(smem_u32(sQ + r * S + c * 8), q + (valid ? (t * n_heads + h) * D + c * 8 : 0), valid);
  }
  cp_async_commit();
  __syncthreads();
  for (int r = threadIdx.x; r < BM; r += NT) {  // first row of each distinct sequence; keys its rows need
    const int sq = s_seq[r];
    int first = sq >= 0, mx = -1, mn = 0x7fffffff;
#pragma unroll 8
    for (int r2 = 0; r2 < BM; ++r2) {
      if (s_seq[r2] == sq) {
        if (r2 < r) first = 0;
        mx = max(mx, s_pos[r2]);
        mn = min(mn, s_pos[r2]);
      }
    }
    // The first row of a sequence: 1 + the lowest key any of its rows sees (a sliding window's start); others 0.
    s_first[r] = first ? 1 + (window > 0 ? max(0, mn - window + 1) : 0) : 0;
    s_len[r] = mx + 1;
  }
  __syncthreads();

  uint32_t qa[RM][D / 16][4];
  bool q_loaded = false;
  const uint32_t q_addr = q_lane_addr<D>(sQ + warp * 16 * RM * S);  // m-tile r: + r * 16 rows
  float m[RM][2], l[RM][2];
  float o[RM][D / 8][4];
#pragma unroll
  for (int r = 0; r < RM; ++r) {
    m[r][0] = m[r][1] = -INFINITY;
    l[r][0] = l[r][1] = 0.f;
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn) o[r][dn][0] = o[r][dn][1] = o[r][dn][2] = o[r][dn][3] = 0.f;
  }
  const int row_lo = warp * 16 * RM + (lane >> 2);  // m-tile r: rows row_lo + 16 r and row_lo + 16 r + 8

  for (int r0 = 0; r0 < BM; ++r0) {
    if (!s_first[r0]) continue;  // block-uniform
    const int seq = s_seq[r0], kv_len = s_len[r0];
    const int32_t* seq_pages = page_table + int64_t(seq) * pages_per_seq;
    int pos_lo[RM], pos_hi[RM], pmin[RM], pmax[RM];
    int wmax = -1;  // over the warp's rows: the last key any of them sees
#pragma unroll
    for (int r = 0; r < RM; ++r) {
      const int lo = row_lo + 16 * r, hi = lo + 8;
      pos_lo[r] = s_seq[lo] == seq ? s_pos[lo] : -1;
      pos_hi[r] = s_seq[hi] == seq ? s_pos[hi] : -1;
      pmin[r] = min(pos_lo[r], pos_hi[r]);
      pmax[r] = max(pos_lo[r], pos_hi[r]);
#pragma unroll
      for (int o2 = 16; o2 > 0; o2 >>= 1) {
        pmin[r] = min(pmin[r], __shfl_xor_sync(0xffffffffu, pmin[r], o2));
        pmax[r] = max(pmax[r], __shfl_xor_sync(0xffffffffu, pmax[r], o2));
      }
      wmax = max(wmax, pmax[r]);
    }
    const int tile0 = WIN ? (s_first[r0] - 1) / BN : 0;  // tiles below every row's window are never loaded
    const int n_tiles = (kv_len + BN - 1) / BN - tile0;
#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st) {
      if (st < n_tiles) {
        load_kv_tile<D, BN, NT, (RM > 1)>(sKV + 2 * st * BN * S, sKV + (2 * st + 1) * BN * S, k_pages, v_pages,
                                              seq_pages, (tile0 + st) * BN, kv_len, page_size, n_heads_kv, hk);
      }
      cp_async_commit();
    }
    for (int i = 0; i < n_tiles; ++i) {
      cp_async_wait<STAGES - 2>();
      __syncthreads();  // tile i visible to all; the stage of tile i - 1 is free
      {
        const int nx = i + STAGES - 1;
        if (nx < n_tiles) {
          const int st = nx % STAGES;
          load_kv_tile<D, BN, NT, (RM > 1)>(sKV + 2 * st * BN * S, sKV + (2 * st + 1) * BN * S, k_pages, v_pages,
                                            seq_pages, (tile0 + nx) * BN, kv_len, page_size, n_heads_kv, hk);
        }
        cp_async_commit();
      }
      if constexpr (QREG) {
        if (!q_loaded) {
#pragma unroll
          for (int r = 0; r < RM; ++r)
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) ldsm_x4(q_addr + r * 16 * S * 2 + kk * 32, qa[r][kk]);
          q_loaded = true;
        }
      }
      const int kb = (tile0 + i) * BN;
      if (kb <= wmax) {  // warp-uniform: some row of this warp sees a key of this tile (or its window's edge)
        const int st = i % STAGES;
        const uint32_t k_addr = smem_u32(sKV + 2 * st * BN * S), v_addr = smem_u32(sKV + (2 * st + 1) * BN * S);
        if constexpr (RM == 1) {
          const bool masked = kb + BN - 1 > pmin[0] || (window > 0 && kb + window <= pmax[0]);
          warp_attend<D, BN, QREG>(qa[0], q_addr, k_addr, v_addr, kb, pos_lo[0], pos_hi[0], window, masked,
                                   scale_log2, m[0], l[0], o[0]);
        } else {
          bool masked[RM];
#pragma unroll
          for (int r = 0; r < RM; ++r) masked[r] = kb + BN - 1 > pmin[r] || (window > 0 && kb + window <= pmax[r]);
          warp_attend_rm<D, BN, QREG, RM>(qa, q_addr, k_addr, v_addr, kb, pos_lo, pos_hi, window, masked, scale_log2,
                                          m, l, o);
        }
      }
    }
    cp_async_wait<0>();
    __syncthreads();  // all stages consumed before the next pass refills them
  }
  pdl_launch_dependents();  // the next kernel may be scheduled (it still waits for our completion)

  // Epilogue per m-tile: full row sums, normalize, stage its 16 rows in its own sQ rows, 16-byte stores.
  const int g = lane >> 2, q4 = lane & 3;
#pragma unroll
  for (int r = 0; r < RM; ++r) {
    l[r][0] += __shfl_xor_sync(0xffffffffu, l[r][0], 1);
    l[r][0] += __shfl_xor_sync(0xffffffffu, l[r][0], 2);
    l[r][1] += __shfl_xor_sync(0xffffffffu, l[r][1], 1);
    l[r][1] += __shfl_xor_sync(0xffffffffu, l[r][1], 2);
    const float inv0 = l[r][0] > 0.f ? 1.f / l[r][0] : 0.f, inv1 = l[r][1] > 0.f ? 1.f / l[r][1] : 0.f;
    __half* sO = sQ + (warp * RM + r) * 16 * S;
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn) {
      *reinterpret_cast<__half2*>(sO + g * S + dn * 8 + 2 * q4) =
          __floats2half2_rn(o[r][dn][0] * inv0, o[r][dn][1] * inv0);
      *reinterpret_cast<__half2*>(sO + (g + 8) * S + dn * 8 + 2 * q4) =
          __floats2half2_rn(o[r][dn][2] * inv1, o[r][dn][3] * inv1);
    }
  }
  __syncwarp();
#pragma unroll
  for (int idx = lane; idx < 16 * RM * CPR; idx += 32) {
    const int r = idx / CPR, c = idx % CPR;
    const int64_t t = t0 + warp * 16 * RM + r;
    if (t < n) {
      *reinterpret_cast<uint4*>(out + (t * n_heads + h) * D + c * 8) =
          *reinterpret_cast<const uint4*>(sQ + (warp * 16 * RM + r) * S + c * 8);
    }
  }
}

// ---- decode ------------------------------------------------------------------------------------------------

constexpr int kMaxCounters = 1 << 16;  // (row, kv head, head group) arrival counters of the split merge
constexpr int kMaxSplits = 128;

// Zero-initialized once per process and device; the last block of each row returns its counter to zero.
// Like the workspace, this assumes attention calls on one device do not run concurrently on two streams.
static __device__ unsigned int g_decode_counters[kMaxCounters];

template <int D, int BN, int STAGES>
constexpr size_t decode_smem_bytes() {
  constexpr int NW = BN / 16;
  constexpr size_t ring = size_t(16 + 2 * STAGES * BN) * (D + kPad) * sizeof(__half);
  constexpr size_t merge = size_t(NW * 16 * (D + 4) + 2 * NW * 16) * sizeof(float);
  constexpr size_t weights = size_t(16 * kMaxSplits + 32) * sizeof(float);
  return std::max(ring, std::max(merge, weights));
}

// grid (n_splits, n_heads_kv * n_groups, n); block BN / 16 warps. Block (split z, kv head hk, head group grp, row
// t): q heads h0 = hk * G + grp * 16 + [0, gcount) of row t as the 16 mma rows (unused rows zero), key tiles z,
// z + n_splits, ... of row t's sequence. Warp w takes keys [16 w, 16 w + 16) of every tile.
template <int D, int BN, int STAGES, bool QREG, bool WIN = false>
__global__ void __launch_bounds__(BN * 2)
    attention_decode_mma_kernel(const __half* __restrict__ q, const __half* __restrict__ k_pages,
                                const __half* __restrict__ v_pages, const int32_t* __restrict__ positions,
                                const int32_t* __restrict__ seq_of_token, const int32_t* __restrict__ page_table,
                                int64_t pages_per_seq, int n_heads, int n_heads_kv, int n_groups, int page_size,
                                float scale_log2, __half* __restrict__ out, float* __restrict__ part_acc,
                                float* __restrict__ part_ml, int window) {
  if constexpr (!WIN) window = 0;  // the window code folds away
  constexpr int NW = BN / 16, NT = 32 * NW, S = D + kPad, CPR = D / 8;
  static_assert(BN % 16 == 0 && STAGES >= 2, "tile config");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __half* sQ = reinterpret_cast<__half*>(smem_raw);
  __half* sKV = sQ + 16 * S;
  __shared__ int s_last;
  pdl_wait();  // cuda/pdl.cuh: before the early return below too (and q, cache, partials, counters are shared)

  const int z = blockIdx.x, n_splits = gridDim.x;
  const int hk = blockIdx.y / n_groups, grp = blockIdx.y % n_groups;
  const int64_t t = blockIdx.z;
  const int G = n_heads / n_heads_kv;
  const int h0 = hk * G + grp * 16;
  const int gcount = min(16, G - grp * 16);
  const int len = positions[t] + 1;
  const int tile0 = WIN && window > 0 ? max(0, len - window) / BN : 0;  // the first tile of the row's window
  const int n_tiles = (len + BN - 1) / BN - tile0;
  if (z >= n_tiles) return;  // block-uniform: no keys for this split
  const int n_valid = min(n_splits, n_tiles);
  const int my_tiles = (n_tiles - z + n_splits - 1) / n_splits;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int32_t* seq_pages = page_table + int64_t(seq_of_token[t]) * pages_per_seq;

  for (int idx = threadIdx.x; idx < 16 * CPR; idx += NT) {
    const int r = idx / CPR, c = idx % CPR;
    const bool valid = r < gcount;
    cp_async16(smem_u32(sQ + r * S + c * 8), q + (valid ? (t * n_heads + h0 + r) * D + c * 8 : 0), valid);
  }
  cp_async_commit();
#pragma unroll
  for (int st = 0; st < STAGES - 1; ++st) {
    if (st < my_tiles) {
      load_kv_tile<D, BN, NT>(sKV + 2 * st * BN * S, sKV + (2 * st + 1) * BN * S, k_pages, v_pages, seq_pages,
                              (tile0 + z + st * n_splits) * BN, len, page_size, n_heads_kv, hk);
    }
    cp_async_commit();
  }

  uint32_t qa[D / 16][4];
  const uint32_t q_addr = q_lane_addr<D>(sQ);
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  float o[D / 8][4];
#pragma unroll
  for (int dn = 0; dn < D / 8; ++dn) o[dn][0] = o[dn][1] = o[dn][2] = o[dn][3] = 0.f;
  const int pos = len - 1;

  for (int i = 0; i < my_tiles; ++i) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    {
      const int nx = i + STAGES - 1;
      if (nx < my_tiles) {
        const int st = nx % STAGES;
        load_kv_tile<D, BN, NT>(sKV + 2 * st * BN * S, sKV + (2 * st + 1) * BN * S, k_pages, v_pages, seq_pages,
                                (tile0 + z + nx * n_splits) * BN, len, page_size, n_heads_kv, hk);
      }
      cp_async_commit();
    }
    if constexpr (QREG) {
      if (i == 0) {
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) ldsm_x4(q_addr + kk * 32, qa[kk]);
      }
    }
    const int kb = (tile0 + z + i * n_splits) * BN + warp * 16;
    if (kb <= pos && (window == 0 || kb + 15 + window > pos)) {  // warp-uniform: a key of the window
      const int st = i % STAGES;
      warp_attend<D, 16, QREG>(qa, q_addr, smem_u32(sKV + (2 * st * BN + warp * 16) * S),
                               smem_u32(sKV + ((2 * st + 1) * BN + warp * 16) * S), kb, pos, pos, window,
                               kb + 15 > pos || (window > 0 && kb + window <= pos), scale_log2, m, l, o);
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the ring is free: reuse it for the warp merge
  pdl_launch_dependents();  // e.g. the o projection's GEMV starts prefetching its weights

  // Merge the warps: sm_o [NW][16][D + 4], sm_m / sm_l [NW][16].
  float* sm_o = reinterpret_cast<float*>(smem_raw);
  float* sm_m = sm_o + NW * 16 * (D + 4);
  float* sm_l = sm_m + NW * 16;
  l[0] += __shfl_xor_sync(0xffffffffu, l[0], 1);
  l[0] += __shfl_xor_sync(0xffffffffu, l[0], 2);
  l[1] += __shfl_xor_sync(0xffffffffu, l[1], 1);
  l[1] += __shfl_xor_sync(0xffffffffu, l[1], 2);
  {
    const int g = lane >> 2, q4 = lane & 3;
    float* wo = sm_o + warp * 16 * (D + 4);
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn) {
      *reinterpret_cast<float2*>(wo + g * (D + 4) + dn * 8 + 2 * q4) = make_float2(o[dn][0], o[dn][1]);
      *reinterpret_cast<float2*>(wo + (g + 8) * (D + 4) + dn * 8 + 2 * q4) = make_float2(o[dn][2], o[dn][3]);
    }
    if (q4 == 0) {
      sm_m[warp * 16 + g] = m[0];
      sm_m[warp * 16 + g + 8] = m[1];
      sm_l[warp * 16 + g] = l[0];
      sm_l[warp * 16 + g + 8] = l[1];
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < gcount * (D / 4); idx += NT) {
    const int r = idx / (D / 4), d = (idx % (D / 4)) * 4;
    float mm = -INFINITY;
#pragma unroll
    for (int w = 0; w < NW; ++w) mm = fmaxf(mm, sm_m[w * 16 + r]);
    float ll = 0.f;
    float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      const float c = sm_m[w * 16 + r] == -INFINITY ? 0.f : fast_exp2(sm_m[w * 16 + r] - mm);
      ll = fmaf(sm_l[w * 16 + r], c, ll);
      const float4 x = *reinterpret_cast<const float4*>(sm_o + (w * 16 + r) * (D + 4) + d);
      a.x = fmaf(x.x, c, a.x);
      a.y = fmaf(x.y, c, a.y);
      a.z = fmaf(x.z, c, a.z);
      a.w = fmaf(x.w, c, a.w);
    }
    const int64_t row = t * n_heads + h0 + r;  // [n, n_heads] row of q / out
    if (n_valid == 1) {
      const float inv = 1.f / ll;
      __half2* o2 = reinterpret_cast<__half2*>(out + row * D + d);
      o2[0] = __floats2half2_rn(a.x * inv, a.y * inv);
      o2[1] = __floats2half2_rn(a.z * inv, a.w * inv);
    } else {
      const int64_t p = row * n_splits + z;
      *reinterpret_cast<float4*>(part_acc + p * D + d) = a;
      if (d == 0) *reinterpret_cast<float2*>(part_ml + 2 * p) = make_float2(mm, ll);
    }
  }
  if (n_valid == 1) return;

  // Split merge by the last block of (row, kv head, group) to arrive.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned int* ctr = g_decode_counters + (t * gridDim.y + blockIdx.y);
    const unsigned int prev = atomicAdd(ctr, 1u);
    s_last = prev == unsigned(n_valid - 1);
    if (s_last) *ctr = 0u;  // ready for the next launch (stream order)
  }
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  float* sw = reinterpret_cast<float*>(smem_raw);  // [16][kMaxSplits] weights exp2(m_s - M) / L
  for (int r = warp; r < gcount; r += NW) {
    const int64_t row = t * n_heads + h0 + r;
    float mm = -INFINITY;
    for (int s = lane; s < n_valid; s += 32) mm = fmaxf(mm, __ldcg(part_ml + 2 * (row * n_splits + s)));
    mm = warp_max(mm);
    float ll = 0.f;
    for (int s = lane; s < n_valid; s += 32) {
      const float2 ml = __ldcg(reinterpret_cast<const float2*>(part_ml + 2 * (row * n_splits + s)));
      const float w = fast_exp2(ml.x - mm);
      sw[r * kMaxSplits + s] = w;
      ll = fmaf(ml.y, w, ll);
    }
    ll = warp_sum(ll);
    const float inv = 1.f / ll;
    __syncwarp();
    for (int s = lane; s < n_valid; s += 32) sw[r * kMaxSplits + s] *= inv;
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < gcount * (D / 4); idx += NT) {
    const int r = idx / (D / 4), d = (idx % (D / 4)) * 4;
    const int64_t row = t * n_heads + h0 + r;
    const float4* src = reinterpret_cast<const float4*>(part_acc + row * n_splits * D + d);
    float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
    for (int s = 0; s < n_valid; ++s) {
      const float4 x = __ldcg(src + s * (D / 4));
      const float w = sw[r * kMaxSplits + s];
      a.x = fmaf(x.x, w, a.x);
      a.y = fmaf(x.y, w, a.y);
      a.z = fmaf(x.z, w, a.z);
      a.w = fmaf(x.w, w, a.w);
    }
    __half2* o2 = reinterpret_cast<__half2*>(out + row * D + d);
    o2[0] = __floats2half2_rn(a.x, a.y);
    o2[1] = __floats2half2_rn(a.z, a.w);
  }
}

// ---- launchers ---------------------------------------------------------------------------------------------

// Whether a kernel's dynamic + static shared memory fits this device's opt-in limit (cached per device):
// consumer cards (sm_86/89/120) allow 99 KiB per block, A100 163 KiB, H100/H200 227 KiB.
// Per-(kernel, device) memo: kernels of different tile sizes share one C++ type, so a static inside these
// templates must be keyed by the kernel's address, not shared by the type.
template <typename T, typename K>
T memo_per_kernel(K kernel, int dev, size_t extra, const std::function<T()>& compute) {
  static std::mutex mu;
  static std::map<std::tuple<const void*, int, size_t>, T> memo;
  const auto key = std::make_tuple(reinterpret_cast<const void*>(kernel), dev, extra);
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = memo.find(key);
    if (it != memo.end()) return it->second;
  }
  const T value = compute();
  std::lock_guard<std::mutex> lock(mu);
  memo[key] = value;
  return value;
}

template <typename K>
bool smem_fits(K kernel, size_t smem) {
  int dev = 0;
  EXL2_CUDA_CHECK(cudaGetDevice(&dev));
  return memo_per_kernel<bool>(kernel, dev, smem, [&] {
    cudaFuncAttributes attr{};
    EXL2_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
    return smem + attr.sharedSizeBytes <= max_smem_per_block_optin();
  });
}

// Raise a kernel's dynamic shared memory limit once per device (needed above 48 KiB).
template <typename K>
void ensure_smem(K kernel, size_t smem, const char* what) {
  if (smem <= 48 * 1024) return;
  EXL2_CHECK_KIND(Unsupported, smem_fits(kernel, smem), "CUDA attention ", what, ": needs ", smem,
                  " bytes of dynamic shared memory per block, this GPU allows ", max_smem_per_block_optin(),
                  " in all; set option cuda_reference to use the reference kernel");
  // Keyed by the kernel's address: instantiations with other tile sizes share K's type, so a static in this
  // template alone would raise the limit of only the first kernel launched.
  static std::mutex mu;
  static std::map<const void*, uint64_t> raised;  // kernel -> bit per device index < 64
  int dev = 0;
  EXL2_CUDA_CHECK(cudaGetDevice(&dev));
  const uint64_t bit = dev < 64 ? uint64_t(1) << dev : 0;
  std::lock_guard<std::mutex> lock(mu);
  uint64_t& mask = raised[reinterpret_cast<const void*>(kernel)];
  if (!bit || !(mask & bit)) {
    EXL2_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    mask |= bit;
  }
}

// Resident blocks per SM of a kernel (cached per device).
template <typename K>
int blocks_per_sm(K kernel, int threads, size_t smem) {
  int dev = 0;
  EXL2_CUDA_CHECK(cudaGetDevice(&dev));
  return memo_per_kernel<int>(kernel, dev, smem * 4096 + static_cast<size_t>(threads), [&] {
    int b = 0;
    EXL2_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, kernel, threads, smem));
    return std::max(b, 1);
  });
}

template <int D, int NW, int BN, int STAGES, bool QREG, int RM = 1>
void launch_prefill_mma(const __half* q, const __half* k_pages, const __half* v_pages, const int32_t* positions,
                        const int32_t* seq_of_token, const int32_t* page_table, int64_t pages_per_seq, int64_t n,
                        int64_t n_heads, int64_t n_heads_kv, int64_t page_size, float scale, __half* out,
                        int64_t window = 0) {
  constexpr size_t smem = prefill_smem_bytes<D, NW, BN, STAGES, RM>();
  auto kernel = window > 0 ? attention_prefill_mma_kernel<D, NW, BN, STAGES, QREG, RM, true>
                           : attention_prefill_mma_kernel<D, NW, BN, STAGES, QREG, RM>;
  ensure_smem(kernel, smem, "prefill");
  const dim3 grid(static_cast<unsigned>(n_heads), static_cast<unsigned>(ceil_div(n, 16 * NW * RM)));
  EXL2_CUDA_LAUNCH_PDL("attention_prefill_mma_kernel", kernel, grid, NW * 32, smem, current_stream(), q, k_pages,
                       v_pages, positions, seq_of_token, page_table, pages_per_seq, n, static_cast<int>(n_heads),
                       static_cast<int>(n_heads_kv), static_cast<int>(page_size), scale * kLog2e, out,
                       static_cast<int>(window));
}

// Splits: one wave of resident blocks over the row's longest possible context (pages_per_seq * page_size),
// each split taking the same number of tiles; forced_splits > 0 overrides (benchmarks). Many rows fill the GPU
// by themselves (n * KV head groups >= one wave): one split, no merge. Rows go in launches of at most
// kMaxCounters / (KV head groups) and 65535 (grid z) rows, one after the other on the stream (the arrival
// counters and the partials' workspace are reused in stream order).
template <int D, int BN, int STAGES, bool QREG>
void launch_decode_mma(const __half* q, const __half* k_pages, const __half* v_pages, const int32_t* positions,
                       const int32_t* seq_of_token, const int32_t* page_table, int64_t pages_per_seq, int64_t n,
                       int64_t n_heads, int64_t n_heads_kv, int64_t page_size, float scale, __half* out,
                       int forced_splits = 0, int64_t window = 0) {
  constexpr size_t smem = decode_smem_bytes<D, BN, STAGES>();
  constexpr int threads = BN * 2;
  auto kernel = window > 0 ? attention_decode_mma_kernel<D, BN, STAGES, QREG, true>
                           : attention_decode_mma_kernel<D, BN, STAGES, QREG>;
  ensure_smem(kernel, smem, "decode");
  const int64_t G = n_heads / n_heads_kv;
  const int64_t n_groups = ceil_div(G, 16);
  const int64_t groups = n_heads_kv * n_groups;  // blocks per row and split
  EXL2_CHECK_KIND(Unsupported, groups <= 65535 && groups <= kMaxCounters, "CUDA attention decode: ", groups,
                  " KV head groups exceed the kernel's grid; set option cuda_reference");
  const int64_t chunk = std::min<int64_t>({n, 65535, kMaxCounters / groups});  // rows per launch
  int64_t max_tiles = std::max<int64_t>(1, ceil_div(pages_per_seq * page_size, BN));
  if (window > 0) max_tiles = std::min(max_tiles, ceil_div(window, BN) + 1);  // a window spans at most this many
  int64_t n_splits;
  if (forced_splits > 0) {
    n_splits = forced_splits;
  } else {
    const int64_t wave = int64_t(blocks_per_sm(kernel, threads, smem)) * sm_count();
    const int64_t want = std::max<int64_t>(1, wave / (n * groups));
    const int64_t per = ceil_div(max_tiles, want);  // tiles per split
    n_splits = ceil_div(max_tiles, per);
  }
  n_splits = std::clamp<int64_t>(n_splits, 1, std::min<int64_t>(max_tiles, kMaxSplits));
  float* part_acc = nullptr;
  float* part_ml = nullptr;
  if (n_splits > 1) {
    const int64_t parts = chunk * n_heads * n_splits;
    float* ws = static_cast<float*>(workspace(size_t(parts) * (D + 2) * sizeof(float)));
    part_acc = ws;
    part_ml = ws + parts * D;
  }
  for (int64_t r0 = 0; r0 < n; r0 += chunk) {
    const int64_t rows = std::min(chunk, n - r0), off = r0 * n_heads * D;
    const dim3 grid(static_cast<unsigned>(n_splits), static_cast<unsigned>(groups), static_cast<unsigned>(rows));
    EXL2_CUDA_LAUNCH_PDL("attention_decode_mma_kernel", kernel, grid, threads, smem, current_stream(), q + off,
                         k_pages, v_pages, positions + r0, seq_of_token + r0, page_table, pages_per_seq,
                         static_cast<int>(n_heads), static_cast<int>(n_heads_kv), static_cast<int>(n_groups),
                         static_cast<int>(page_size), scale * kLog2e, out + off, part_acc, part_ml,
                         static_cast<int>(window));
  }
}

}  // namespace exl2::cuda::attn
