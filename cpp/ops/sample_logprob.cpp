// ops::argmax_logprob: checks (logits f32 [rows, vocab] contiguous, index i32 [rows], logprob f32 [rows], one
// device, vocab in [1, 2^31 - 2]) and dispatch.
#include <cstdint>

#include "backend/kernels.h"
#include "ops/check.h"
#include "ops/ops.h"

namespace exl2::ops {

void argmax_logprob(const Tensor& logits, Tensor& index, Tensor& logprob) {
  const char* op = "argmax_logprob";
  detail::check_defined_same_device(op, {{"logits", &logits}, {"index", &index}, {"logprob", &logprob}});
  detail::check_dtype(op, "logits", logits, DType::F32);
  detail::check_rank(op, "logits", logits, 2);
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  detail::check_dtype(op, "index", index, DType::I32);
  detail::check_shape(op, "index", index, {rows});
  detail::check_dtype(op, "logprob", logprob, DType::F32);
  detail::check_shape(op, "logprob", logprob, {rows});
  if (rows == 0) return;
  EXL2_CHECK(vocab >= 1 && vocab <= INT32_MAX - 2, op, ": logits must have 1 to 2^31 - 2 columns (the index of a ",
             "bad column is returned as -2 - i), got ", logits.describe());
  EXL2_OPS_DISPATCH(logits.device(), argmax_logprob, logits.data_as<float>(), rows, vocab, index.data_as<int32_t>(),
                    logprob.data_as<float>());
}

}  // namespace exl2::ops
