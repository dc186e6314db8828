// Timing helpers for bench/: the hardware ceilings (device-to-device copy bandwidth, fp16 GEMM through our
// cuda::matmul_nt) measured with CUDA events on the current stream of the current device. Host types only,
// so the bindings can include this without the CUDA headers.
#pragma once

#include <cstddef>
#include <cstdint>

namespace exl2::cuda {

// Seconds per copy of `nbytes` device-to-device (mean over `iters` after 3 warm-ups): our 16-byte vector copy
// kernel (use_kernel) or cudaMemcpyAsync. Bandwidth = 2 * nbytes / seconds (read + write).
double bench_copy_seconds(size_t nbytes, int iters, bool use_kernel);

// Seconds per y[n, out] = x[n, in] @ w[out, in]^T in f16 (fp32 accumulate) through cuda::matmul_nt, on
// pseudo-random data in [-1, 1] (zeros would run faster). FLOPs = 2 * n * in * out.
double bench_matmul_f16_seconds(int64_t n, int64_t in, int64_t out, int iters);

// Seconds per cuda::attention_paged call (f16, page_size 256) for `n` rows of one sequence ending at
// position ctx - 1 (n = 1: decode at context ctx; n = ctx: causal prefill).
double bench_attention_seconds(int64_t n, int64_t ctx, int64_t n_heads, int64_t n_heads_kv, int64_t head_dim,
                               int iters);

}  // namespace exl2::cuda
