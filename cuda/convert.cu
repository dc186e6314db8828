// cuda::convert: elementwise f32/f16/bf16 conversion (round to nearest even), or a plain copy for equal dtypes.
#include "backend/kernels.h"
#include "cuda/common.cuh"
#include "cuda/pdl.cuh"

namespace exl2::cuda {

namespace {

template <typename TS, typename TD>
__global__ void convert_kernel(const TS* __restrict__ src, TD* __restrict__ dst, int64_t numel) {
  pdl_wait();  // cuda/pdl.cuh
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < numel; i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = from_f32<TD>(to_f32(src[i]));
}

}  // namespace

void convert(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t numel) {
  if (numel == 0) return;
  if (src_dtype == dst_dtype) {
    EXL2_CUDA_CHECK(cudaMemcpyAsync(dst, src, size_t(numel) * dtype_size(src_dtype), cudaMemcpyDeviceToDevice,
                                    current_stream()));
    return;
  }
  EXL2_DISPATCH_FLOAT(src_dtype, "convert source", [&](auto ts) {
    using TS = decltype(ts);
    EXL2_DISPATCH_FLOAT(dst_dtype, "convert destination", [&](auto td) {
      using TD = decltype(td);
      constexpr int kThreads = 256;
      EXL2_CUDA_LAUNCH_PDL("convert_kernel", convert_kernel<TS, TD>, elementwise_blocks(numel, kThreads), kThreads,
                           0, current_stream(), static_cast<const TS*>(src), static_cast<TD*>(dst), numel);
    });
  });
}

}  // namespace exl2::cuda
