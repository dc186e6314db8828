// cuda::rms_norm: one block per row, fp32 sum of squares with warp reductions; out may alias x.
#include "backend/kernels.h"
#include "cuda/common.cuh"
#include "cuda/pdl.cuh"

namespace exl2::cuda {

namespace {

// x and out may alias: no __restrict__ on them; each element is read and then written by the same thread.
template <typename TA, typename TW>
__global__ void rms_norm_kernel(const TA* x, const TW* __restrict__ w, int64_t hidden, float eps, TA* out) {
  __shared__ float scratch[32];
  pdl_wait();  // cuda/pdl.cuh: x may still be being written by the previous kernel
  const int64_t row = blockIdx.x;
  const TA* xr = x + row * hidden;
  TA* yr = out + row * hidden;
  float ss = 0.f;
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    float v = to_f32(xr[i]);
    ss = fmaf(v, v, ss);
  }
  pdl_launch_dependents();  // the next kernel may be scheduled (it still waits for our completion)
  ss = block_sum(ss, scratch);
  const float inv = rsqrtf(ss / static_cast<float>(hidden) + eps);
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    yr[i] = from_f32<TA>(to_f32(xr[i]) * inv * to_f32(w[i]));
  }
}

// f16 rows with hidden % 8 == 0 and 16-byte aligned pointers: 16-byte loads, the row kept in registers
// (hidden <= 8 * 8 * threads), so x is read once.
// ADD: x is h, updated in place to f16(h + r) first (as cuda::add rounds it), and the norm is of that sum.
template <typename TW, int kPerThread, bool ADD = false>
__global__ void rms_norm_f16_vec_kernel(const __half* x, const TW* __restrict__ w, int64_t hidden, float eps,
                                        __half* out, const __half* r = nullptr) {
  __shared__ float scratch[32];
  pdl_wait();  // cuda/pdl.cuh
  const int64_t row = blockIdx.x;
  const uint4* xr = reinterpret_cast<const uint4*>(x + row * hidden);
  uint4* yr = reinterpret_cast<uint4*>(out + row * hidden);
  const int n_vec = static_cast<int>(hidden / 8);
  uint4 cache[kPerThread];
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    if (i < n_vec) {
      cache[k] = xr[i];
      if constexpr (ADD) {
        const uint4 rv = reinterpret_cast<const uint4*>(r + row * hidden)[i];
        __half2* hc = reinterpret_cast<__half2*>(&cache[k]);
        const __half2* hr = reinterpret_cast<const __half2*>(&rv);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 a = __half22float2(hc[j]), b = __half22float2(hr[j]);
          hc[j] = __floats2half2_rn(a.x + b.x, a.y + b.y);
        }
        const_cast<uint4*>(xr)[i] = cache[k];
      }
      const __half2* h = reinterpret_cast<const __half2*>(&cache[k]);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float2 f = __half22float2(h[j]);
        ss = fmaf(f.x, f.x, ss);
        ss = fmaf(f.y, f.y, ss);
      }
    }
  }
  pdl_launch_dependents();  // e.g. the next EXL2 GEMV starts prefetching its weights
  ss = block_sum(ss, scratch);
  const float inv = rsqrtf(ss / static_cast<float>(hidden) + eps);
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    if (i < n_vec) {
      const __half2* h = reinterpret_cast<const __half2*>(&cache[k]);
      uint4 o;
      __half2* oh = reinterpret_cast<__half2*>(&o);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float2 f = __half22float2(h[j]);
        const int64_t c = int64_t(i) * 8 + 2 * j;
        oh[j] = __floats2half2_rn(f.x * inv * to_f32(w[c]), f.y * inv * to_f32(w[c + 1]));
      }
      yr[i] = o;
    }
  }
}

}  // namespace

void rms_norm(const void* x, const void* w, DType w_dtype, int64_t rows, int64_t hidden, float eps, void* out,
              DType act) {
  if (rows == 0) return;
  EXL2_DISPATCH_FLOAT(w_dtype, "rms_norm weight", [&](auto tw) {
    using TW = decltype(tw);
    EXL2_DISPATCH_ACT(act, "rms_norm", [&](auto ta) {
      using TA = decltype(ta);
      const bool aligned = (reinterpret_cast<uintptr_t>(x) % 16 == 0) && (reinterpret_cast<uintptr_t>(out) % 16 == 0);
      constexpr int kThreads = 256, kPer = 8;  // rows up to 256 * 8 * 8 = 16384 elements stay in registers
      if constexpr (std::is_same_v<TA, __half>) {
        if (!ref_kernels_enabled() && aligned && hidden % 8 == 0 && hidden <= int64_t(kThreads) * kPer * 8) {
          EXL2_CUDA_LAUNCH_PDL("rms_norm_f16_vec_kernel", rms_norm_f16_vec_kernel<TW, kPer>,
                               static_cast<unsigned>(rows), kThreads, 0, current_stream(),
                               static_cast<const __half*>(x), static_cast<const TW*>(w), hidden, eps,
                               static_cast<__half*>(out), static_cast<const __half*>(nullptr));
          return;
        }
      }
      const int threads = hidden >= 2048 ? 512 : (hidden >= 512 ? 256 : 128);
      EXL2_CUDA_LAUNCH_PDL("rms_norm_kernel", rms_norm_kernel<TA, TW>, static_cast<unsigned>(rows), threads, 0,
                           current_stream(), static_cast<const TA*>(x), static_cast<const TW*>(w), hidden, eps,
                           static_cast<TA*>(out));
    });
  });
}

void add_rms_norm(void* h, const void* r, const void* w, DType w_dtype, int64_t rows, int64_t hidden, float eps,
                  void* out, DType act) {
  if (rows == 0) return;
  constexpr int kThreads = 256, kPer = 8;
  const bool aligned =
      (reinterpret_cast<uintptr_t>(h) | reinterpret_cast<uintptr_t>(r) | reinterpret_cast<uintptr_t>(out)) % 16 == 0;
  if (act == DType::F16 && !ref_kernels_enabled() && aligned && hidden % 8 == 0 &&
      hidden <= int64_t(kThreads) * kPer * 8) {
    EXL2_DISPATCH_FLOAT(w_dtype, "add_rms_norm weight", [&](auto tw) {
      using TW = decltype(tw);
      EXL2_CUDA_LAUNCH_PDL("rms_norm_f16_vec_kernel<add>", rms_norm_f16_vec_kernel<TW, kPer, true>,
                           static_cast<unsigned>(rows), kThreads, 0, current_stream(), static_cast<const __half*>(h),
                           static_cast<const TW*>(w), hidden, eps, static_cast<__half*>(out),
                           static_cast<const __half*>(r));
    });
    return;
  }
  add(h, r, h, rows * hidden, act);  // other shapes / dtypes: the two kernels
  rms_norm(h, w, w_dtype, rows, hidden, eps, out, act);
}

}  // namespace exl2::cuda
