// cuda::silu_mul: out = silu(gate) * up elementwise in fp32; out may alias gate or up.
#include "backend/kernels.h"
#include "cuda/common.cuh"
#include "cuda/pdl.cuh"

namespace exl2::cuda {

namespace {

template <typename TA>
__global__ void silu_mul_kernel(const TA* gate, const TA* up, TA* out, int64_t numel) {
  pdl_wait();  // cuda/pdl.cuh
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < numel; i += int64_t(gridDim.x) * blockDim.x) {
    const float g = to_f32(gate[i]);
    // silu(g) = g / (1 + e^-g); for g << 0, e^-g -> inf and g / inf -> -0, which is the right limit.
    out[i] = from_f32<TA>(g / (1.f + expf(-g)) * to_f32(up[i]));
  }
}

// f16, numel % 2 == 0, 4-byte aligned: two elements per thread.
__global__ void silu_mul_h2_kernel(const __half2* gate, const __half2* up, __half2* out, int64_t n2) {
  pdl_wait();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n2; i += int64_t(gridDim.x) * blockDim.x) {
    const float2 g = __half22float2(gate[i]);
    const float2 u = __half22float2(up[i]);
    out[i] = __floats2half2_rn(g.x / (1.f + expf(-g.x)) * u.x, g.y / (1.f + expf(-g.y)) * u.y);
  }
}

}  // namespace

void silu_mul(const void* gate, const void* up, void* out, int64_t numel, DType act) {
  if (numel == 0) return;
  constexpr int kThreads = 256;
  const bool aligned = (reinterpret_cast<uintptr_t>(gate) | reinterpret_cast<uintptr_t>(up) |
                        reinterpret_cast<uintptr_t>(out)) % 4 == 0;
  if (act == DType::F16 && numel % 2 == 0 && aligned && !ref_kernels_enabled()) {
    EXL2_CUDA_LAUNCH_PDL("silu_mul_h2_kernel", silu_mul_h2_kernel, elementwise_blocks(numel / 2, kThreads), kThreads,
                         0, current_stream(), static_cast<const __half2*>(gate), static_cast<const __half2*>(up),
                         static_cast<__half2*>(out), numel / 2);
    return;
  }
  EXL2_DISPATCH_ACT(act, "silu_mul", [&](auto ta) {
    using TA = decltype(ta);
    EXL2_CUDA_LAUNCH_PDL("silu_mul_kernel", silu_mul_kernel<TA>, elementwise_blocks(numel, kThreads), kThreads, 0,
                         current_stream(), static_cast<const TA*>(gate), static_cast<const TA*>(up),
                         static_cast<TA*>(out), numel);
  });
}

}  // namespace exl2::cuda
