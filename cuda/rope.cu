// cuda::rope: in-place rotate-half (NeoX) rotary embedding from an f32 cos|sin table, one thread per pair.
#include "backend/kernels.h"
#include "cuda/common.cuh"
#include "cuda/pdl.cuh"

namespace exl2::cuda {

namespace {

// x: [n, n_heads, head_dim]; pair i of a head is (x[i], x[i + head_dim/2]).
template <typename TA>
__global__ void rope_kernel(TA* __restrict__ x, const int32_t* __restrict__ positions,
                            const float* __restrict__ cos_sin, int64_t n, int64_t n_heads, int64_t head_dim) {
  pdl_wait();  // cuda/pdl.cuh
  const int64_t half = head_dim / 2;
  const int64_t total = n * n_heads * half;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = idx % half;
    const int64_t th = idx / half;  // token * n_heads + head
    const int64_t t = th / n_heads;
    const float* cs = cos_sin + int64_t(positions[t]) * head_dim;
    const float c = cs[i], s = cs[half + i];
    TA* xh = x + th * head_dim;
    const float x1 = to_f32(xh[i]), x2 = to_f32(xh[half + i]);
    xh[i] = from_f32<TA>(rope_lo(x1, x2, c, s));
    xh[half + i] = from_f32<TA>(rope_hi(x1, x2, c, s));
  }
}

// q [n, nq, head_dim] then k [n, nk, head_dim] as one index space: one launch for both.
template <typename TA>
__global__ void rope_qk_kernel(TA* __restrict__ q, TA* __restrict__ k, const int32_t* __restrict__ positions,
                               const float* __restrict__ cos_sin, int64_t n, int64_t nq, int64_t nk,
                               int64_t head_dim) {
  pdl_wait();  // cuda/pdl.cuh: q and k may still be being written by the previous kernel
  const int64_t half = head_dim / 2;
  const int64_t total_q = n * nq * half, total = total_q + n * nk * half;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const bool is_q = idx < total_q;
    const int64_t e = is_q ? idx : idx - total_q;
    const int64_t heads = is_q ? nq : nk;
    const int64_t i = e % half;
    const int64_t th = e / half;  // token * heads + head
    const int64_t t = th / heads;
    const float* cs = cos_sin + int64_t(positions[t]) * head_dim;
    const float c = cs[i], s = cs[half + i];
    TA* xh = (is_q ? q : k) + th * head_dim;
    const float x1 = to_f32(xh[i]), x2 = to_f32(xh[half + i]);
    xh[i] = from_f32<TA>(rope_lo(x1, x2, c, s));
    xh[half + i] = from_f32<TA>(rope_hi(x1, x2, c, s));
  }
}

}  // namespace

void rope_qk(void* q, void* k, const int32_t* positions, const float* cos_sin, int64_t n, int64_t nq_heads,
             int64_t nk_heads, int64_t head_dim, DType act) {
  const int64_t total = n * (nq_heads + nk_heads) * (head_dim / 2);
  if (total == 0) return;
  EXL2_DISPATCH_ACT(act, "rope_qk", [&](auto ta) {
    using TA = decltype(ta);
    constexpr int kThreads = 256;
    EXL2_CUDA_LAUNCH_PDL("rope_qk_kernel", rope_qk_kernel<TA>, elementwise_blocks(total, kThreads), kThreads, 0,
                         current_stream(), static_cast<TA*>(q), static_cast<TA*>(k), positions, cos_sin, n, nq_heads,
                         nk_heads, head_dim);
  });
}

void rope(void* x, const int32_t* positions, const float* cos_sin, int64_t n, int64_t n_heads, int64_t head_dim,
          DType act) {
  const int64_t total = n * n_heads * (head_dim / 2);
  if (total == 0) return;
  EXL2_DISPATCH_ACT(act, "rope", [&](auto ta) {
    using TA = decltype(ta);
    constexpr int kThreads = 256;
    EXL2_CUDA_LAUNCH_PDL("rope_kernel", rope_kernel<TA>, elementwise_blocks(total, kThreads), kThreads, 0,
                         current_stream(), static_cast<TA*>(x), positions, cos_sin, n, n_heads, head_dim);
  });
}

}  // namespace exl2::cuda
