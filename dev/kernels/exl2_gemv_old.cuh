// Copy of the library's EXL2 GEMV at 6593177 (cuda/exl2_gemm.cu + cuda/exl2_decode.cuh), the 'before' of dev/kernels/exl2_gemv_bench.cu.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <utility>

#undef EXL2_HD
#define EXL2_HD __host__ __device__ __forceinline__

namespace exl2_old {

EXL2_HD uint32_t funnel_r(uint32_t lo, uint32_t hi, int sh) {
#ifdef __CUDA_ARCH__
  return __funnelshift_r(lo, hi, sh);
#else
  return static_cast<uint32_t>(((uint64_t(hi) << 32) | lo) >> (sh & 31));
#endif
}

EXL2_HD uint4 ld_u4(const uint32_t* p) {
#ifdef __CUDA_ARCH__
  return __ldg(reinterpret_cast<const uint4*>(p));
#else
  return *reinterpret_cast<const uint4*>(p);
#endif
}

EXL2_HD uint32_t ld_u32(const uint32_t* p) {
#ifdef __CUDA_ARCH__
  return __ldg(p);
#else
  return *p;
#endif
}

// ---- decoding -------------------------------------------------------------------------------------------------

EXL2_HD __half2 as_half2(uint32_t u) {
  __half2 h;
  memcpy(&h, &u, sizeof(h));
  return h;
}

// Code of value V (0..31) of a unit from one column's B words (bit V*B of the little-endian stream).
template <int B, int V>
EXL2_HD uint32_t unit_code(const uint32_t (&w)[B]) {
  constexpr int bit = V * B, i = bit / 32, sh = bit % 32;
  constexpr uint32_t mask = (1u << B) - 1u;
  if constexpr (sh + B <= 32) {
    return (w[i] >> sh) & mask;
  } else {
    return funnel_r(w[i], w[i + 1], sh) & mask;
  }
}

// Pair P (0..15) of a unit: values a (low half) and b (high half). For 2/4/8 bits b sits 16 bits above a in
// the same word; for 3/5/6 bits the pairs are (2P, 2P+1).
template <int B, int P>
struct PairIdx {
  static constexpr int a = B == 2   ? 16 * (P / 8) + P % 8
                           : B == 4 ? 8 * (P / 4) + P % 4
                           : B == 8 ? 4 * (P / 2) + P % 2
                                    : 2 * P;
  static constexpr int b = B == 2 ? a + 8 : B == 4 ? a + 4 : B == 8 ? a + 2 : a + 1;
};

// half2 bits (1024 + code_a, 1024 + code_b).
template <int B, int P>
EXL2_HD uint32_t pair_bits(const uint32_t (&w)[B]) {
  constexpr int a = PairIdx<B, P>::a, b = PairIdx<B, P>::b;
  if constexpr (B == 2 || B == 4 || B == 8) {
    constexpr int bit = a * B, i = bit / 32, sh = bit % 32;
    static_assert(b * B == bit + 16 && sh + 16 + B <= 32, "pair must sit 16 bits apart in one word");
    constexpr uint32_t mask = ((1u << B) - 1u) * 0x10001u;
    return ((w[i] >> sh) & mask) | 0x64006400u;
  } else {
    return unit_code<B, a>(w) | (unit_code<B, b>(w) << 16) | 0x64006400u;
  }
}

template <int B, int P, typename F>
EXL2_HD void decode_pair(const uint32_t (&w)[4][B], const __half2 (&s2)[4], F& f) {
  const __half2 zb = __float2half2_rn(1024.f + float(1 << (B - 1)));  // 1024 + zero point, exact
  __half2 w2[4];
#pragma unroll
  for (int c = 0; c < 4; ++c) w2[c] = __hmul2_rn(__hsub2(as_half2(pair_bits<B, P>(w[c])), zb), s2[c]);
  f(PairIdx<B, P>::a, PairIdx<B, P>::b, w2);
}

template <int B, typename F, int... P>
EXL2_HD void decode_pairs(const uint32_t (&w)[4][B], const __half2 (&s2)[4], F& f, std::integer_sequence<int, P...>) {
  (decode_pair<B, P>(w, s2, f), ...);
}

struct UnitInfo {
  int qrow, row, group, bits, nvals, nwords;
};

EXL2_HD UnitInfo unit_info(const int4* __restrict__ units, int u) {
#ifdef __CUDA_ARCH__
  const int4 e = __ldg(units + u);
#else
  const int4 e = units[u];
#endif
  return {e.x, e.y, e.z, e.w & 0xff, (e.w >> 8) & 0xff, e.w >> 16};
}

// What a thread reads of one unit for its 4 columns: words w[i] = q_weight row qrow+i (x..w = columns col..col+3;
// rows i >= nwords are not read and hold 0), the group's scale word (nibbles of col..col+3 in bits 0..15) and msc.
// Loading is separate from decoding so the kernel can fetch the next unit while it decodes this one.
struct UnitData {
  uint4 w[8];
  uint32_t scale_word;
  __half msc;
};

EXL2_HD void load_unit(const UnitInfo& U, const uint32_t* __restrict__ q_weight, const uint32_t* __restrict__ q_scale,
                       const __half* __restrict__ msc, int64_t out_pad, int64_t col, UnitData& d) {
  const uint32_t* qw = q_weight + int64_t(U.qrow) * out_pad + col;
#pragma unroll
  for (int i = 0; i < 8; ++i) d.w[i] = i < U.nwords ? ld_u4(qw + i * out_pad) : make_uint4(0u, 0u, 0u, 0u);
  d.scale_word = ld_u32(q_scale + int64_t(U.group) * (out_pad / 8) + col / 8) >> (4 * (col % 8));
  d.msc = msc[U.group];
}

// Scales of the 4 columns: s = f16((nib+1)^2 * msc[g]), one rounding (exact product, then round to nearest even).
EXL2_HD void unit_scales(const UnitData& d, __half2 (&s2)[4]) {
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const int nib = (d.scale_word >> (4 * c)) & 15;
    s2[c] = __half2half2(__hmul_rn(__float2half_rn(float((nib + 1) * (nib + 1))), d.msc));
  }
}

