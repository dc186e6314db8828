// The tensor-core EXL2 GEMV kernel (1 to 16 rows of x), device code only; launch setup and the tiled layout it
// reads (built at load by exl2_upload) live in cuda/exl2_gemm.cu, the layout's contract in cuda/exl2_gemm.h.
//
// Work: a block owns kTcCols output columns and a range of quads (4 units of equal bit width, cuda/exl2_gemm.h);
// each of its 8 warps owns kTcTiles tiles of 8 columns (the mma n) over all of the block's quads. Lane (g = lane / 4, j = lane % 4) decodes unit j of a quad for
// column g of the tile into exact f16 weights (as the CPU reference) and feeds them as the B operand of
// mma.m16n8k16 (f16 in, fp32 accumulate): pair P of the unit (rows a, b) is B[k = 2j, 2j+1] of step P / 2 when
// P is even, B[k = 2j+8, 2j+9] when odd. x is staged once per block in shared memory in that same "consumption
// order" (xsrc gives the input feature of every slot, -1 for padding), so the A fragment of a step is one 8-byte
// shared load per lane: rows g (and g + 8 for more than 8 rows of x) of the mma are rows of x. Blocks that split
// k meet in the fp32 accumulator (atomics, the last block writes y).
#pragma once

#include "cuda/common.cuh"
#include "cuda/exl2_decode.cuh"
#include "cuda/pdl.cuh"

namespace exl2::cuda::exl2k {

constexpr int kTcWarps = 8;
constexpr int kTcThreads = kTcWarps * 32;
constexpr int kTcTiles = 2;  // tiles of 8 columns per warp (one A fragment feeds kTcTiles mmas)
constexpr int kTcCols = kTcWarps * kTcTiles * 8;  // columns per block

// Slots of the tiled unit table are read with unit_info (cuda/exl2_decode.cuh): same encoding, nwords 0; a slot
// with nvals == 0 is padding (nothing stored or read).

// What a lane holds of one quad: its unit's words for its column, the group's scale word and msc.
template <int MAXW>
struct TcLoad {
  uint32_t w[MAXW];
  uint32_t sc;
  __half msc;
  int bits;
};

template <int MAXW>
__device__ __forceinline__ void tc_load(const uint32_t* __restrict__ tile_w, const uint32_t* __restrict__ q_scale,
                                        const __half* __restrict__ msc, const UnitInfo& U, int g, int64_t scale_ld,
                                        int tile, TcLoad<MAXW>& d) {
  d.bits = U.bits;
#pragma unroll
  for (int i = 0; i < MAXW; ++i) d.w[i] = 0u;
  d.sc = 0u;
  d.msc = __ushort_as_half(0);
  if (U.nvals == 0) return;
  const uint32_t* p = tile_w + U.woff + g * U.bits;
  if (U.bits == 4) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
    d.w[0] = v.x, d.w[1] = v.y, d.w[2] = v.z, d.w[3] = v.w;
  } else if (U.bits == 2) {
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
    d.w[0] = v.x, d.w[1] = v.y;
  } else if (U.bits == 3) {
    d.w[0] = __ldg(p), d.w[1] = __ldg(p + 1), d.w[2] = __ldg(p + 2);
  } else if constexpr (MAXW == 8) {
    if (U.bits == 8) {
      const uint4 v0 = __ldg(reinterpret_cast<const uint4*>(p)), v1 = __ldg(reinterpret_cast<const uint4*>(p) + 1);
      d.w[0] = v0.x, d.w[1] = v0.y, d.w[2] = v0.z, d.w[3] = v0.w;
      d.w[4] = v1.x, d.w[5] = v1.y, d.w[6] = v1.z, d.w[7] = v1.w;
    } else if (U.bits == 6) {
      const uint2* p2 = reinterpret_cast<const uint2*>(p);
      const uint2 v0 = __ldg(p2), v1 = __ldg(p2 + 1), v2 = __ldg(p2 + 2);
      d.w[0] = v0.x, d.w[1] = v0.y, d.w[2] = v1.x, d.w[3] = v1.y, d.w[4] = v2.x, d.w[5] = v2.y;
    } else {  // 5
#pragma unroll
      for (int i = 0; i < 5; ++i) d.w[i] = __ldg(p + i);
    }
  }
  d.sc = __ldg(q_scale + int64_t(U.group) * scale_ld + tile);
  d.msc = msc[U.group];
}

// raw[P] = half2 bits (1024 + code a, 1024 + code b) of pair P of a lane's unit: the only width-specific code, kept
// small because the decode of every width sits in the kernel's loop (instruction-cache footprint).
template <int B, int MAXW, int... P>
__device__ __forceinline__ void tc_raw(const TcLoad<MAXW>& d, uint32_t (&raw)[16], std::integer_sequence<int, P...>) {
  uint32_t w[B];
#pragma unroll
  for (int i = 0; i < B; ++i) w[i] = d.w[i];
  ((raw[P] = pair_bits<B, P>(w)), ...);
}

