// CPU convert: dst = src between f32/f16/bf16 (through f32, round-to-nearest-even; same dtype copies).
#include <algorithm>
#include <cstring>

#include "backend/cpu/cpu_common.h"
#include "backend/cpu/thread_pool.h"
#include "backend/kernels.h"

namespace exl2::cpu {

void convert(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t numel) {
  if (src_dtype == dst_dtype) {
    if (numel > 0 && src != dst) std::memcpy(dst, src, static_cast<size_t>(numel) * dtype_size(src_dtype));
    return;
  }
  constexpr int64_t kChunk = 2048;
  parallel_for((numel + kChunk - 1) / kChunk, 16, [&](int64_t b, int64_t e) {
    float buf[kChunk];
    for (int64_t c = b; c < e; ++c) {
      const int64_t i0 = c * kChunk, len = std::min(kChunk, numel - i0);
      detail::row_to_f32(detail::at(src, src_dtype, i0), src_dtype, len, buf);
      detail::row_from_f32(buf, len, detail::at(dst, dst_dtype, i0), dst_dtype);
    }
  });
}

}  // namespace exl2::cpu
