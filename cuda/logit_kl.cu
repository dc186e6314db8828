// cuda::logit_kl: one block per row; pass 1 the row's max, pass 2 the fp64 sums of w = exp(z - max), w d and
// w expm1(d) (exp in f32, expm1 in fp64), then log1p(E_p[expm1(d)]) - E_p[d] (ops.h logit_kl).
#include "backend/kernels.h"
#include "cuda/common.cuh"

namespace exl2::cuda {

namespace {

constexpr int kThreads = 256;

__global__ void logit_kl_kernel(const float* z, const float* d, int64_t vocab, float* out) {
  __shared__ float fscratch[32];
  const float* zr = z + blockIdx.x * vocab;
  const float* dr = d + blockIdx.x * vocab;
  float m = -INFINITY;
  for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x) m = fmaxf(m, zr[v]);
  m = block_max(m, fscratch);
  double s = 0.0, sd = 0.0, sg = 0.0;
  for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x) {
    const double w = expf(zr[v] - m);
    const float dv = dr[v];
    s += w;
    sd += w * dv;
    sg += w * expm1(static_cast<double>(dv));
  }
  s = block_sum_f64(s);
  sd = block_sum_f64(sd);
  sg = block_sum_f64(sg);
  if (threadIdx.x == 0) out[blockIdx.x] = static_cast<float>(log1p(sg / s) - sd / s);
}

}  // namespace

void logit_kl(const float* z, const float* d, int64_t rows, int64_t vocab, float* out) {
  if (rows == 0) return;
  logit_kl_kernel<<<static_cast<unsigned>(rows), kThreads, 0, current_stream()>>>(z, d, vocab, out);
  EXL2_CUDA_LAUNCH_CHECK("logit_kl_kernel");
}

}  // namespace exl2::cuda
