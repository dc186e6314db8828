// cuda::add: out = a + b elementwise in fp32; out may alias a or b.
#include "backend/kernels.h"
#include "cuda/common.cuh"
#include "cuda/pdl.cuh"

namespace exl2::cuda {

namespace {

template <typename TA>
__global__ void add_kernel(const TA* a, const TA* b, TA* out, int64_t numel) {
  pdl_wait();  // cuda/pdl.cuh: a and b may still be being written by the previous kernel
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < numel; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = from_f32<TA>(to_f32(a[i]) + to_f32(b[i]));
}

__global__ void add_h2_kernel(const __half2* a, const __half2* b, __half2* out, int64_t n2) {
  pdl_wait();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n2; i += int64_t(gridDim.x) * blockDim.x) {
    const float2 x = __half22float2(a[i]), y = __half22float2(b[i]);
    out[i] = __floats2half2_rn(x.x + y.x, x.y + y.y);
  }
}

}  // namespace

void add(const void* a, const void* b, void* out, int64_t numel, DType act) {
  if (numel == 0) return;
  constexpr int kThreads = 256;
  const bool aligned =
      (reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b) | reinterpret_cast<uintptr_t>(out)) % 4 == 0;
  if (act == DType::F16 && numel % 2 == 0 && aligned && !ref_kernels_enabled()) {
    EXL2_CUDA_LAUNCH_PDL("add_h2_kernel", add_h2_kernel, elementwise_blocks(numel / 2, kThreads), kThreads, 0,
                         current_stream(), static_cast<const __half2*>(a), static_cast<const __half2*>(b),
                         static_cast<__half2*>(out), numel / 2);
    return;
  }
  EXL2_DISPATCH_ACT(act, "add", [&](auto ta) {
    using TA = decltype(ta);
    EXL2_CUDA_LAUNCH_PDL("add_kernel", add_kernel<TA>, elementwise_blocks(numel, kThreads), kThreads, 0,
                         current_stream(), static_cast<const TA*>(a), static_cast<const TA*>(b), static_cast<TA*>(out),
                         numel);
  });
}

}  // namespace exl2::cuda
