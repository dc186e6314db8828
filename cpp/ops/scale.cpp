// ops::scale: checks (x, out: same float dtype f32/f16 and shape; s finite, cap finite >= 0) and dispatch.
#include <cmath>

#include "backend/kernels.h"
#include "ops/check.h"
#include "ops/ops.h"

namespace exl2::ops {

void scale(const Tensor& x, float s, float cap, Tensor& out) {
  const char* op = "scale";
  detail::check_defined_same_device(op, {{"x", &x}, {"out", &out}});
  detail::check_act(op, "x", x);
  detail::check_same_dtype(op, "out", out, "x", x);
  detail::check_shape(op, "out", out, x.shape());
  EXL2_CHECK(std::isfinite(s), op, ": s must be finite, got ", s);
  EXL2_CHECK(std::isfinite(cap) && cap >= 0.0f, op, ": cap must be a finite number >= 0 (0: none), got ", cap);
  if (x.numel() == 0) return;
  EXL2_OPS_DISPATCH(x.device(), scale, x.data(), out.data(), x.numel(), s, cap, x.dtype());
}

}  // namespace exl2::ops
