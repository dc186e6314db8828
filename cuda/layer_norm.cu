// cuda::layer_norm: one block per row; fp32 mean, then fp32 variance of the centred row (two passes over the row,
// as HF CohereLayerNorm); out may alias x.
#include "backend/kernels.h"
#include "cuda/common.cuh"
#include "cuda/pdl.cuh"

namespace exl2::cuda {

namespace {

// x and out may alias: no __restrict__ on them; each element is read and then written by the same thread.
template <typename TA, typename TW>
__global__ void layer_norm_kernel(const TA* x, const TW* __restrict__ w, int64_t w_rows, int64_t hidden, float eps,
                                  TA* out) {
  __shared__ float scratch[32];
  pdl_wait();  // cuda/pdl.cuh
  const int64_t row = blockIdx.x;
  w += (row % w_rows) * hidden;  // a weight per head (x rows token-major, heads inner)
  const TA* xr = x + row * hidden;
  TA* yr = out + row * hidden;
  float sum = 0.f;
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) sum += to_f32(xr[i]);
  const float mean = block_sum(sum, scratch) / static_cast<float>(hidden);
  float ss = 0.f;
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    const float d = to_f32(xr[i]) - mean;
    ss = fmaf(d, d, ss);
  }
  pdl_launch_dependents();
  const float inv = rsqrtf(block_sum(ss, scratch) / static_cast<float>(hidden) + eps);
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x)
    yr[i] = from_f32<TA>((to_f32(xr[i]) - mean) * inv * to_f32(w[i]));
}

}  // namespace

void layer_norm(const void* x, const void* w, DType w_dtype, int64_t w_rows, int64_t rows, int64_t hidden, float eps,
                void* out, DType act) {
  if (rows == 0) return;
  EXL2_DISPATCH_FLOAT(w_dtype, "layer_norm weight", [&](auto tw) {
    using TW = decltype(tw);
    EXL2_DISPATCH_ACT(act, "layer_norm", [&](auto ta) {
      using TA = decltype(ta);
      const int threads = hidden >= 2048 ? 512 : (hidden >= 512 ? 256 : 128);
      EXL2_CUDA_LAUNCH_PDL("layer_norm_kernel", layer_norm_kernel<TA, TW>, static_cast<unsigned>(rows), threads, 0,
                           current_stream(), static_cast<const TA*>(x), static_cast<const TW*>(w), w_rows, hidden, eps,
                           static_cast<TA*>(out));
    });
  });
}

}  // namespace exl2::cuda
