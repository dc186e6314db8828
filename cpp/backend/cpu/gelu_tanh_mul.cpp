// CPU gelu_tanh_mul: out = gelu_tanh(gate) * up elementwise in fp32 (out may alias gate or up: each chunk is
// loaded before it is stored).
#include <algorithm>
#include <cmath>

#include "backend/cpu/cpu_common.h"
#include "backend/cpu/thread_pool.h"
#include "backend/kernels.h"

namespace exl2::cpu {

void gelu_tanh_mul(const void* gate, const void* up, void* out, int64_t numel, DType act) {
  constexpr int64_t kChunk = 1024;  // elements per private f32 buffer (4 KiB each)
  constexpr float kBeta = 0.7978845608028654f;  // sqrt(2 / pi)
  constexpr float kKappa = 0.044715f;
  parallel_for((numel + kChunk - 1) / kChunk, 4, [&](int64_t b, int64_t e) {
    float g[kChunk], u[kChunk];
    for (int64_t c = b; c < e; ++c) {
      const int64_t i0 = c * kChunk, len = std::min(kChunk, numel - i0);
      detail::row_to_f32(detail::at(gate, act, i0), act, len, g);
      detail::row_to_f32(detail::at(up, act, i0), act, len, u);
      for (int64_t i = 0; i < len; ++i) {
        const float x = g[i];
        g[i] = 0.5f * x * (1.0f + std::tanh(kBeta * (x + kKappa * x * x * x))) * u[i];
      }
      detail::row_from_f32(g, len, detail::at(out, act, i0), act);
    }
  });
}

}  // namespace exl2::cpu
