// ops::add: checks (a, b, out: same act dtype and shape) and dispatch.
#include "backend/kernels.h"
#include "ops/check.h"
#include "ops/ops.h"

namespace exl2::ops {

void add(const Tensor& a, const Tensor& b, Tensor& out) {
  const char* op = "add";
  detail::check_defined_same_device(op, {{"a", &a}, {"b", &b}, {"out", &out}});
  detail::check_act(op, "a", a);
  detail::check_same_dtype(op, "b", b, "a", a);
  detail::check_same_dtype(op, "out", out, "a", a);
  detail::check_shape(op, "b", b, a.shape());
  detail::check_shape(op, "out", out, a.shape());
  if (a.numel() == 0) return;
  EXL2_OPS_DISPATCH(a.device(), add, a.data(), b.data(), out.data(), a.numel(), a.dtype());
}

}  // namespace exl2::ops
