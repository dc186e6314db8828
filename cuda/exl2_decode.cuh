// Decoding of EXL2 units for the CUDA kernels (cuda/exl2_gemm.cu), host-callable as well so that
// dev/kernels/exl2_decode_check.cu can check it against quant::dequantize_into without a GPU.
//
// A unit (cuda/exl2_gemm.h exl2_unit_table) is 32 packed rows of one group in `bits` q_weight rows. A thread owns
// 4 adjacent columns and decodes two values at a time into one half2: the codes are OR-ed into the mantissa of
// 1024.0 (0x6400), 1024 + z is subtracted (exact), and one __hmul2_rn by the scale gives the two f16 weights,
// rounded exactly as the CPU reference. Bits 2/4/8 pair values 16 bits apart in one word (2 instructions per
// pair); 3/5/6 bits assemble each pair from two extracted codes.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <utility>

#define EXL2_HD __host__ __device__ __forceinline__

namespace exl2::cuda::exl2k {

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

EXL2_HD uint32_t h2_bits(__half2 h) {
  uint32_t u;
  memcpy(&u, &h, sizeof(u));
  return u;
}

// Scale of column c8 (0..7) of a scale word: s = f16((nib+1)^2 * msc), one rounding (exact product, then round
// to nearest even).
EXL2_HD __half2 col_scale(uint32_t scale_word, int c8, __half msc) {
  const int nib = (scale_word >> (4 * c8)) & 15;
  return __half2half2(__hmul_rn(__float2half_rn(float((nib + 1) * (nib + 1))), msc));
}

// f16 weights (W[row+a][col], W[row+b][col]) of pair P of one column's B words: the codes are OR-ed into the
// mantissa of 1024.0, 1024 + z is subtracted (exact), and one __hmul2_rn by the scale rounds as the CPU reference.
template <int B, int P>
EXL2_HD uint32_t col_pair(const uint32_t (&w)[B], __half2 s2) {
  const __half2 zb = __float2half2_rn(1024.f + float(1 << (B - 1)));
  return h2_bits(__hmul2_rn(__hsub2(as_half2(pair_bits<B, P>(w)), zb), s2));
}

template <int B, int P, typename F>
EXL2_HD void decode_pair(const uint32_t (&w)[4][B], const __half2 (&s2)[4], F& f) {
  __half2 w2[4];
#pragma unroll
  for (int c = 0; c < 4; ++c) w2[c] = as_half2(col_pair<B, P>(w[c], s2[c]));
  f(PairIdx<B, P>::a, PairIdx<B, P>::b, w2);
}

template <int B, typename F, int... P>
EXL2_HD void decode_pairs(const uint32_t (&w)[4][B], const __half2 (&s2)[4], F& f, std::integer_sequence<int, P...>) {
  (decode_pair<B, P>(w, s2, f), ...);
}

struct UnitInfo {
  int woff, row, group, bits, nvals, nwords;
};

// Device unit table entry (exl2_gemm.cu): {woff (the unit's first word inside a tile of the tiled layout, see
// cuda/exl2_gemm.h), row (first packed input row), group, bits | nvals << 8 | nwords << 16}, in file order.
EXL2_HD UnitInfo unit_info(const int4* __restrict__ units, int u) {
#ifdef __CUDA_ARCH__
  const int4 e = __ldg(units + u);
#else
  const int4 e = units[u];
#endif
  return {e.x, e.y, e.z, e.w & 0xff, (e.w >> 8) & 0xff, e.w >> 16};
}

// What a thread reads of one unit for its 4 columns col..col+3 (col % 4 == 0, so one tile): in the tiled layout
// their words are 4 * bits consecutive words (column-major: word i of column c at c * bits + i), read as `bits`
// 16-byte loads into raw words w[0..]; plus the group's scale word (nibbles of col..col+3 in bits 0..15) and msc.
// Loading is separate from decoding so the kernel can fetch the next unit while it decodes this one.
struct UnitData {
  uint4 w[8];
  uint32_t scale_word;
  __half msc;
};

EXL2_HD void load_unit(const UnitInfo& U, const uint32_t* __restrict__ q_weight, int64_t tile_stride,
                       const uint32_t* __restrict__ q_scale, const __half* __restrict__ msc, int64_t out_pad,
                       int64_t col, UnitData& d) {
  const uint32_t* qw = q_weight + (col / 8) * tile_stride + U.woff + (col % 8) * U.bits;
#pragma unroll
  for (int i = 0; i < 8; ++i) d.w[i] = i < U.bits ? ld_u4(qw + 4 * i) : make_uint4(0u, 0u, 0u, 0u);
  d.scale_word = ld_u32(q_scale + int64_t(U.group) * (out_pad / 8) + col / 8) >> (4 * (col % 8));
  d.msc = msc[U.group];
}

// Scales of the 4 columns (col_scale).
EXL2_HD void unit_scales(const UnitData& d, __half2 (&s2)[4]) {
#pragma unroll
  for (int c = 0; c < 4; ++c) s2[c] = col_scale(d.scale_word, c, d.msc);
}

EXL2_HD uint32_t raw_word(const UnitData& d, int k) {
  const uint4 v = d.w[k / 4];
  return (k & 3) == 0 ? v.x : (k & 3) == 1 ? v.y : (k & 3) == 2 ? v.z : v.w;
}

// Calls f(a, b, w2[4]) for the 16 value pairs of a loaded B-bit unit: w2[c] = (W[row+a][col+c], W[row+b][col+c])
// as f16. Values past the unit's end (nvals) decode to finite garbage that the caller must ignore.
template <int B, typename F>
EXL2_HD void decode_unit(const UnitData& d, F& f) {
  uint32_t w[4][B];
#pragma unroll
  for (int c = 0; c < 4; ++c)
#pragma unroll
    for (int i = 0; i < B; ++i) w[c][i] = raw_word(d, c * B + i);
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

// ---- one column of a unit (the tiled layout of the tensor-core kernels, cuda/exl2_gemv_tc.cuh) ---------------

// Rows (a, b) of pair P of a B-bit unit (PairIdx at run time), for the host tables.
inline void pair_rows(int B, int P, int& a, int& b) {
  if (B == 2) {
    a = 16 * (P / 8) + P % 8;
    b = a + 8;
  } else if (B == 4) {
    a = 8 * (P / 4) + P % 4;
    b = a + 4;
  } else if (B == 8) {
    a = 4 * (P / 2) + P % 2;
    b = a + 2;
  } else {
    a = 2 * P;
    b = a + 1;
  }
}

template <int B, typename F, int... P>
EXL2_HD void col_pairs(const uint32_t (&w)[B], __half2 s2, F& f, std::integer_sequence<int, P...>) {
  (f(PairIdx<B, P>::a, PairIdx<B, P>::b, col_pair<B, P>(w, s2)), ...);
}

// Calls f(a, b, bits of half2 (W[row+a][col], W[row+b][col])) for the 16 pairs of one column of a unit whose B
// words are w (words past the unit's data are 0; values past nvals decode to finite garbage).
template <int B, typename F>
EXL2_HD void decode_col(const uint32_t* w, __half2 s2, F& f) {
  uint32_t v[B];
#pragma unroll
  for (int i = 0; i < B; ++i) v[i] = w[i];
  col_pairs<B>(v, s2, f, std::make_integer_sequence<int, 16>{});
}

template <typename F>
EXL2_HD void decode_col_any(int bits, const uint32_t* w, __half2 s2, F& f) {
  switch (bits) {
    case 2: decode_col<2>(w, s2, f); break;
    case 3: decode_col<3>(w, s2, f); break;
    case 4: decode_col<4>(w, s2, f); break;
    case 5: decode_col<5>(w, s2, f); break;
    case 6: decode_col<6>(w, s2, f); break;
    case 8: decode_col<8>(w, s2, f); break;
    default: break;
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

// ---- split-k epilogue of the GEMV kernels ---------------------------------------------------------------------
// A block that has added its fp32 partial sums into acc calls split_k_last_of (every thread) with its column
// block's counter and the number of k slices: true in the one block of that column block that arrives last, after a
// fence, so every other slice's sums are visible to it. That block writes y from acc and resets the counter
// (split_k_drain_of).
__device__ __forceinline__ bool split_k_last_of(unsigned* __restrict__ counter, unsigned slices) {
  __shared__ bool is_last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) is_last = atomicAdd(counter, 1u) == slices - 1;
  __syncthreads();
  if (is_last) __threadfence();
  return is_last;
}

// The grid's own shape: column block blockIdx.x, gridDim.y k slices.
__device__ __forceinline__ bool split_k_last(unsigned* __restrict__ counters) {
  return split_k_last_of(counters + blockIdx.x, gridDim.y);
}

// The last block's drain of COLS columns from c0 (THREADS threads, one element each in turn): y = acc + bias
// (f16), acc cleared to 0 for the next launch, then its column block's counter reset. add (the v4 GEMV's fused
// residual epilogue): y = f16(f32(y) + (acc + bias)) instead, one rounding.
template <int COLS, int THREADS>
__device__ __forceinline__ void split_k_drain_of(float* __restrict__ acc, unsigned* __restrict__ counter, int m,
                                                 int64_t c0, int64_t out, int64_t out_pad,
                                                 const float* __restrict__ bias, __half* __restrict__ y,
                                                 bool add = false) {
  for (int e = threadIdx.x; e < m * COLS; e += THREADS) {
    const int r = e / COLS;
    const int64_t col = c0 + e % COLS;
    if (col >= out_pad) continue;
    float* p = acc + int64_t(r) * out_pad + col;
    const float v = __ldcg(p);
    __stcg(p, 0.f);
    if (col < out) {
      __half* py = y + int64_t(r) * out + col;
      const float s = v + (bias ? bias[col] : 0.f);
      *py = __float2half_rn(add ? __half2float(*py) + s : s);
    }
  }
  if (threadIdx.x == 0) *counter = 0u;
}

template <int COLS, int THREADS>
__device__ __forceinline__ void split_k_drain(float* __restrict__ acc, unsigned* __restrict__ counters, int m,
                                              int64_t c0, int64_t out, int64_t out_pad, const float* __restrict__ bias,
                                              __half* __restrict__ y) {
  split_k_drain_of<COLS, THREADS>(acc, counters + blockIdx.x, m, c0, out, out_pad, bias, y);
}

}  // namespace exl2::cuda::exl2k
