// ops::gather_rows: checks (x act [rows, H], idx i32 [m] in range on CPU, out same dtype [m, H], no aliasing)
// and dispatch.
#include "backend/kernels.h"
#include "ops/check.h"
#include "ops/ops.h"

namespace exl2::ops {

void gather_rows(const Tensor& x, const Tensor& idx, Tensor& out) {
  const char* op = "gather_rows";
  detail::check_defined_same_device(op, {{"x", &x}, {"idx", &idx}, {"out", &out}});
  detail::check_act(op, "x", x);
  detail::check_rank(op, "x", x, 2);
  detail::check_dtype(op, "idx", idx, DType::I32);
  detail::check_rank(op, "idx", idx, 1);
  detail::check_same_dtype(op, "out", out, "x", x);
  const int64_t rows = x.size(0), hidden = x.size(1), m = idx.size(0);
  detail::check_shape(op, "out", out, {m, hidden});
  detail::check_no_overlap(op, "out", out, "x", x);
  if (m == 0 || hidden == 0) return;
  EXL2_CHECK(rows > 0, op, ": x must have at least one row to gather from, got ", x.describe());
  if (idx.device().is_cpu()) {
    const int32_t* p = idx.data_as<int32_t>();
    for (int64_t i = 0; i < m; ++i)
      EXL2_CHECK(p[i] >= 0 && p[i] < rows, op, ": idx[", i, "] must be a row of x in [0, ", rows, "), got ", p[i]);
  }
  EXL2_OPS_DISPATCH(x.device(), gather_rows, x.data(), idx.data_as<int32_t>(), m, rows,
                    hidden * static_cast<int64_t>(dtype_size(x.dtype())), out.data());
}

}  // namespace exl2::ops
