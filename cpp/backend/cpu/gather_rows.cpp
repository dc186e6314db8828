// CPU gather_rows: out[i] = x[idx[i]] by row memcpy (idx clamped like the CUDA kernel; ops:: checks it first).
#include <cstring>

#include "backend/kernels.h"

namespace exl2::cpu {

void gather_rows(const void* x, const int32_t* idx, int64_t m, int64_t rows, int64_t row_bytes, void* out) {
  const char* src = static_cast<const char*>(x);
  char* dst = static_cast<char*>(out);
  for (int64_t i = 0; i < m; ++i) {
    int64_t r = idx[i];
    r = r < 0 ? 0 : (r >= rows ? rows - 1 : r);
    std::memcpy(dst + i * row_bytes, src + r * row_bytes, static_cast<size_t>(row_bytes));
  }
}

}  // namespace exl2::cpu
