// ops::sample_logprob and ops::argmax_logprob (its greedy case): checks (logits f32 [rows, vocab] contiguous,
// params u8 [rows, sizeof(SampleParams)], index i32 [rows], logprob f32 [rows], one device, vocab in
// [1, 2^31 - 2], the params' ranges on the host) and dispatch.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "backend/kernels.h"
#include "ops/check.h"
#include "ops/ops.h"

namespace exl2::ops {

namespace {

void check_outputs(const char* op, const Tensor& logits, const Tensor& index, const Tensor& logprob) {
  detail::check_dtype(op, "logits", logits, DType::F32);
  detail::check_rank(op, "logits", logits, 2);
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  detail::check_dtype(op, "index", index, DType::I32);
  detail::check_shape(op, "index", index, {rows});
  detail::check_dtype(op, "logprob", logprob, DType::F32);
  detail::check_shape(op, "logprob", logprob, {rows});
  EXL2_CHECK(rows == 0 || (vocab >= 1 && vocab <= INT32_MAX - 2), op, ": logits must have 1 to 2^31 - 2 columns ",
             "(the index of a bad column is returned as -2 - i), got ", logits.describe());
}

void check_params(const char* op, const SampleParams& p, int64_t r) {
  EXL2_CHECK(std::isfinite(p.temperature) && p.temperature >= 0.0f && p.top_k >= 0 &&
                 p.top_p > 0.0f && p.top_p <= 1.0f && p.min_p >= 0.0f && p.min_p < 1.0f && p.u >= 0.0 && p.u < 1.0,
             op, ": params[", r, "] = (u ", p.u, ", temperature ", p.temperature, ", top_k ", p.top_k, ", top_p ",
             p.top_p, ", min_p ", p.min_p, ") out of range: expected u in [0, 1), temperature finite >= 0, ",
             "top_k >= 0, top_p in (0, 1], min_p in [0, 1) (SamplerSettings' ranges)");
}

}  // namespace

void argmax_logprob(const Tensor& logits, Tensor& index, Tensor& logprob) {
  const char* op = "argmax_logprob";
  detail::check_defined_same_device(op, {{"logits", &logits}, {"index", &index}, {"logprob", &logprob}});
  check_outputs(op, logits, index, logprob);
  const int64_t rows = logits.size(0);
  if (rows == 0) return;
  EXL2_OPS_DISPATCH(logits.device(), sample_logprob, logits.data_as<float>(), nullptr, rows, logits.size(1),
                    index.data_as<int32_t>(), logprob.data_as<float>());
}

void sample_logprob(const Tensor& logits, const Tensor& params, Tensor& index, Tensor& logprob) {
  const char* op = "sample_logprob";
  detail::check_defined_same_device(
      op, {{"logits", &logits}, {"params", &params}, {"index", &index}, {"logprob", &logprob}});
  check_outputs(op, logits, index, logprob);
  const int64_t rows = logits.size(0);
  detail::check_dtype(op, "params", params, DType::U8);
  detail::check_shape(op, "params", params, {rows, static_cast<int64_t>(sizeof(SampleParams))});
  if (rows == 0) return;
  if (params.device().is_cpu()) {  // on the device the caller (the engine) took them from SamplerSettings
    for (int64_t r = 0; r < rows; ++r) {
      SampleParams p;
      std::memcpy(&p, static_cast<const char*>(params.data()) + r * sizeof(SampleParams), sizeof(p));
      check_params(op, p, r);
    }
  }
  EXL2_OPS_DISPATCH(logits.device(), sample_logprob, logits.data_as<float>(),
                    static_cast<const SampleParams*>(params.data()), rows, logits.size(1), index.data_as<int32_t>(),
                    logprob.data_as<float>());
}

}  // namespace exl2::ops
