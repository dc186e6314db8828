// CPU layer_norm: out = (x - mean) / sqrt(var + eps) * w per row, in fp32 (HF CohereLayerNorm: the variance of the
// centred row); out may equal x (each row is read fully into a private f32 buffer before it is written).
#include <cmath>
#include <vector>

#include "backend/cpu/cpu_common.h"
#include "backend/cpu/thread_pool.h"
#include "backend/kernels.h"

namespace exl2::cpu {

void layer_norm(const void* x, const void* w, DType w_dtype, int64_t rows, int64_t hidden, float eps, void* out,
                DType act) {
  std::vector<float> wf(static_cast<size_t>(hidden));
  detail::row_to_f32(w, w_dtype, hidden, wf.data());
  parallel_for(rows, 8, [&](int64_t b, int64_t e) {
    std::vector<float> row(static_cast<size_t>(hidden));
    for (int64_t r = b; r < e; ++r) {
      detail::row_to_f32(detail::at(x, act, r * hidden), act, hidden, row.data());
      float sum = 0.f;
      for (int64_t i = 0; i < hidden; ++i) sum += row[i];
      const float mean = sum / static_cast<float>(hidden);
      for (int64_t i = 0; i < hidden; ++i) row[i] -= mean;
      const float var = detail::dot_f32(row.data(), row.data(), hidden) / static_cast<float>(hidden);
      const float inv = 1.0f / std::sqrt(var + eps);
      for (int64_t i = 0; i < hidden; ++i) row[i] = row[i] * inv * wf[i];
      detail::row_from_f32(row.data(), hidden, detail::at(out, act, r * hidden), act);
    }
  });
}

}  // namespace exl2::cpu
