// ops::rope: checks (x act [n, n_heads, head_dim] with even head_dim, positions i32 [n] < max_pos on CPU,
// cos_sin f32 [max_pos, head_dim]) and dispatch.
#include "backend/kernels.h"
#include "ops/check.h"
#include "ops/ops.h"

namespace exl2::ops {

void rope(Tensor& x, const Tensor& positions, const Tensor& cos_sin) {
  const char* op = "rope";
  detail::check_defined_same_device(op, {{"x", &x}, {"positions", &positions}, {"cos_sin", &cos_sin}});
  detail::check_act(op, "x", x);
  detail::check_rank(op, "x", x, 3);
  const int64_t n = x.size(0), n_heads = x.size(1), head_dim = x.size(2);
  EXL2_CHECK(head_dim % 2 == 0, op, ": x's head_dim (last dim) must be even, got ", x.describe());
  detail::check_dtype(op, "positions", positions, DType::I32);
  detail::check_shape(op, "positions", positions, {n});
  detail::check_dtype(op, "cos_sin", cos_sin, DType::F32);
  detail::check_rank(op, "cos_sin", cos_sin, 2);
  const int64_t max_pos = cos_sin.size(0);
  detail::check_shape(op, "cos_sin", cos_sin, {max_pos, head_dim});
  if (x.numel() == 0) return;
  if (positions.device().is_cpu()) {
    const int32_t* p = positions.data_as<int32_t>();
    for (int64_t i = 0; i < n; ++i)
      EXL2_CHECK(p[i] >= 0 && p[i] < max_pos, op, ": positions[", i, "] must be in [0, ", max_pos,
                 ") (rows of cos_sin), got ", p[i], "; build the RoPE table for a longer context");
  }
  EXL2_OPS_DISPATCH(x.device(), rope, x.data(), positions.data_as<int32_t>(), cos_sin.data_as<float>(), n, n_heads,
                    head_dim, x.dtype());
}

}  // namespace exl2::ops
