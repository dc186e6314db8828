// ops::layer_norm: checks (x act [..., H], w float [H], out like x, eps >= 0) and dispatch.
#include <cmath>

#include "backend/kernels.h"
#include "ops/check.h"
#include "ops/ops.h"

namespace exl2::ops {

void layer_norm(const Tensor& x, const Tensor& w, float eps, Tensor& out) {
  const char* op = "layer_norm";
  detail::check_defined_same_device(op, {{"x", &x}, {"w", &w}, {"out", &out}});
  detail::check_act(op, "x", x);
  EXL2_CHECK(x.dim() >= 1, op, ": x must have >= 1 dimension, got ", x.describe());
  detail::check_float(op, "w", w);
  const int64_t hidden = x.size(-1);
  detail::check_shape(op, "w", w, {hidden});
  detail::check_same_dtype(op, "out", out, "x", x);
  detail::check_shape(op, "out", out, x.shape());
  EXL2_CHECK(std::isfinite(eps) && eps >= 0.0f, op, ": eps must be a finite number >= 0, got ", eps);
  const int64_t rows = hidden ? x.numel() / hidden : 0;
  if (rows == 0 || hidden == 0) return;
  EXL2_OPS_DISPATCH(x.device(), layer_norm, x.data(), w.data(), w.dtype(), rows, hidden, eps, out.data(), x.dtype());
}

}  // namespace exl2::ops
