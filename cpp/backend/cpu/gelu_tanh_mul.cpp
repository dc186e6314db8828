// CPU gelu_tanh_mul: out = gelu_tanh(gate) * up elementwise in fp32 (out may alias gate or up: each chunk is
// loaded before it is stored).
#include <algorithm>
#include <cmath>

#include "backend/cpu/cpu_common.h"
#include "backend/cpu/thread_pool.h"
#include "backend/kernels.h"

namespace exl2::cpu {

void gelu_tanh_mul(const void* gate, const void* up, void* out, int64_t numel, DType act) {
  constexpr float kBeta = 0.7978845608028654f;  // sqrt(2 / pi)
  constexpr float kKappa = 0.044715f;
  detail::gated_chunks(gate, up, out, numel, act, [](float* g, const float* u, int64_t len) {
    for (int64_t i = 0; i < len; ++i) {
      const float x = g[i];
      g[i] = 0.5f * x * (1.0f + std::tanh(kBeta * (x + kKappa * x * x * x))) * u[i];
    }
  });
}

}  // namespace exl2::cpu
