// CPU add: out = a + b elementwise in fp32 (out may alias a or b: each chunk is loaded before it is stored).
#include <algorithm>

#include "backend/cpu/cpu_common.h"
#include "backend/cpu/thread_pool.h"
#include "backend/kernels.h"

namespace exl2::cpu {

void add(const void* a, const void* b, void* out, int64_t numel, DType act) {
  if (act == DType::F32) {
    const float* af = static_cast<const float*>(a);
    const float* bf = static_cast<const float*>(b);
    float* of = static_cast<float*>(out);
    parallel_for(numel, 1 << 14, [&](int64_t s, int64_t e) {
      for (int64_t i = s; i < e; ++i) of[i] = af[i] + bf[i];
    });
    return;
  }
  constexpr int64_t kChunk = 1024;
  parallel_for((numel + kChunk - 1) / kChunk, 16, [&](int64_t s, int64_t e) {
    float x[kChunk], y[kChunk];
    for (int64_t c = s; c < e; ++c) {
      const int64_t i0 = c * kChunk, len = std::min(kChunk, numel - i0);
      detail::row_to_f32(detail::at(a, act, i0), act, len, x);
      detail::row_to_f32(detail::at(b, act, i0), act, len, y);
      for (int64_t i = 0; i < len; ++i) x[i] += y[i];
      detail::row_from_f32(x, len, detail::at(out, act, i0), act);
    }
  });
}

}  // namespace exl2::cpu
