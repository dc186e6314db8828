// CPU layer_norm: out = (x - mean) / sqrt(var + eps) * w (row r: w's row r % w_rows) per row, in fp32 (HF CohereLayerNorm: the variance of the
// centred row); out may equal x (each row is read fully into a private f32 buffer before it is written).
#include <cmath>
#include <vector>

#include "backend/cpu/cpu_common.h"
#include "backend/cpu/thread_pool.h"
#include "backend/kernels.h"

namespace exl2::cpu {

void layer_norm(const void* x, const void* w, DType w_dtype, int64_t w_rows, int64_t rows, int64_t hidden, float eps,
                void* out, DType act) {
  detail::norm_rows(x, w, w_dtype, rows, hidden, out, act, [&](float* row, const float* wf) {
    float sum = 0.f;
    for (int64_t i = 0; i < hidden; ++i) sum += row[i];
    const float mean = sum / static_cast<float>(hidden);
    for (int64_t i = 0; i < hidden; ++i) row[i] -= mean;
    const float var = detail::dot_f32(row, row, hidden) / static_cast<float>(hidden);
    const float inv = 1.0f / std::sqrt(var + eps);
    for (int64_t i = 0; i < hidden; ++i) row[i] = row[i] * inv * wf[i];
  }, w_rows);
}

}  // namespace exl2::cpu
