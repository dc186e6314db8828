// Private helpers of the CPU backend: row-wise conversion of f32/f16/bf16 to and from f32 (F16C/AVX2 when the
// build has them, the exact scalar conversions of tensor.h otherwise and for tails). Both paths round to
// nearest-even, so results do not depend on which one ran.
#pragma once

#include <cstdint>
#include <cstring>

#include "exl2/tensor.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define EXL2_CPU_AVX2 1
#endif

namespace exl2::cpu::detail {

inline float load_one(const void* p, DType dt, int64_t i) {
  switch (dt) {
    case DType::F32: return static_cast<const float*>(p)[i];
    case DType::F16: return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
    default: return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
  }
}

inline void store_one(void* p, DType dt, int64_t i, float v) {
  switch (dt) {
    case DType::F32: static_cast<float*>(p)[i] = v; break;
    case DType::F16: static_cast<uint16_t*>(p)[i] = f32_to_f16(v); break;
    default: static_cast<uint16_t*>(p)[i] = f32_to_bf16(v); break;
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
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))));
  } else {
    for (; i + 8 <= n; i += 8) {
      const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
      _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
    }
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
    for (; i + 8 <= n; i += 8)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i),
                       _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
#endif
  if (dt == DType::F16) {
    for (; i < n; ++i) d[i] = f32_to_f16(src[i]);
  } else {
    for (; i < n; ++i) d[i] = f32_to_bf16(src[i]);
  }
}

// sum(a[i] * b[i]) in f32 (8 lanes x 2 accumulators with AVX2, so the sum order differs from a plain loop).
inline float dot_f32(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float s = 0.0f;
#ifdef EXL2_CPU_AVX2
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  const __m256 v = _mm256_add_ps(acc0, acc1);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  s = _mm_cvtss_f32(h);
#endif
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Byte offset helper: element i of a buffer of dtype dt.
inline const void* at(const void* p, DType dt, int64_t i) {
  return static_cast<const char*>(p) + i * static_cast<int64_t>(dtype_size(dt));
}
inline void* at(void* p, DType dt, int64_t i) { return static_cast<char*>(p) + i * static_cast<int64_t>(dtype_size(dt)); }

}  // namespace exl2::cpu::detail
