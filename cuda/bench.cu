// bench.h: CUDA-event timings of copies, GEMMs and attention for the benchmark scripts.
#include <vector>

#include "backend/kernels.h"
#include "cuda/bench.h"
#include "cuda/common.cuh"
#include "cuda/exl2_gemm.h"

namespace exl2::cuda {

namespace {

__global__ void copy_u4_kernel(const uint4* __restrict__ src, uint4* __restrict__ dst, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}

__global__ void fill_random_f16_kernel(__half* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t x = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    x ^= x >> 15;
    x *= 2246822519u;
    x ^= x >> 13;
    p[i] = __float2half_rn((x & 0xffff) / 32768.f - 1.f);
  }
}

// Device buffer freed on scope exit.
struct Buf {
  void* p = nullptr;
  explicit Buf(size_t bytes) { EXL2_CUDA_CHECK(cudaMalloc(&p, bytes ? bytes : 1)); }
  ~Buf() { cudaFree(p); }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
};

// Seconds per call of f() on the current device's stream (exl2_gemm.h's timer).
double time_it(int iters, const std::function<void()>& f) {
  int dev = 0;
  EXL2_CUDA_CHECK(cudaGetDevice(&dev));
  return time_on_stream_seconds(Device::cuda(dev), f, iters);
}

void fill_random(__half* p, int64_t n, uint32_t seed) {
  fill_random_f16_kernel<<<elementwise_blocks(n, 256), 256, 0, current_stream()>>>(p, n, seed);
  EXL2_CUDA_LAUNCH_CHECK("fill_random_f16_kernel");
}

}  // namespace

double bench_copy_seconds(size_t nbytes, int iters, bool use_kernel) {
  nbytes = (nbytes + 15) / 16 * 16;
  Buf src(nbytes), dst(nbytes);
  EXL2_CUDA_CHECK(cudaMemsetAsync(src.p, 1, nbytes, current_stream()));
  const int64_t n16 = static_cast<int64_t>(nbytes / 16);
  return time_it(iters, [&] {
    if (use_kernel) {
      copy_u4_kernel<<<elementwise_blocks(n16, 512), 512, 0, current_stream()>>>(
          static_cast<const uint4*>(src.p), static_cast<uint4*>(dst.p), n16);
      EXL2_CUDA_LAUNCH_CHECK("copy_u4_kernel");
    } else {
      EXL2_CUDA_CHECK(cudaMemcpyAsync(dst.p, src.p, nbytes, cudaMemcpyDeviceToDevice, current_stream()));
    }
  });
}

double bench_matmul_f16_seconds(int64_t n, int64_t in, int64_t out, int iters) {
  Buf x(size_t(n * in) * 2), w(size_t(out * in) * 2), y(size_t(n * out) * 2);
  fill_random(static_cast<__half*>(x.p), n * in, 1);
  fill_random(static_cast<__half*>(w.p), out * in, 2);
  return time_it(iters, [&] {
    matmul_nt(x.p, w.p, DType::F16, nullptr, DType::F16, y.p, n, in, out, DType::F16);
  });
}

double bench_attention_seconds(int64_t n, int64_t ctx, int64_t n_heads, int64_t n_heads_kv, int64_t head_dim,
                               int iters) {
  constexpr int64_t kPage = 256;
  const int64_t pages = ceil_div(ctx, kPage);
  const int64_t kv_elems = pages * kPage * n_heads_kv * head_dim;
  Buf q(size_t(n * n_heads * head_dim) * 2), o(size_t(n * n_heads * head_dim) * 2), k(size_t(kv_elems) * 2),
      v(size_t(kv_elems) * 2), meta(size_t(2 * n + pages) * 4);
  fill_random(static_cast<__half*>(q.p), n * n_heads * head_dim, 3);
  fill_random(static_cast<__half*>(k.p), kv_elems, 4);
  fill_random(static_cast<__half*>(v.p), kv_elems, 5);
  std::vector<int32_t> host(size_t(2 * n + pages));
  for (int64_t i = 0; i < n; ++i) {
    host[size_t(i)] = static_cast<int32_t>(ctx - n + i);  // positions
    host[size_t(n + i)] = 0;                               // seq_of_token
  }
  for (int64_t p = 0; p < pages; ++p) host[size_t(2 * n + p)] = static_cast<int32_t>(p);
  EXL2_CUDA_CHECK(cudaMemcpyAsync(meta.p, host.data(), host.size() * 4, cudaMemcpyHostToDevice, current_stream()));
  const int32_t* pos = static_cast<const int32_t*>(meta.p);
  const float scale = 1.f / sqrtf(static_cast<float>(head_dim));
  const double s = time_it(iters, [&] {
    attention_paged(q.p, k.p, v.p, DType::F16, pos, pos + n, pos + 2 * n, pages, n, n_heads, n_heads_kv, head_dim,
                    kPage, scale, o.p, DType::F16);
  });
  return s;
}

}  // namespace exl2::cuda