template <int MAXW>
__device__ __forceinline__ void tc_raw_any(int bits, const TcLoad<MAXW>& d, uint32_t (&raw)[16]) {
  constexpr auto pairs = std::make_integer_sequence<int, 16>{};
  switch (bits) {
    case 2: tc_raw<2>(d, raw, pairs); break;
    case 3: tc_raw<3>(d, raw, pairs); break;
    case 4: tc_raw<4>(d, raw, pairs); break;
    default:
      if constexpr (MAXW == 8) {
        if (bits == 5) tc_raw<5>(d, raw, pairs);
        else if (bits == 6) tc_raw<6>(d, raw, pairs);
        else tc_raw<8>(d, raw, pairs);
      }
      break;
  }
}

// One quad for the warp's kTcTiles tiles: decode (exact f16 weights, as col_pair) and 8 mma steps per tile; the A
// fragment of step T (pairs 2T, 2T+1) is one 8-byte shared load (xa: row g, xb: row g + 8).
template <bool M16, int MAXW>
__device__ __forceinline__ void tc_quad(const TcLoad<MAXW> (&d)[kTcTiles], int g, const uint32_t* xa,
                                        const uint32_t* xb, float (&c)[kTcTiles][4]) {
  const int bits = d[0].bits;  // the same for the quad's 4 units: the switch never splits the warp
  const __half2 zb = __float2half2_rn(1024.f + float(1 << (bits - 1)));  // 1024 + zero point, exact
  uint32_t raw[kTcTiles][16];
  __half2 s2[kTcTiles];
#pragma unroll
  for (int t = 0; t < kTcTiles; ++t) {
    tc_raw_any<MAXW>(bits, d[t], raw[t]);
    s2[t] = col_scale(d[t].sc, g, d[t].msc);
  }
#pragma unroll
  for (int T = 0; T < 8; ++T) {
    const uint2 lo = *reinterpret_cast<const uint2*>(xa + T * 8);
    uint2 hi = make_uint2(0u, 0u);
    if constexpr (M16) hi = *reinterpret_cast<const uint2*>(xb + T * 8);
    const uint32_t a[4] = {lo.x, hi.x, lo.y, hi.y};
#pragma unroll
    for (int t = 0; t < kTcTiles; ++t) {
      const uint32_t b0 = h2_bits(__hmul2_rn(__hsub2(as_half2(raw[t][2 * T]), zb), s2[t]));
      const uint32_t b1 = h2_bits(__hmul2_rn(__hsub2(as_half2(raw[t][2 * T + 1]), zb), s2[t]));
      mma16816(c[t], a, b0, b1);
    }
  }
}

