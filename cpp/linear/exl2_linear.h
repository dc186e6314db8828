// EXL2 quantized linear layer (cpp/quant/ holds the format itself: unpack, dequantize, pack).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "linear/linear.h"

namespace exl2 {

// Loads `<prefix>.q_weight/q_scale/q_scale_max/q_groups/q_invperm[/q_perm][/bias]`, validates them
// (ModelFormatError naming the tensor) and builds the layer for `device`.
std::unique_ptr<Linear> make_exl2_linear(const TensorMap& tensors, const std::string& prefix, int64_t in_features,
                                         int64_t out_features, Device device);
// Tensor-parallel shard: only output columns [col_begin, col_end) (q_weight and q_scale column slices, bias entries;
// q_groups, q_perm and q_scale_max are shared by all columns), itself a valid EXL2 linear of col_end - col_begin
// outputs whose dequantized weight is exactly those rows of the full layer's. col_begin and the width must be
// multiples of 32 (the format pads outputs to 32; q_scale packs 8 columns per word); InvalidArgument otherwise.
std::unique_ptr<Linear> make_exl2_linear_cols(const TensorMap& tensors, const std::string& prefix, int64_t in_features,
                                              int64_t out_features, Device device, int64_t col_begin, int64_t col_end);
// The same for any list of output columns: output i of the layer is column cols[i] of the file's (q_scale nibbles
// moved one by one); cols.size() a positive multiple of 32. Exact as the slice.
std::unique_ptr<Linear> make_exl2_linear_rows(const TensorMap& tensors, const std::string& prefix, int64_t in_features,
                                              int64_t out_features, Device device, const std::vector<int64_t>& cols);

// Bytes the EXL2 linear `<prefix>` (its tensors validated without expected dims) takes on a CUDA device once
// uploaded, each tensor 256-byte aligned (cuda::exl2_upload_bytes: exact, builds the tables once more); -1 in a
// build without the CUDA EXL2 kernels. For the loaders' weight-arena reserve and OOM checks.
int64_t exl2_linear_cuda_bytes(const TensorMap& tensors, const std::string& prefix);

}  // namespace exl2

namespace exl2::cuda {
struct Exl2DeviceWeights;
}  // namespace exl2::cuda

namespace exl2 {
// The CUDA weights of `l` when it is an EXL2 linear on a CUDA device, else null: for ops that drive the EXL2
// kernels over several layers at once (linear/moe_linear.h MoeExperts).
const cuda::Exl2DeviceWeights* exl2_cuda_weights(const Linear& l);
}  // namespace exl2
