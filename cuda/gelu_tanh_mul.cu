// cuda::gelu_tanh_mul: out = gelu_tanh(gate) * up elementwise in fp32; out may alias gate or up.
#include "backend/kernels.h"
#include "cuda/common.cuh"
#include "cuda/pdl.cuh"

namespace exl2::cuda {

namespace {

__device__ __forceinline__ float gelu_tanh(float x) {
  constexpr float kBeta = 0.7978845608028654f;  // sqrt(2 / pi)
  return 0.5f * x * (1.f + tanhf(kBeta * (x + 0.044715f * x * x * x)));
}

template <typename TA>
__global__ void gelu_tanh_mul_kernel(const TA* gate, const TA* up, TA* out, int64_t numel) {
  pdl_wait();  // cuda/pdl.cuh
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < numel; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = from_f32<TA>(gelu_tanh(to_f32(gate[i])) * to_f32(up[i]));
}

}  // namespace

void gelu_tanh_mul(const void* gate, const void* up, void* out, int64_t numel, DType act) {
  if (numel == 0) return;
  constexpr int kThreads = 256;
  EXL2_DISPATCH_ACT(act, "gelu_tanh_mul", [&](auto ta) {
    using TA = decltype(ta);
    EXL2_CUDA_LAUNCH_PDL("gelu_tanh_mul_kernel", gelu_tanh_mul_kernel<TA>, elementwise_blocks(numel, kThreads),
                         kThreads, 0, current_stream(), static_cast<const TA*>(gate), static_cast<const TA*>(up),
                         static_cast<TA*>(out), numel);
  });
}

}  // namespace exl2::cuda
