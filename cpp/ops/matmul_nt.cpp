// ops::matmul_nt: checks (x act [..., in], w float [out, in], bias f32/f16 [out] or undefined,
// y like x with last dim out, y not aliasing x) and dispatch.
#include "backend/kernels.h"
#include "ops/check.h"
#include "ops/ops.h"

namespace exl2::ops {

void matmul_nt(const Tensor& x, const Tensor& w, const Tensor& bias, Tensor& y) {
  const char* op = "matmul_nt";
  detail::check_defined_same_device(op, {{"x", &x}, {"w", &w}, {"y", &y}});
  detail::check_act(op, "x", x);
  EXL2_CHECK(x.dim() >= 1, op, ": x must have >= 1 dimension, got ", x.describe());
  detail::check_float(op, "w", w);
  detail::check_rank(op, "w", w, 2);
  const int64_t out = w.size(0), in = w.size(1);
  EXL2_CHECK(x.size(-1) == in, op, ": x's last dim must be ", in, " (w is [out, in] = ", shape_str(w.shape()),
             "), got ", dtype_name(x.dtype()), shape_str(x.shape()));
  Shape y_shape = x.shape();
  y_shape.back() = out;
  detail::check_same_dtype(op, "y", y, "x", x);
  detail::check_shape(op, "y", y, y_shape);
  detail::check_no_overlap(op, "y", y, "x", x);
  if (bias.defined()) {
    detail::check_defined_same_device(op, {{"x", &x}, {"bias", &bias}});
    EXL2_CHECK(bias.dtype() == DType::F32 || bias.dtype() == DType::F16, op, ": bias must be f32 or f16, got ",
               bias.describe());
    detail::check_shape(op, "bias", bias, {out});
  }
  const int64_t n = in ? x.numel() / in : shape_numel(Shape(x.shape().begin(), x.shape().end() - 1));
  if (n == 0 || out == 0) return;
  EXL2_OPS_DISPATCH(x.device(), matmul_nt, x.data(), w.data(), w.dtype(), bias.defined() ? bias.data() : nullptr,
                    bias.defined() ? bias.dtype() : DType::F32, y.data(), n, in, out, x.dtype());
}

}  // namespace exl2::ops
