// CPU silu_mul: out = silu(gate) * up = gate / (1 + exp(-gate)) * up, elementwise in fp32 (out may alias
// gate or up: each chunk is loaded before it is stored).
#include <algorithm>
#include <cmath>

#include "backend/cpu/cpu_common.h"
#include "backend/cpu/thread_pool.h"
#include "backend/kernels.h"

namespace exl2::cpu {

void silu_mul(const void* gate, const void* up, void* out, int64_t numel, DType act) {
  constexpr int64_t kChunk = 1024;  // elements per private f32 buffer (4 KiB each)
  parallel_for((numel + kChunk - 1) / kChunk, 4, [&](int64_t b, int64_t e) {
    float g[kChunk], u[kChunk];
    for (int64_t c = b; c < e; ++c) {
      const int64_t i0 = c * kChunk, len = std::min(kChunk, numel - i0);
      detail::row_to_f32(detail::at(gate, act, i0), act, len, g);
      detail::row_to_f32(detail::at(up, act, i0), act, len, u);
      for (int64_t i = 0; i < len; ++i) g[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
      detail::row_from_f32(g, len, detail::at(out, act, i0), act);
    }
  });
}

}  // namespace exl2::cpu
