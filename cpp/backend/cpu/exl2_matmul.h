// The CPU reference of ops::exl2_matmul (cpp/ops/exl2_matmul.h): scalar, fp32 accumulation, obviously right.
#pragma once

#include <cstdint>

#include "exl2/tensor.h"
#include "quant/exl2_format.h"

namespace exl2::cpu {

// y[n, out] = x[n, in] @ W + bias. W = quant::dequantize_into(t, layout) (f16, original input order); for each
// output the products f32(x) * f32(W) are summed in fp32 in input order, then bias (f32 [out] or null) is added and
// y rounded once to `act` (f32 or f16, x's dtype).
void exl2_matmul(const void* x, DType act, int64_t n, const quant::Exl2Tensors& t, const quant::Exl2Layout& layout,
                 const float* bias, void* y);

}  // namespace exl2::cpu
