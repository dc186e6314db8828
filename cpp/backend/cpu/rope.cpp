// CPU rope: in-place rotary embedding, "rotate_half" (NeoX/HF Llama) convention:
//   x1 = x[:d/2], x2 = x[d/2:];  x1' = x1*cos - x2*sin;  x2' = x2*cos + x1*sin  (cos/sin of the token position).
#include <vector>

#include "backend/cpu/cpu_common.h"
#include "backend/cpu/thread_pool.h"
#include "backend/kernels.h"

namespace exl2::cpu {

void rope(void* x, const int32_t* positions, const float* cos_sin, int64_t n, int64_t n_heads, int64_t head_dim,
          DType act) {
  const int64_t half = head_dim / 2;
  parallel_for(n * n_heads, 32, [&](int64_t b, int64_t e) {
    std::vector<float> row(static_cast<size_t>(head_dim));
    for (int64_t th = b; th < e; ++th) {
      const int64_t t = th / n_heads;
      const float* cs = cos_sin + static_cast<int64_t>(positions[t]) * head_dim;
      void* xr = detail::at(x, act, th * head_dim);
      detail::row_to_f32(xr, act, head_dim, row.data());
      for (int64_t i = 0; i < half; ++i) {
        const float c = cs[i], s = cs[half + i];
        const float x1 = row[i], x2 = row[half + i];
        row[i] = x1 * c - x2 * s;
        row[half + i] = x2 * c + x1 * s;
      }
      detail::row_from_f32(row.data(), head_dim, xr, act);
    }
  });
}

void rope_qk(void* q, void* k, const int32_t* positions, const float* cos_sin, int64_t n, int64_t nq_heads,
             int64_t nk_heads, int64_t head_dim, DType act) {
  rope(q, positions, cos_sin, n, nq_heads, head_dim, act);
  rope(k, positions, cos_sin, n, nk_heads, head_dim, act);
}

}  // namespace exl2::cpu
