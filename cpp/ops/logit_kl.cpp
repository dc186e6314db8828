// ops::logit_kl: checks (z, d f32 [rows, vocab], out f32 [rows], one device) and dispatch.
#include "backend/kernels.h"
#include "ops/check.h"
#include "ops/ops.h"

namespace exl2::ops {

void logit_kl(const Tensor& z, const Tensor& d, Tensor& out) {
  const char* op = "logit_kl";
  detail::check_defined_same_device(op, {{"z", &z}, {"d", &d}, {"out", &out}});
  detail::check_dtype(op, "z", z, DType::F32);
  detail::check_rank(op, "z", z, 2);
  detail::check_dtype(op, "d", d, DType::F32);
  detail::check_shape(op, "d", d, z.shape());
  detail::check_dtype(op, "out", out, DType::F32);
  detail::check_shape(op, "out", out, {z.size(0)});
  const int64_t rows = z.size(0), vocab = z.size(1);
  EXL2_CHECK(rows == 0 || vocab >= 1, op, ": z needs at least one column, got ", z.describe());
  if (rows == 0) return;
  EXL2_OPS_DISPATCH(z.device(), logit_kl, z.data_as<float>(), d.data_as<float>(), rows, vocab,
                    out.data_as<float>());
}

}  // namespace exl2::ops
