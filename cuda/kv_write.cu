// cuda::kv_write: scatter a batch's K and V rows into the paged cache, one thread per element.
#include "backend/kernels.h"
#include "cuda/common.cuh"
#include "cuda/pdl.cuh"

namespace exl2::cuda {

namespace {

// k, v: [n, n_heads_kv, head_dim]; pages: [n_pages, page_size, n_heads_kv, head_dim].
template <typename TA, typename TC>
__global__ void kv_write_kernel(const TA* __restrict__ k, const TA* __restrict__ v, TC* __restrict__ k_pages,
                                TC* __restrict__ v_pages, const int32_t* __restrict__ positions,
                                const int32_t* __restrict__ seq_of_token, const int32_t* __restrict__ page_table,
                                int64_t pages_per_seq, int64_t n, int64_t page_size, int64_t row) {
  pdl_wait();  // cuda/pdl.cuh: k, v (and the cache rows attention read before) belong to earlier kernels
  const int64_t total = n * row;  // row = n_heads_kv * head_dim
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = idx / row, e = idx % row;
    const int64_t pos = positions[t];
    const int64_t page = page_table[int64_t(seq_of_token[t]) * pages_per_seq + pos / page_size];
    const int64_t dst = (page * page_size + pos % page_size) * row + e;
    k_pages[dst] = from_f32<TC>(to_f32(k[idx]));
    v_pages[dst] = from_f32<TC>(to_f32(v[idx]));
  }
}

}  // namespace

void kv_write(const void* k, const void* v, void* k_pages, void* v_pages, DType cache_dtype,
              const int32_t* positions, const int32_t* seq_of_token, const int32_t* page_table, int64_t pages_per_seq,
              int64_t n, int64_t page_size, int64_t n_heads_kv, int64_t head_dim, DType act) {
  const int64_t row = n_heads_kv * head_dim;
  if (n * row == 0) return;
  EXL2_DISPATCH_ACT(act, "kv_write", [&](auto ta) {
    using TA = decltype(ta);
    EXL2_DISPATCH_FLOAT(cache_dtype, "kv_write cache", [&](auto tc) {
      using TC = decltype(tc);
      constexpr int kThreads = 256;
      EXL2_CUDA_LAUNCH_PDL("kv_write_kernel", kv_write_kernel<TA, TC>, elementwise_blocks(n * row, kThreads), kThreads,
                           0, current_stream(), static_cast<const TA*>(k), static_cast<const TA*>(v),
                           static_cast<TC*>(k_pages), static_cast<TC*>(v_pages), positions, seq_of_token, page_table,
                           pages_per_seq, n, page_size, row);
    });
  });
}

}  // namespace exl2::cuda