// grid (column blocks of kTcCols, k slices of qpb quads). Warp w owns the kTcTiles tiles of 8 columns from
// blockIdx.x * kTcCols + w * 8 * kTcTiles on, over the block's quads, so the x staged by the block serves all of
// its columns. Dynamic shared memory: m rows of x, (qpb * 64 + 8) words each. MAXW: 4 when every unit has at most
// 4 bits, else 8. M16: m > 8. One k slice: y written directly; more: fp32 atomics into acc, the last block of the
// column block writes y and clears acc and its counter.
template <int MAXW, bool M16>
__global__ void __launch_bounds__(kTcThreads)
    exl2_gemv_tc_kernel(const __half* __restrict__ x, int64_t in, int m, const uint32_t* __restrict__ qw,
                        int64_t tile_stride, const uint32_t* __restrict__ q_scale, const __half* __restrict__ msc,
                        const int4* __restrict__ slots, const int32_t* __restrict__ xsrc, int n_quads, int qpb,
                        const float* __restrict__ bias, __half* __restrict__ y, int64_t out, int64_t out_pad,
                        float* __restrict__ acc, unsigned* __restrict__ counters) {
  extern __shared__ uint32_t xs[];

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, j = lane & 3;
  const int64_t n_tiles = out_pad / 8;
  const int64_t tile0 = int64_t(blockIdx.x) * (kTcCols / 8) + warp * kTcTiles;  // this warp's first tile
  const int qb0 = blockIdx.y * qpb, qb1 = min(qb0 + qpb, n_quads);
  const int64_t scale_ld = out_pad / 8;
  const int S = qpb * 64 + 8;  // words per staged row: rows g = 0..3 of a half-warp land 8 banks apart
  const uint32_t* tile_w[kTcTiles];
  bool has[kTcTiles];
#pragma unroll
  for (int t = 0; t < kTcTiles; ++t) {
    has[t] = tile0 + t < n_tiles;
    tile_w[t] = qw + (has[t] ? tile0 + t : 0) * tile_stride;
  }

  // The first quad's weights are in flight while x is staged; slot entries are fetched one quad ahead of the
  // weights they locate, so each quad's loads wait on DRAM only.
  const UnitInfo empty{};
  UnitInfo s0 = qb0 < qb1 ? unit_info(slots, 4 * qb0 + j) : empty;
  UnitInfo s1 = qb0 + 1 < qb1 ? unit_info(slots, 4 * (qb0 + 1) + j) : empty;
  TcLoad<MAXW> cur[kTcTiles];
#pragma unroll
  for (int t = 0; t < kTcTiles; ++t)
    if (qb0 < qb1 && has[t]) tc_load<MAXW>(tile_w[t], q_scale, msc, s0, g, scale_ld, int(tile0 + t), cur[t]);
  // Programmatic dependent launch (cuda/pdl.cuh): only the layer's constant tables and weights are read above; x,
  // acc and counters may still be in use by the previous kernel until this returns.
  pdl_wait();

  // xs[i][e / 2] = (x[i, xsrc[e]], x[i, xsrc[e + 1]]) for the block's quads, 0 where xsrc < 0.
  const int words = (qb1 - qb0) * 64;
  const int2* src = reinterpret_cast<const int2*>(xsrc) + int64_t(qb0) * 64;
  for (int e = threadIdx.x; e < m * words; e += kTcThreads) {
    const int i = e / words, k = e - i * words;
    const int2 sv = __ldg(src + k);
    const __half* xr = x + int64_t(i) * in;
    const __half lo = sv.x >= 0 ? xr[sv.x] : __ushort_as_half(0);
    const __half hi = sv.y >= 0 ? xr[sv.y] : __ushort_as_half(0);
    xs[i * S + k] = h2_bits(__halves2half2(lo, hi));
  }
  __syncthreads();

  float c[kTcTiles][4] = {};
  const uint32_t* xa = xs + min(g, m - 1) * S + j * 2;
  const uint32_t* xb = xs + min(g + 8, m - 1) * S + j * 2;
  if (has[0]) {  // warp-uniform: mma.sync needs every lane
#pragma unroll 1
    for (int q = qb0; q < qb1; ++q) {
      TcLoad<MAXW> nxt[kTcTiles];
      const UnitInfo s2 = q + 2 < qb1 ? unit_info(slots, 4 * (q + 2) + j) : empty;
#pragma unroll
      for (int t = 0; t < kTcTiles; ++t)
        if (q + 1 < qb1 && has[t]) tc_load<MAXW>(tile_w[t], q_scale, msc, s1, g, scale_ld, int(tile0 + t), nxt[t]);
      s1 = s2;
      const int ql = q - qb0;
      tc_quad<M16, MAXW>(cur, g, xa + ql * 64, xb + ql * 64, c);
#pragma unroll
      for (int t = 0; t < kTcTiles; ++t) cur[t] = nxt[t];
    }
  }
  pdl_launch_dependents();  // every thread, after the main loop: the next kernel may be scheduled

  // c[t][0], c[t][1]: row g, columns 2j, 2j+1 of tile tile0 + t; c[t][2], c[t][3]: row g + 8.
  if (gridDim.y == 1) {
#pragma unroll
    for (int t = 0; t < kTcTiles; ++t) {
#pragma unroll
      for (int h = 0; h < (M16 ? 2 : 1); ++h) {
        const int r = g + 8 * h;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int64_t col = (tile0 + t) * 8 + 2 * j + e;
          if (r < m && col < out) y[int64_t(r) * out + col] = __float2half_rn(c[t][2 * h + e] + (bias ? bias[col] : 0.f));
        }
      }
    }
    return;
  }
#pragma unroll
  for (int t = 0; t < kTcTiles; ++t) {
#pragma unroll
    for (int h = 0; h < (M16 ? 2 : 1); ++h) {
      const int r = g + 8 * h;
      const int64_t col = (tile0 + t) * 8 + 2 * j;
      if (r < m && has[t]) {
        atomicAdd(acc + int64_t(r) * out_pad + col, c[t][2 * h]);
        atomicAdd(acc + int64_t(r) * out_pad + col + 1, c[t][2 * h + 1]);
      }
    }
  }
  if (!split_k_last(counters)) return;
  split_k_drain<kTcCols, kTcThreads>(acc, counters, m, int64_t(blockIdx.x) * kTcCols, out, out_pad, bias, y);
}

}  // namespace exl2::cuda::exl2k
