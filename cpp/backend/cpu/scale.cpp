// CPU scale: out = x * s, then (cap > 0) cap * tanh(out / cap), elementwise in fp32 (out may alias x).
#include <algorithm>
#include <cmath>

#include "backend/cpu/cpu_common.h"
#include "backend/cpu/thread_pool.h"
#include "backend/kernels.h"

namespace exl2::cpu {

void scale(const void* x, void* out, int64_t numel, float s, float cap, DType act) {
  constexpr int64_t kChunk = 1024;
  parallel_for((numel + kChunk - 1) / kChunk, 16, [&](int64_t b, int64_t e) {
    float v[kChunk];
    for (int64_t c = b; c < e; ++c) {
      const int64_t i0 = c * kChunk, len = std::min(kChunk, numel - i0);
      detail::row_to_f32(detail::at(x, act, i0), act, len, v);
      for (int64_t i = 0; i < len; ++i) {
        v[i] *= s;
        if (cap > 0.f) v[i] = cap * std::tanh(v[i] / cap);
      }
      detail::row_from_f32(v, len, detail::at(out, act, i0), act);
    }
  });
}

}  // namespace exl2::cpu
