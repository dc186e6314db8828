// CPU logit_kl: per row, KL(softmax(z) || softmax(z + d)) = log1p(E_p[expm1(d)]) - E_p[d] (exp in f32; expm1,
// the sums and the result in fp64), rows on the thread pool.
#include <cmath>

#include "backend/cpu/thread_pool.h"
#include "backend/kernels.h"

namespace exl2::cpu {

void logit_kl(const float* z, const float* d, int64_t rows, int64_t vocab, float* out) {
  parallel_for(rows, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* zr = z + r * vocab;
      const float* dr = d + r * vocab;
      float m = zr[0];
      for (int64_t v = 1; v < vocab; ++v) m = std::max(m, zr[v]);
      double s = 0.0, sd = 0.0, sg = 0.0;
      for (int64_t v = 0; v < vocab; ++v) {
        const double w = std::exp(zr[v] - m);
        s += w;
        sd += w * dr[v];
        sg += w * std::expm1(static_cast<double>(dr[v]));
      }
      out[r] = static_cast<float>(std::log1p(sg / s) - sd / s);
    }
  });
}

}  // namespace exl2::cpu
