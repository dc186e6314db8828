// The host sampler's exp and exp-sum (engine/sampler.cpp) in one compiled copy, shared with cpu::argmax_logprob so
// that a greedy token's log-probability from the CPU backend is bit-identical to the sampler's.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace exl2::cpu {

// exp in f32 without calls or branches, so loops over it vectorize (the vocab-wide exp passes dominate the
// sampler's time with libm's scalar expf). Cody-Waite reduction x = n ln2 + f, |f| <= ln2/2, then the Cephes expf
// polynomial (relative error ~2e-7 over the range). Returns 0 below -87.3 (expf is subnormal there) and for -inf.
// Also compiled for the device (cuda/sampling.cu's sample_logprob kernel): the same expressions term for term, so a
// candidate's weight has the host's bits up to the compilers' FMA contraction.
#ifdef __CUDACC__
__host__ __device__
#endif
inline float fast_exp(float x) {
#ifdef __CUDA_ARCH__
  const float xc = fminf(fmaxf(x, -87.3f), 88.3f);
#else
  const float xc = std::min(std::max(x, -87.3f), 88.3f);
#endif
  // round(x / ln2) by the 1.5 * 2^23 trick (std::floor blocks GCC's vectorizer without -ffast-math); n in [-126, 127]
  const float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float f = xc - n * 0.693359375f;  // ln2 split in two (hi part exact in f32)
  f = f + n * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * f + 1.3981999507e-3f;
  y = y * f + 8.3334519073e-3f;
  y = y * f + 4.1665795894e-2f;
  y = y * f + 1.6666665459e-1f;
  y = y * f + 5.0000001201e-1f;
  y = y * (f * f) + f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n as a normal f32
#ifdef __CUDA_ARCH__
  const float scale = __int_as_float(bits);
#else
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
#endif
  return x < -87.3f ? 0.0f : y * scale;
}

// sum(exp(x[i] - shift)) over [0, n) in f64: f32 lanes over blocks of 64 (vectorized), each block folded into an
// f64 total so the rounding error stays ~1e-7 relative for any n. Defined out of line (sum_exp.cpp): every caller
// runs the same machine code, hence the same bits.
double sum_exp(const float* x, int64_t n, float shift);

}  // namespace exl2::cpu
