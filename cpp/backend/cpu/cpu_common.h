// Private helpers of the CPU backend: row-wise conversion of f32/f16/bf16 to and from f32 (vector code when the
// ISA has it, the exact scalar conversions of tensor.h otherwise and for tails; both round to nearest-even, so
// conversions do not depend on which one ran), dot products, exp and softmax attention.
// The ISA: in a variant file (backend/cpu/isa.h) the copy's own (baseline, AVX2, AVX-512), compiled in its
// namespace under its target; elsewhere what the build's flags give (-march=native under EXL2_NATIVE).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "backend/cpu/isa.h"
#include "backend/cpu/thread_pool.h"
#include "exl2/tensor.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#if defined(EXL2_CPU_ISA_LEVEL)
#if EXL2_CPU_ISA_LEVEL >= 1
#define EXL2_CPU_AVX2 1
#endif
#if EXL2_CPU_ISA_LEVEL >= 2
#define EXL2_CPU_AVX512 1
#endif
#else
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define EXL2_CPU_AVX2 1
#endif
#if defined(EXL2_CPU_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && \
    defined(__AVX512VL__)
#define EXL2_CPU_AVX512 1
#endif
#endif

EXL2_CPU_TARGET_PUSH
namespace exl2::cpu::detail {
inline namespace EXL2_CPU_ISA_NS {

#if defined(EXL2_CPU_AVX512)
// One vector of kVecW floats and the few operations the kernels use (AVX-512: 16 lanes).
constexpr int64_t kVecW = 16;
using VecF = __m512;
inline VecF vzero() { return _mm512_setzero_ps(); }
inline VecF vset1(float x) { return _mm512_set1_ps(x); }
inline VecF vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, VecF v) { _mm512_storeu_ps(p, v); }
inline VecF vadd(VecF a, VecF b) { return _mm512_add_ps(a, b); }
inline VecF vsub(VecF a, VecF b) { return _mm512_sub_ps(a, b); }
inline VecF vmul(VecF a, VecF b) { return _mm512_mul_ps(a, b); }
inline VecF vdiv(VecF a, VecF b) { return _mm512_div_ps(a, b); }
inline VecF vfma(VecF a, VecF b, VecF c) { return _mm512_fmadd_ps(a, b, c); }
inline VecF vfnma(VecF a, VecF b, VecF c) { return _mm512_fnmadd_ps(a, b, c); }
inline VecF vclamp(VecF x, float lo, float hi) { return _mm512_min_ps(_mm512_max_ps(x, vset1(lo)), vset1(hi)); }
inline VecF vround(VecF x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline VecF vpow2i(VecF n) {  // 2^n for integral n in the normal range, through the exponent bits
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
inline float vhsum(VecF v) { return _mm512_reduce_add_ps(v); }
inline VecF vload_f16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline VecF vload_bf16(const uint16_t* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
inline void vstore_f16(uint16_t* p, VecF v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#elif defined(EXL2_CPU_AVX2)
// AVX2 + FMA + F16C: 8 lanes.
constexpr int64_t kVecW = 8;
using VecF = __m256;
inline VecF vzero() { return _mm256_setzero_ps(); }
inline VecF vset1(float x) { return _mm256_set1_ps(x); }
inline VecF vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, VecF v) { _mm256_storeu_ps(p, v); }
inline VecF vadd(VecF a, VecF b) { return _mm256_add_ps(a, b); }
inline VecF vsub(VecF a, VecF b) { return _mm256_sub_ps(a, b); }
inline VecF vmul(VecF a, VecF b) { return _mm256_mul_ps(a, b); }
inline VecF vdiv(VecF a, VecF b) { return _mm256_div_ps(a, b); }
inline VecF vfma(VecF a, VecF b, VecF c) { return _mm256_fmadd_ps(a, b, c); }
inline VecF vfnma(VecF a, VecF b, VecF c) { return _mm256_fnmadd_ps(a, b, c); }
inline VecF vclamp(VecF x, float lo, float hi) { return _mm256_min_ps(_mm256_max_ps(x, vset1(lo)), vset1(hi)); }
inline VecF vround(VecF x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline VecF vpow2i(VecF n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline float vhsum(VecF v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}
inline VecF vload_f16(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline VecF vload_bf16(const uint16_t* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline void vstore_f16(uint16_t* p, VecF v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#endif

inline float load_one(const void* p, DType dt, int64_t i) {
  switch (dt) {
    case DType::F32:
      return static_cast<const float*>(p)[i];
    case DType::F16:
      return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
    default:
      return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
  }
}

inline void store_one(void* p, DType dt, int64_t i, float v) {
  switch (dt) {
    case DType::F32:
      static_cast<float*>(p)[i] = v;
      break;
    case DType::F16:
      static_cast<uint16_t*>(p)[i] = f32_to_f16(v);
      break;
    default:
      static_cast<uint16_t*>(p)[i] = f32_to_bf16(v);
      break;
  }
}

// dst[0..n) = float(src[0..n)) for src of dtype dt.
inline void row_to_f32(const void* src, DType dt, int64_t n, float* dst) {
  if (dt == DType::F32) {
    std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
    return;
  }
  const uint16_t* s = static_cast<const uint16_t*>(src);
  int64_t i = 0;
#ifdef EXL2_CPU_AVX2
  if (dt == DType::F16) {
    for (; i + kVecW <= n; i += kVecW) vstore(dst + i, vload_f16(s + i));
  } else {
    for (; i + kVecW <= n; i += kVecW) vstore(dst + i, vload_bf16(s + i));
  }
#endif
  if (dt == DType::F16) {
    for (; i < n; ++i) dst[i] = f16_to_f32(s[i]);
  } else {
    for (; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
  }
}

// dst[0..n) (dtype dt) = src[0..n) rounded to nearest-even.
inline void row_from_f32(const float* src, int64_t n, void* dst, DType dt) {
  if (dt == DType::F32) {
    std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
    return;
  }
  uint16_t* d = static_cast<uint16_t*>(dst);
  int64_t i = 0;
#ifdef EXL2_CPU_AVX2
  if (dt == DType::F16) {
    for (; i + kVecW <= n; i += kVecW) vstore_f16(d + i, vload(src + i));
  }
#endif
  if (dt == DType::F16) {
    for (; i < n; ++i) d[i] = f32_to_f16(src[i]);
  } else {
    for (; i < n; ++i) d[i] = f32_to_bf16(src[i]);
  }
}

// sum(a[i] * b[i]) in f32 (kVecW lanes x 2 accumulators with vectors, so the sum order differs from a plain loop).
inline float dot_f32(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float s = 0.0f;
#ifdef EXL2_CPU_AVX2
  VecF acc0 = vzero(), acc1 = vzero();
  for (; i + 2 * kVecW <= n; i += 2 * kVecW) {
    acc0 = vfma(vload(a + i), vload(b + i), acc0);
    acc1 = vfma(vload(a + i + kVecW), vload(b + i + kVecW), acc1);
  }
  for (; i + kVecW <= n; i += kVecW) acc0 = vfma(vload(a + i), vload(b + i), acc0);
  s = vhsum(vadd(acc0, acc1));
#endif
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

#ifdef EXL2_CPU_AVX2
// exp of kVecW floats: Cephes-style range reduction x = n*ln2 + r and a degree-6 polynomial for e^r, ~2 ulp.
// Inputs are clamped to [-87.3, 88] so 2^n stays a normal float (exp(-87.3) ~ 1.2e-38, exp(88) ~ 1.65e38).
inline VecF vexp(VecF x) {
  x = vclamp(x, -87.3f, 88.0f);
  const VecF fx = vround(vmul(x, vset1(1.44269504088896341f)));
  x = vfnma(fx, vset1(0.693359375f), x);  // ln2 split in two for an exact product
  x = vfnma(fx, vset1(-2.12194440e-4f), x);
  VecF y = vset1(1.9875691500e-4f);
  y = vfma(y, x, vset1(1.3981999507e-3f));
  y = vfma(y, x, vset1(8.3334519073e-3f));
  y = vfma(y, x, vset1(4.1665795894e-2f));
  y = vfma(y, x, vset1(1.6666665459e-1f));
  y = vfma(y, x, vset1(5.0000001201e-1f));
  y = vfma(y, vmul(x, x), vadd(x, vset1(1.0f)));
  return vmul(y, vpow2i(fx));
}
#endif

// x[i] = exp(x[i] - shift) for i < n; returns the sum of the results (softmax numerators and denominator).
inline float exp_shift_sum(float* x, int64_t n, float shift) {
  int64_t i = 0;
  float s = 0.0f;
#ifdef EXL2_CPU_AVX2
  VecF acc = vzero();
  const VecF sh = vset1(shift);
  for (; i + kVecW <= n; i += kVecW) {
    const VecF v = vexp(vsub(vload(x + i), sh));
    vstore(x + i, v);
    acc = vadd(acc, v);
  }
  s = vhsum(acc);
#endif
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - shift);
    s += x[i];
  }
  return s;
}

// g[i] = silu(g[i]) * u[i] = g / (1 + exp(-g)) * u.
inline void silu_mul_f32(float* g, const float* u, int64_t n) {
  int64_t i = 0;
#ifdef EXL2_CPU_AVX2
  const VecF one = vset1(1.0f);
  for (; i + kVecW <= n; i += kVecW) {
    const VecF gv = vload(g + i);
    const VecF e = vexp(vsub(vzero(), gv));
    vstore(g + i, vmul(vdiv(gv, vadd(one, e)), vload(u + i)));
  }
#endif
  for (; i < n; ++i) g[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}

// Byte offset helper: element i of a buffer of dtype dt.
inline const void* at(const void* p, DType dt, int64_t i) {
  return static_cast<const char*>(p) + i * static_cast<int64_t>(dtype_size(dt));
}
inline void* at(void* p, DType dt, int64_t i) {
  return static_cast<char*>(p) + i * static_cast<int64_t>(dtype_size(dt));
}

// A per-row norm over rows x hidden of act (out may equal x: each row is read fully into a private f32 buffer before
// it is written): w [w_rows, hidden] converted to f32 once, then norm_row(row, wf of row r % w_rows) rewrites each
// row in place, in parallel.
template <typename NormRow>
void norm_rows(const void* x, const void* w, DType w_dtype, int64_t rows, int64_t hidden, void* out, DType act,
               NormRow norm_row, int64_t w_rows = 1) {
  std::vector<float> wf(static_cast<size_t>(hidden * w_rows));
  row_to_f32(w, w_dtype, hidden * w_rows, wf.data());
  parallel_for(rows, 8, [&](int64_t b, int64_t e) {
    std::vector<float> row(static_cast<size_t>(hidden));
    for (int64_t r = b; r < e; ++r) {
      row_to_f32(at(x, act, r * hidden), act, hidden, row.data());
      norm_row(row.data(), wf.data() + (r % w_rows) * hidden);
      row_from_f32(row.data(), hidden, at(out, act, r * hidden), act);
    }
  });
}

// A gated activation elementwise over numel values of act (out may alias gate or up: each chunk is loaded before it
// is stored): gate_chunk(g, u, len) writes act(g) * u into g, for chunks of at most 1024 values in parallel.
template <typename GateChunk>
void gated_chunks(const void* gate, const void* up, void* out, int64_t numel, DType act, GateChunk gate_chunk) {
  constexpr int64_t kChunk = 1024;  // elements per private f32 buffer (4 KiB each)
  parallel_for((numel + kChunk - 1) / kChunk, 4, [&](int64_t b, int64_t e) {
    float g[kChunk], u[kChunk];
    for (int64_t c = b; c < e; ++c) {
      const int64_t i0 = c * kChunk, len = std::min(kChunk, numel - i0);
      row_to_f32(at(gate, act, i0), act, len, g);
      row_to_f32(at(up, act, i0), act, len, u);
      gate_chunk(g, u, len);
      row_from_f32(g, len, at(out, act, i0), act);
    }
  });
}

struct NoKeyBias {};

// Two-pass fp32 softmax attention of `group` query heads (qf [group, head_dim]) over keys first..len-1 (scores
// scaled, then capped when softcap > 0: softcap * tanh(s / softcap)): key_row(j) and
// value_row(j) give the fp32 row of key / value j (valid until the next call); acc [group, head_dim] receives the
// softmax-weighted sum of the values. scores: scratch, resized here. Shared by the fp16/f32 and the quantized caches.
// key_bias (optional): float key_bias(j, h) is added to head h's dot with key j before the scaling (the quantized
// cache's RoPE-aware K centre, cache/kv_quant.h).
template <typename KeyRow, typename ValueRow, typename KeyBias = NoKeyBias>
void attend_group(const float* qf, int64_t group, int64_t head_dim, int64_t first, int64_t len, float scale,
                  float softcap, KeyRow key_row, ValueRow value_row, std::vector<float>& scores, float* acc,
                  KeyBias key_bias = {}) {
  const int64_t nk = len - first;  // keys [first, len)
  scores.resize(static_cast<size_t>(group * nk));
  // Pass 1: scores (capped: softcap * tanh(s / softcap)) and their max per head.
  std::vector<float> mx(static_cast<size_t>(group), -std::numeric_limits<float>::infinity());
  for (int64_t j = first; j < len; ++j) {
    const float* kr = key_row(j);
    for (int64_t h = 0; h < group; ++h) {
      float s = dot_f32(qf + h * head_dim, kr, head_dim);
      if constexpr (!std::is_same_v<KeyBias, NoKeyBias>) s += key_bias(j, h);
      s *= scale;
      if (softcap > 0.f) s = softcap * std::tanh(s / softcap);
      scores[h * nk + j - first] = s;
      mx[h] = std::max(mx[h], s);
    }
  }
  // Pass 2: exp, sum, weighted V.
  std::vector<float> sum(static_cast<size_t>(group), 0.0f);
  for (int64_t h = 0; h < group; ++h) sum[h] = exp_shift_sum(scores.data() + h * nk, nk, mx[h]);
  std::fill(acc, acc + group * head_dim, 0.0f);
  for (int64_t j = first; j < len; ++j) {
    const float* vr = value_row(j);
    for (int64_t h = 0; h < group; ++h) {
      const float p = scores[h * nk + j - first];
      float* a = acc + h * head_dim;
      for (int64_t i = 0; i < head_dim; ++i) a[i] += p * vr[i];
    }
  }
  for (int64_t h = 0; h < group; ++h) {
    const float inv = 1.0f / sum[h];
    float* a = acc + h * head_dim;
    for (int64_t i = 0; i < head_dim; ++i) a[i] *= inv;
  }
}

}  // namespace EXL2_CPU_ISA_NS
}  // namespace exl2::cpu::detail
EXL2_CPU_TARGET_POP
