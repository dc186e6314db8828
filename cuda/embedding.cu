// cuda::embedding: out[n, H] = table[ids[n], :], one block per token; out-of-range ids are clamped and flagged.
#include "backend/kernels.h"
#include "cuda/common.cuh"
#include "cuda/pdl.cuh"
#include "cuda/embedding.h"

namespace exl2::cuda {

namespace {

__device__ int g_embedding_oob = 0;

template <typename TT, typename TA>
__global__ void embedding_kernel(const int32_t* __restrict__ ids, const TT* __restrict__ table, int64_t vocab,
                                 int64_t hidden, TA* __restrict__ out) {
  pdl_wait();  // cuda/pdl.cuh: ids come from the step's upload, out may be read by the previous step's kernels
  const int64_t row = blockIdx.x;
  int64_t id = ids[row];
  if (id < 0 || id >= vocab) {
    if (threadIdx.x == 0) atomicExch(&g_embedding_oob, 1);
    id = id < 0 ? 0 : vocab - 1;
  }
  const TT* src = table + id * hidden;
  TA* dst = out + row * hidden;
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = from_f32<TA>(to_f32(src[i]));
}

}  // namespace

void embedding(const int32_t* ids, int64_t n, const void* table, DType table_dtype, int64_t vocab, int64_t hidden,
               void* out, DType act) {
  if (n == 0) return;
  EXL2_DISPATCH_FLOAT(table_dtype, "embedding table", [&](auto tt) {
    using TT = decltype(tt);
    EXL2_DISPATCH_ACT(act, "embedding", [&](auto ta) {
      using TA = decltype(ta);
      const int threads = hidden >= 1024 ? 256 : 128;
      EXL2_CUDA_LAUNCH_PDL("embedding_kernel", embedding_kernel<TT, TA>, static_cast<unsigned>(n), threads, 0,
                           current_stream(), ids, static_cast<const TT*>(table), vocab, hidden, static_cast<TA*>(out));
    });
  });
}

bool embedding_take_oob_flag() {
  int flag = 0, zero = 0;
  cudaStream_t s = current_stream();
  EXL2_CUDA_CHECK(cudaMemcpyFromSymbolAsync(&flag, g_embedding_oob, sizeof(int), 0, cudaMemcpyDeviceToHost, s));
  EXL2_CUDA_CHECK(cudaMemcpyToSymbolAsync(g_embedding_oob, &zero, sizeof(int), 0, cudaMemcpyHostToDevice, s));
  EXL2_CUDA_CHECK(cudaStreamSynchronize(s));
  return flag != 0;
}

}  // namespace exl2::cuda
