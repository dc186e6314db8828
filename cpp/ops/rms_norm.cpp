// ops::rms_norm: checks (x act [..., H], w float [H], out like x, eps >= 0) and dispatch.
#include <cmath>

#include "backend/kernels.h"
#include "ops/check.h"
#include "ops/ops.h"

namespace exl2::ops {

void rms_norm(const Tensor& x, const Tensor& w, float eps, Tensor& out) {
  const int64_t rows = detail::check_row_norm("rms_norm", x, w, eps, out);
  if (rows == 0) return;
  const int64_t hidden = x.size(-1);
  EXL2_OPS_DISPATCH(x.device(), rms_norm, x.data(), w.data(), w.dtype(), rows, hidden, eps, out.data(), x.dtype());
}

void add_rms_norm(Tensor& h, const Tensor& r, const Tensor& w, float eps, Tensor& out) {
  const char* op = "add_rms_norm";
  detail::check_defined_same_device(op, {{"h", &h}, {"r", &r}, {"w", &w}, {"out", &out}});
  detail::check_act(op, "h", h);
  EXL2_CHECK(h.dim() >= 1, op, ": h must have >= 1 dimension, got ", h.describe());
  detail::check_same_dtype(op, "r", r, "h", h);
  detail::check_shape(op, "r", r, h.shape());
  detail::check_float(op, "w", w);
  const int64_t hidden = h.size(-1);
  detail::check_shape(op, "w", w, {hidden});
  detail::check_same_dtype(op, "out", out, "h", h);
  detail::check_shape(op, "out", out, h.shape());
  EXL2_CHECK(out.data() != h.data() || h.numel() == 0, op, ": out must not alias h (h keeps the sum)");
  EXL2_CHECK(std::isfinite(eps) && eps >= 0.0f, op, ": eps must be a finite number >= 0, got ", eps);
  const int64_t rows = hidden ? h.numel() / hidden : 0;
  if (rows == 0 || hidden == 0) return;
  EXL2_OPS_DISPATCH(h.device(), add_rms_norm, h.data(), r.data(), w.data(), w.dtype(), rows, hidden, eps, out.data(),
                    h.dtype());
}

}  // namespace exl2::ops
