// cuda::matmul_nt: y[n, out] = x[n, in] @ w[out, in]^T (+ bias) via cublasGemmEx with fp32 compute for
// f16*f16 and f32*f32; other dtype pairs (and option cuda_reference) use a simple tiled fp32-accumulating kernel.
#include <climits>

#include "backend/kernels.h"
#include "cuda/common.cuh"
#include "cuda/pdl.cuh"

namespace exl2::cuda {

namespace {

constexpr int kTile = 16;

// Reference GEMM: one output per thread, 16x16 tiles, fp32 accumulation, bias added before the one rounding.
template <typename TA, typename TW, typename TB>
__global__ void matmul_nt_ref_kernel(const TA* __restrict__ x, const TW* __restrict__ w, const TB* __restrict__ bias,
                                     TA* __restrict__ y, int64_t n, int64_t in, int64_t out) {
  __shared__ float xs[kTile][kTile + 1];
  __shared__ float ws[kTile][kTile + 1];
  pdl_wait();  // cuda/pdl.cuh
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t r0 = int64_t(blockIdx.y) * kTile, c0 = int64_t(blockIdx.x) * kTile;
  float acc = 0.f;
  for (int64_t k0 = 0; k0 < in; k0 += kTile) {
    const int64_t k = k0 + tx;
    xs[ty][tx] = (r0 + ty < n && k < in) ? to_f32(x[(r0 + ty) * in + k]) : 0.f;
    ws[ty][tx] = (c0 + ty < out && k < in) ? to_f32(w[(c0 + ty) * in + k]) : 0.f;
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kTile; ++kk) acc = fmaf(xs[ty][kk], ws[tx][kk], acc);
    __syncthreads();
  }
  pdl_launch_dependents();
  const int64_t r = r0 + ty, c = c0 + tx;
  if (r < n && c < out) {
    if (bias) acc += to_f32(bias[c]);
    y[r * out + c] = from_f32<TA>(acc);
  }
}

// y[r, c] = bias[c]: the GEMM then runs with beta = 1, so the bias joins the fp32 sum before the one rounding
// (exact for f16 bias into f16 y).
template <typename TA, typename TB>
__global__ void fill_bias_kernel(const TB* __restrict__ bias, TA* __restrict__ y, int64_t n, int64_t out) {
  pdl_wait();  // cuda/pdl.cuh: y may still be read by the previous kernel
  const int64_t total = n * out;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x)
    y[i] = from_f32<TA>(to_f32(bias[i % out]));
}

template <typename TA, typename TW>
void launch_ref(const void* x, const void* w, const void* bias, DType bias_dtype, void* y, int64_t n, int64_t in,
                int64_t out) {
  dim3 block(kTile, kTile);
  dim3 grid(static_cast<unsigned>(ceil_div(out, kTile)), static_cast<unsigned>(ceil_div(n, kTile)));
  auto go = [&](auto tb) {
    using TB = decltype(tb);
    EXL2_CUDA_LAUNCH_PDL("matmul_nt_ref_kernel", matmul_nt_ref_kernel<TA, TW, TB>, grid, block, 0, current_stream(),
                         static_cast<const TA*>(x), static_cast<const TW*>(w), static_cast<const TB*>(bias),
                         static_cast<TA*>(y), n, in, out);
  };
  if (bias && bias_dtype == DType::F16) go(__half{});
  else go(float{});  // bias f32 or null
}

}  // namespace

void matmul_nt(const void* x, const void* w, DType w_dtype, const void* bias, DType bias_dtype, void* y, int64_t n,
               int64_t in, int64_t out, DType act) {
  if (n == 0 || out == 0) return;
  if (bias) {
    EXL2_CHECK_KIND(Unsupported, bias_dtype == DType::F32 || bias_dtype == DType::F16,
                    "CUDA matmul_nt: bias dtype f32 or f16 expected, got dtype code ", static_cast<int>(bias_dtype));
  }
  const bool blas_pair = (act == DType::F16 && w_dtype == DType::F16) || (act == DType::F32 && w_dtype == DType::F32);
  const bool fits_int = n <= INT_MAX && in <= INT_MAX && out <= INT_MAX;
  if (blas_pair && fits_int && in > 0 && !ref_kernels_enabled()) {
    float beta = 0.f;
    if (bias) {
      beta = 1.f;
      constexpr int kThreads = 256;
      EXL2_DISPATCH_ACT(act, "matmul_nt bias", [&](auto ta) {
        using TA = decltype(ta);
        auto fill = [&](auto tb) {
          using TB = decltype(tb);
          EXL2_CUDA_LAUNCH_PDL("fill_bias_kernel", fill_bias_kernel<TA, TB>, elementwise_blocks(n * out, kThreads),
                               kThreads, 0, current_stream(), static_cast<const TB*>(bias), static_cast<TA*>(y), n,
                               out);
        };
        if (bias_dtype == DType::F16) fill(__half{});
        else fill(float{});
      });
    }
    const float alpha = 1.f;
    const cudaDataType_t t = act == DType::F16 ? CUDA_R_16F : CUDA_R_32F;
    // Row-major y[n, out] is column-major y^T[out, n] = w[out, in] (col-major [in, out], transposed) x^T.
    EXL2_CUBLAS_CHECK(cublasGemmEx(cublas_handle(), CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(out),
                                   static_cast<int>(n), static_cast<int>(in), &alpha, w, t, static_cast<int>(in), x, t,
                                   static_cast<int>(in), &beta, y, t, static_cast<int>(out), CUBLAS_COMPUTE_32F,
                                   CUBLAS_GEMM_DEFAULT));
    if (sync_check_enabled()) EXL2_CUDA_LAUNCH_CHECK("cublasGemmEx");
    return;
  }
  EXL2_DISPATCH_ACT(act, "matmul_nt", [&](auto ta) {
    using TA = decltype(ta);
    EXL2_DISPATCH_FLOAT(w_dtype, "matmul_nt weight", [&](auto tw) {
      using TW = decltype(tw);
      launch_ref<TA, TW>(x, w, bias, bias_dtype, y, n, in, out);
    });
  });
}

}  // namespace exl2::cuda
