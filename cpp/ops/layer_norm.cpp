// ops::layer_norm: checks (x act [..., H], w float [H], out like x, eps >= 0) and dispatch.
#include "backend/kernels.h"
#include "ops/check.h"
#include "ops/ops.h"

namespace exl2::ops {

void layer_norm(const Tensor& x, const Tensor& w, float eps, Tensor& out) {
  const int64_t rows = detail::check_row_norm("layer_norm", x, w, eps, out);
  if (rows == 0) return;
  const int64_t hidden = x.size(-1);
  EXL2_OPS_DISPATCH(x.device(), layer_norm, x.data(), w.data(), w.dtype(), rows, hidden, eps, out.data(), x.dtype());
}

}  // namespace exl2::ops
