// The one compiled copy of the sampler's f64-folded exp-sum (see sum_exp.h).
#include "backend/cpu/sum_exp.h"

namespace exl2::cpu {

double sum_exp(const float* x, int64_t n, float shift) {
  double total = 0.0;
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    float acc[8] = {};
    for (int j = 0; j < 64; j += 8)
      for (int k = 0; k < 8; ++k) acc[k] += fast_exp(x[i + j + k] - shift);
    total += static_cast<double>((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  }
  for (; i < n; ++i) total += fast_exp(x[i] - shift);
  return total;
}

}  // namespace exl2::cpu