// Calls f(a, b, w2[4]) for the 16 value pairs of a loaded B-bit unit: w2[c] = (W[row+a][col+c], W[row+b][col+c])
// as f16. Values past the unit's end (nvals) decode to garbage that the caller must ignore.
template <int B, typename F>
EXL2_HD void decode_unit(const UnitData& d, F& f) {
  uint32_t w[4][B];
#pragma unroll
  for (int i = 0; i < B; ++i) {
    w[0][i] = d.w[i].x;
    w[1][i] = d.w[i].y;
    w[2][i] = d.w[i].z;
    w[3][i] = d.w[i].w;
  }
  __half2 s2[4];
  unit_scales(d, s2);
  decode_pairs<B>(w, s2, f, std::make_integer_sequence<int, 16>{});
}

template <typename F>
EXL2_HD void decode_unit_any(int bits, const UnitData& d, F& f) {
  switch (bits) {
    case 8:
      decode_unit<8>(d, f);
      break;
    case 6:
      decode_unit<6>(d, f);
      break;
    case 5:
      decode_unit<5>(d, f);
      break;
    case 4:
      decode_unit<4>(d, f);
      break;
    case 3:
      decode_unit<3>(d, f);
      break;
    case 2:
      decode_unit<2>(d, f);
      break;
    default:
      break;  // validated on the host
  }
}

// ---- consumers of decode_unit ----------------------------------------------------------------------------

template <int M>
EXL2_HD void load_row(const float* p, float (&r)[M]) {
  if constexpr (M % 4 == 0) {
#pragma unroll
    for (int i = 0; i < M; i += 4) {
      const float4 v = *reinterpret_cast<const float4*>(p + i);
      r[i] = v.x;
      r[i + 1] = v.y;
      r[i + 2] = v.z;
      r[i + 3] = v.w;
    }
  } else if constexpr (M == 2) {
    const float2 v = *reinterpret_cast<const float2*>(p);
    r[0] = v.x;
    r[1] = v.y;
  } else {
#pragma unroll
    for (int i = 0; i < M; ++i) r[i] = p[i];
  }
}

// acc[c][i] += W[row+v][col+c] * xs[v][i] over a unit; xu = the unit's staged x, [32][M] fp32.
template <int M>
struct GemvAcc {
  float acc[4][M];
  const float* xu;

  EXL2_HD void operator()(int a, int b, const __half2 (&w2)[4]) {
    float xa[M], xb[M];
    load_row<M>(xu + a * M, xa);
    load_row<M>(xu + b * M, xb);
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const float2 f = __half22float2(w2[c]);
#pragma unroll
      for (int i = 0; i < M; ++i) {
        acc[c][i] = fmaf(f.x, xa[i], acc[c][i]);
        acc[c][i] = fmaf(f.y, xb[i], acc[c][i]);
      }
    }
  }
};

template <typename TW>
struct DequantStore;

template <>
struct DequantStore<__half> {
  __half* dst;  // W row `row` of the unit, column col
  int64_t ld;
  int nvals;
  EXL2_HD void operator()(int a, int b, const __half2 (&w2)[4]) {
    if (a < nvals) {
      const __half2 lo = __halves2half2(__low2half(w2[0]), __low2half(w2[1]));
      const __half2 hi = __halves2half2(__low2half(w2[2]), __low2half(w2[3]));
      uint2 v;
      memcpy(&v.x, &lo, 4);
      memcpy(&v.y, &hi, 4);
      *reinterpret_cast<uint2*>(dst + a * ld) = v;
    }
    if (b < nvals) {
      const __half2 lo = __halves2half2(__high2half(w2[0]), __high2half(w2[1]));
      const __half2 hi = __halves2half2(__high2half(w2[2]), __high2half(w2[3]));
      uint2 v;
      memcpy(&v.x, &lo, 4);
      memcpy(&v.y, &hi, 4);
      *reinterpret_cast<uint2*>(dst + b * ld) = v;
    }
  }
};

