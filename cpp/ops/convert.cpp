// ops::convert: checks (src, dst float dtypes, same shape and device) and dispatch.
#include "backend/kernels.h"
#include "ops/check.h"
#include "ops/ops.h"

namespace exl2::ops {

void convert(const Tensor& src, Tensor& dst) {
  const char* op = "convert";
  detail::check_defined_same_device(op, {{"src", &src}, {"dst", &dst}});
  detail::check_float(op, "src", src);
  detail::check_float(op, "dst", dst);
  detail::check_shape(op, "dst", dst, src.shape());
  if (src.numel() == 0) return;
  EXL2_OPS_DISPATCH(src.device(), convert, src.data(), src.dtype(), dst.data(), dst.dtype(), src.numel());
}

}  // namespace exl2::ops
