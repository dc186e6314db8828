// CPU rms_norm: out = x / sqrt(mean(x^2) + eps) * w per row, in fp32 (out may equal x: each row is read fully
// into a private f32 buffer before it is written).
#include <cmath>
#include <vector>

#include "backend/cpu/cpu_common.h"
#include "backend/cpu/thread_pool.h"
#include "backend/kernels.h"

namespace exl2::cpu {

void rms_norm(const void* x, const void* w, DType w_dtype, int64_t rows, int64_t hidden, float eps, void* out,
              DType act) {
  detail::norm_rows(x, w, w_dtype, rows, hidden, out, act, [&](float* row, const float* wf) {
    const float ss = detail::dot_f32(row, row, hidden);
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(hidden) + eps);
    for (int64_t i = 0; i < hidden; ++i) row[i] = row[i] * inv * wf[i];
  });
}

void add_rms_norm(void* h, const void* r, const void* w, DType w_dtype, int64_t rows, int64_t hidden, float eps,
                  void* out, DType act) {
  add(h, r, h, rows * hidden, act);
  rms_norm(h, w, w_dtype, rows, hidden, eps, out, act);
}

}  // namespace exl2::cpu
