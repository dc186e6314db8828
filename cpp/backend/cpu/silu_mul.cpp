// CPU silu_mul: out = silu(gate) * up = gate / (1 + exp(-gate)) * up, elementwise in fp32 (out may alias
// gate or up: each chunk is loaded before it is stored).
#include <algorithm>

#include "backend/cpu/cpu_common.h"
#include "backend/cpu/thread_pool.h"
#include "backend/kernels.h"

namespace exl2::cpu {

void silu_mul(const void* gate, const void* up, void* out, int64_t numel, DType act) {
  detail::gated_chunks(gate, up, out, numel, act, detail::silu_mul_f32);
}

}  // namespace exl2::cpu
