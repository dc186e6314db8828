// cuda::scale: out = x * s, then (cap > 0) cap * tanh(out / cap), elementwise in fp32; out may alias x.
#include "backend/kernels.h"
#include "cuda/common.cuh"
#include "cuda/pdl.cuh"

namespace exl2::cuda {

namespace {

template <typename TA>
__global__ void scale_kernel(const TA* x, TA* out, int64_t numel, float s, float cap) {
  pdl_wait();  // cuda/pdl.cuh
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < numel; i += int64_t(gridDim.x) * blockDim.x) {
    float v = to_f32(x[i]) * s;
    if (cap > 0.f) v = cap * tanhf(v / cap);
    out[i] = from_f32<TA>(v);
  }
}

}  // namespace

void scale(const void* x, void* out, int64_t numel, float s, float cap, DType act) {
  if (numel == 0) return;
  constexpr int kThreads = 256;
  EXL2_DISPATCH_ACT(act, "scale", [&](auto ta) {
    using TA = decltype(ta);
    EXL2_CUDA_LAUNCH_PDL("scale_kernel", scale_kernel<TA>, elementwise_blocks(numel, kThreads), kThreads, 0,
                         current_stream(), static_cast<const TA*>(x), static_cast<TA*>(out), numel, s, cap);
  });
}

}  // namespace exl2::cuda