template <>
struct DequantStore<float> {
  float* dst;
  int64_t ld;
  int nvals;
  EXL2_HD void operator()(int a, int b, const __half2 (&w2)[4]) {
    float2 f[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) f[c] = __half22float2(w2[c]);
    if (a < nvals) *reinterpret_cast<float4*>(dst + a * ld) = make_float4(f[0].x, f[1].x, f[2].x, f[3].x);
    if (b < nvals) *reinterpret_cast<float4*>(dst + b * ld) = make_float4(f[0].y, f[1].y, f[2].y, f[3].y);
  }
};

}  // namespace exl2_old
namespace exl2_old {
constexpr int kThreads = 128;
template <int M>
__global__ void __launch_bounds__(kThreads)
    exl2_gemv_kernel(const __half* __restrict__ x, int64_t in, int m, const uint32_t* __restrict__ q_weight,
                     const uint32_t* __restrict__ q_scale, const __half* __restrict__ msc,
                     const int32_t* __restrict__ q_perm, const int4* __restrict__ units, int n_units, int ups,
                     const float* __restrict__ bias, __half* __restrict__ y, int64_t out, int64_t out_pad,
                     float* __restrict__ acc, unsigned* __restrict__ counters) {
  extern __shared__ float4 smem4[];
  float* xs = reinterpret_cast<float*>(smem4);  // [ups * 32][M]
  __shared__ bool is_last;

  const int u0 = blockIdx.y * ups;
  const int u1 = min(u0 + ups, n_units);
  const int64_t col = (int64_t(blockIdx.x) * kThreads + threadIdx.x) * 4;
  const bool active = col < out_pad;

  // Fetch the first unit's words before staging x, so the two latencies overlap.
  UnitInfo U = unit_info(units, u0);
  UnitData D;
  if (active) load_unit(U, q_weight, q_scale, msc, out_pad, col, D);

  // Stage x[i, perm[row]] (act-order applied to the input); 0 for rows past a unit's end and for i >= m.
  const int n_stage = (u1 - u0) * 32 * M;
  for (int e = threadIdx.x; e < n_stage; e += kThreads) {
    const int r = e / M, i = e % M;
    const UnitInfo S = unit_info(units, u0 + r / 32);
    const int v = r % 32;
    float val = 0.f;
    if (i < m && v < S.nvals) val = __half2float(x[int64_t(i) * in + q_perm[S.row + v]]);
    xs[e] = val;
  }
  __syncthreads();

  if (active) {
    GemvAcc<M> g;
#pragma unroll
    for (int c = 0; c < 4; ++c)
#pragma unroll
      for (int i = 0; i < M; ++i) g.acc[c][i] = 0.f;
    for (int u = u0; u < u1; ++u) {
      if (u > u0) {
        U = unit_info(units, u);
        load_unit(U, q_weight, q_scale, msc, out_pad, col, D);
      }
      g.xu = xs + (u - u0) * 32 * M;
      decode_unit_any(U.bits, D, g);
    }
#pragma unroll
    for (int i = 0; i < M; ++i) {
      if (i < m) {
        float* dst = acc + int64_t(i) * out_pad + col;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        atomicAdd(reinterpret_cast<float4*>(dst), make_float4(g.acc[0][i], g.acc[1][i], g.acc[2][i], g.acc[3][i]));
#else
#pragma unroll
        for (int c = 0; c < 4; ++c) atomicAdd(dst + c, g.acc[c][i]);
#endif
      }
    }
  }

  // The last block of this column tile (all others' sums are in acc) writes y.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) is_last = atomicAdd(&counters[blockIdx.x], 1u) == gridDim.y - 1;
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  if (active) {
    for (int i = 0; i < m; ++i) {
      float4* src = reinterpret_cast<float4*>(acc + int64_t(i) * out_pad + col);
      const float4 s = __ldcg(src);
      __stcg(src, make_float4(0.f, 0.f, 0.f, 0.f));
      const float v[4] = {s.x, s.y, s.z, s.w};
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        if (col + c < out) y[int64_t(i) * out + col + c] = __float2half_rn(v[c] + (bias ? bias[col + c] : 0.f));
      }
    }
  }
  if (threadIdx.x == 0) counters[blockIdx.x] = 0u;
}

}  // namespace exl2_old
