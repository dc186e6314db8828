// The CUDA-core EXL2 dequantize+GEMV kernel for 1 or 2 rows of x (faster there than the tensor-core kernel,
// cuda/exl2_gemv_tc.cuh), device code only; it reads the tiled layout (cuda/exl2_gemm.h). Launch setup, the unit
// table and the accumulator live in cuda/exl2_gemm.cu.
#pragma once

#include "cuda/exl2_decode.cuh"
#include "cuda/pdl.cuh"

namespace exl2::cuda::exl2k {

constexpr int kGemvThreads = 128;  // threads per block; thread t of column tile b owns 4 adjacent columns

// ---- fused GEMV -----------------------------------------------------------------------------------------------

// grid (column tiles, k slices). Block (tile, slice) multiplies units [slice*ups, +ups) for its 512 columns,
// adds its fp32 sums into acc [m, out_pad] (atomics), and the last block of the tile to finish writes
// y[:, tile columns] = f16(acc + bias) and zeroes its part of acc and its counter for the next launch.
template <int M>
__global__ void __launch_bounds__(kGemvThreads)
    exl2_gemv_kernel(const __half* __restrict__ x, int64_t in, int m, const uint32_t* __restrict__ q_weight,
                     int64_t tile_stride, const uint32_t* __restrict__ q_scale, const __half* __restrict__ msc,
                     const int32_t* __restrict__ q_perm, const int4* __restrict__ units, int n_units, int ups,
                     const float* __restrict__ bias, __half* __restrict__ y, int64_t out, int64_t out_pad,
                     float* __restrict__ acc, unsigned* __restrict__ counters) {
  extern __shared__ float4 smem4[];
  float* xs = reinterpret_cast<float*>(smem4);  // [ups * 32][M]

  const int u0 = blockIdx.y * ups;
  const int u1 = min(u0 + ups, n_units);
  const int64_t col = (int64_t(blockIdx.x) * kGemvThreads + threadIdx.x) * 4;
  const bool active = col < out_pad;

  // Fetch the first unit's words before staging x, so the two latencies overlap.
  UnitInfo U = unit_info(units, u0);
  UnitData D;
  if (active) load_unit(U, q_weight, tile_stride, q_scale, msc, out_pad, col, D);
  // Programmatic dependent launch (cuda/pdl.cuh): only the layer's constant tables and weights are read above; x,
  // acc and counters may still be in use by the previous kernel until this returns.
  pdl_wait();

  // Stage x[i, perm[row]] (act-order applied to the input); 0 for rows past a unit's end and for i >= m.
  const int n_stage = (u1 - u0) * 32 * M;
  for (int e = threadIdx.x; e < n_stage; e += kGemvThreads) {
    const int r = e / M, i = e % M;
    const UnitInfo S = unit_info(units, u0 + r / 32);
    const int v = r % 32;
    float val = 0.f;
    if (i < m && v < S.nvals) val = __half2float(x[int64_t(i) * in + q_perm[S.row + v]]);
    xs[e] = val;
  }
  __syncthreads();

  if (active) {
    GemvAcc<M> g;
#pragma unroll
    for (int c = 0; c < 4; ++c)
#pragma unroll
      for (int i = 0; i < M; ++i) g.acc[c][i] = 0.f;
    for (int u = u0; u < u1; ++u) {
      if (u > u0) {
        U = unit_info(units, u);
        load_unit(U, q_weight, tile_stride, q_scale, msc, out_pad, col, D);
      }
      g.xu = xs + (u - u0) * 32 * M;
      decode_unit_any(U.bits, D, g);
    }
#pragma unroll
    for (int i = 0; i < M; ++i) {
      if (i < m) {
        float* dst = acc + int64_t(i) * out_pad + col;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        atomicAdd(reinterpret_cast<float4*>(dst), make_float4(g.acc[0][i], g.acc[1][i], g.acc[2][i], g.acc[3][i]));
#else
#pragma unroll
        for (int c = 0; c < 4; ++c) atomicAdd(dst + c, g.acc[c][i]);
#endif
      }
    }
  }
  pdl_launch_dependents();  // every thread, after the main loop: the next kernel may be scheduled

  // The last block of this column tile (all others' sums are in acc) writes y.
  if (!split_k_last(counters)) return;
  if (active) {
    for (int i = 0; i < m; ++i) {
      float4* src = reinterpret_cast<float4*>(acc + int64_t(i) * out_pad + col);
      const float4 s = __ldcg(src);
      __stcg(src, make_float4(0.f, 0.f, 0.f, 0.f));
      const float v[4] = {s.x, s.y, s.z, s.w};
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        if (col + c < out) y[int64_t(i) * out + col + c] = __float2half_rn(v[c] + (bias ? bias[col + c] : 0.f));
      }
    }
  }
  if (threadIdx.x == 0) counters[blockIdx.x] = 0u;
}

}  // namespace exl2::cuda::exl2k
