// EXL2 quantized linear layer (cpp/quant/ holds the format itself: unpack, dequantize, pack).
#pragma once

#include <memory>
#include <string>

#include "linear/linear.h"

namespace exl2 {

// Loads `<prefix>.q_weight/q_scale/q_scale_max/q_groups/q_invperm[/q_perm][/bias]`, validates them
// (ModelFormatError naming the tensor) and builds the layer for `device`.
std::unique_ptr<Linear> make_exl2_linear(const TensorMap& tensors, const std::string& prefix, int64_t in_features,
                                         int64_t out_features, Device device);

}  // namespace exl2
