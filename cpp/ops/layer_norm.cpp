// ops::layer_norm: checks (x act [..., H], w float [H] or [G, H] dividing the rows, out like x, eps >= 0) and
// dispatch.
#include "backend/kernels.h"
#include "ops/check.h"
#include "ops/ops.h"

namespace exl2::ops {

void layer_norm(const Tensor& x, const Tensor& w, float eps, Tensor& out) {
  const bool per_row = w.defined() && w.dim() == 2;  // [G, H]: checked as its first row, then G against the rows
  const int64_t g = per_row ? w.size(0) : 1;
  const Tensor w0 = per_row && g > 0 ? w.view({w.numel()}).slice(0, w.size(1)) : w;
  const int64_t rows = detail::check_row_norm("layer_norm", x, w0, eps, out);
  EXL2_CHECK(g >= 1 && rows % g == 0, "layer_norm: w [", g, ", H] needs a row count divisible by ", g, ", got ",
             rows, " rows");
  if (rows == 0) return;
  const int64_t hidden = x.size(-1);
  EXL2_OPS_DISPATCH(x.device(), layer_norm, x.data(), w.data(), w.dtype(), g, rows, hidden, eps, out.data(),
                    x.dtype());
}

}  // namespace exl2::ops
