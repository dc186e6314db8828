// The grouped expert matmuls of a MoE projection on CUDA (linear/moe_linear.h MoeExperts): ONE launch over the
// experts that the grouping (ops::moe_group) marks active, reading their weights only. Host types only.
//   EXL2 (v4 layout): the v4 GEMV's decoders and chunk loops (cuda/exl2_gemv_v4.cuh) in a kernel whose blocks take
//     (column block, k slice) x (active slot) x (row group of 16): each block reads the expert id from `active`, its
//     rows from offsets / perm and its layer's tables from a device array of per-expert descriptors.
//   dense f16: a warp per output column, 8 rows of x per block, weights [out, in] per expert.
// Deterministic: no atomics on results (k slices write fp32 partials that one reduce kernel adds in slice order).
#pragma once

#include <cstdint>
#include <vector>

#include "exl2/tensor.h"

namespace exl2::cuda {

struct Exl2DeviceWeights;

// Rows of x up to which the grouped kernels are used (an expert's rows in row groups of 16; above it
// MoeExperts runs each expert's rows through its linear, after a host read of the counts).
constexpr int64_t kMoeGroupedMaxRows = 64;

// The experts' descriptors on the device, built once at load.
struct MoeExl2Table {
  Tensor table;  // u8: the kernel's per-expert descriptors
  int64_t n_experts = 0, in = 0, out = 0, out_pad = 0;
  int max_chunks = 0;
  std::vector<int64_t> weight_bytes;  // [n_experts]: bytes of each expert's v4 q_weight (what a pass reads)
};
// False (t unchanged) when the experts do not all qualify: every one an EXL2 layer in the v4 layout (not v4k), one
// device, same in / out.
bool moe_exl2_table(const std::vector<const Exl2DeviceWeights*>& ws, MoeExl2Table& t);

// y[p] = x[src(p)] @ W_e + b_e for every position p of every active expert e (ops.h moe_group): src(p) =
// perm[p] / gather_k (gather_k > 0; x [rows, in]) or p (gather_k == 0; x [n_pairs, in]); x, y f16, y [n_pairs, out].
// max_rows: the most positions one expert can own (rows of the step), <= kMoeGroupedMaxRows. part: fp32 workspace,
// grown here (before a graph capture: call once with the step's shape first). bytes_read: null, or a device u64
// that every block adds the weight bytes it streamed to.
void moe_exl2_forward(const MoeExl2Table& t, const void* x, int64_t gather_k, const int32_t* offsets,
                      const int32_t* perm, const int32_t* active, int64_t n_pairs, int64_t max_rows, void* y,
                      Tensor& part, uint64_t* bytes_read);

// The dense f16 experts: w_ptrs a device array [n_experts] of f16 [out, in] weights (contiguous rows), no bias.
void moe_dense_forward(const void* const* w_ptrs, int64_t n_experts, int64_t in, int64_t out, const void* x,
                       int64_t gather_k, const int32_t* offsets, const int32_t* perm, const int32_t* active,
                       int64_t n_pairs, int64_t max_rows, void* y, uint64_t* bytes_read);

}  // namespace exl2::cuda
