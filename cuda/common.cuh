// Device-side helpers shared by the CUDA kernels: float conversion of f32/f16/bf16 values, warp/block
// reductions, and the host-side DType -> C++ type dispatch used by every launcher.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cuda/check.h"
#include "cuda/stream.h"
#include "exl2/tensor.h"

namespace exl2::cuda {

// c += a (16x16, row) * b (16x8, col); f16 inputs, fp32 accumulate (tensor cores, sm_80 and newer).
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_f32(float x);
template <>
__device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block; every thread gets the result. `scratch`: __shared__ float[32]. blockDim.x % 32 == 0.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < n_warps ? scratch[lane] : 0.f;
  return warp_sum(v);
}

__device__ __forceinline__ double warp_sum_f64(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Block-wide f64 sum; every thread gets the result. blockDim.x % 32 == 0.
__device__ __forceinline__ double block_sum_f64(double v) {
  __shared__ double s[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
  v = warp_sum_f64(v);
  __syncthreads();
  if (lane == 0) s[warp] = v;
  __syncthreads();
  v = lane < n_warps ? s[lane] : 0.0;
  return warp_sum_f64(v);
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < n_warps ? scratch[lane] : -INFINITY;
  return warp_max(v);
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Grid size for grid-stride elementwise kernels (enough blocks to fill the GPU, capped).
// The rotation of one RoPE pair (x1, x2) by (c, s), rounded the same way in every kernel that does it (no FMA
// contraction: the fused rope + cache write must give rope's bits).
__device__ __forceinline__ float rope_lo(float x1, float x2, float c, float s) {
  return __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s));
}
__device__ __forceinline__ float rope_hi(float x1, float x2, float c, float s) {
  return __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s));
}

inline unsigned elementwise_blocks(int64_t n, int threads) {
  int64_t b = ceil_div(n, threads);
  const int64_t cap = int64_t(sm_count()) * 32;
  return static_cast<unsigned>(b < 1 ? 1 : (b > cap ? cap : b));
}

}  // namespace exl2::cuda

// Host-side: call FN with a value of the C++ type of a float DType (f32/f16/bf16):
//   EXL2_DISPATCH_FLOAT(dtype, "rms_norm weight", [&](auto tag) { using T = decltype(tag); ... });
#define EXL2_DISPATCH_FLOAT(dtype, what, ...)                                                            \
  do {                                                                                                  \
    auto exl2_fn_ = __VA_ARGS__;                                                                        \
    switch (dtype) {                                                                                    \
      case ::exl2::DType::F32: exl2_fn_(float{}); break;                                                \
      case ::exl2::DType::F16: exl2_fn_(__half{}); break;                                               \
      case ::exl2::DType::BF16: exl2_fn_(__nv_bfloat16{}); break;                                       \
      default: EXL2_FAIL(Unsupported, "CUDA ", what, ": dtype f32/f16/bf16 expected, got dtype code ",  \
                         static_cast<int>(dtype));                                                      \
    }                                                                                                   \
  } while (0)

// Activations: f32 or f16.
#define EXL2_DISPATCH_ACT(dtype, what, ...)                                                                  \
  do {                                                                                                      \
    auto exl2_fn_ = __VA_ARGS__;                                                                            \
    switch (dtype) {                                                                                        \
      case ::exl2::DType::F32: exl2_fn_(float{}); break;                                                    \
      case ::exl2::DType::F16: exl2_fn_(__half{}); break;                                                   \
      default: EXL2_FAIL(Unsupported, "CUDA ", what, ": activation dtype f32/f16 expected, got dtype code ", \
                         static_cast<int>(dtype));                                                          \
    }                                                                                                       \
  } while (0)
