// The CUDA EXL2 quantized linear: y[n, out] = x[n, in] @ W + bias with W kept in ExLlamaV2's packed form on the
// device. Host types only (no CUDA headers), so cpp/linear/exl2_linear.cpp and the bindings can include it.
//
// Two paths, chosen per call by the row count n (rows of x):
//   n <= threshold (default 32, env EXL2CPP_EXL2_GEMM_THRESHOLD, or set_exl2_gemm_threshold):
//     fused dequantize + multiply (exl2_gemv_kernel, cuda/exl2_decode.cuh): every q_weight byte is read once
//     per 16 rows of x; 8 warps of a block split the units of one 128-column tile and meet in shared memory;
//     when the k dimension is also split over blocks, their fp32 partial sums meet by fp32 atomicAdd in a
//     per-device accumulator, and the last block of each tile writes y (+ bias) and clears it again.
//     Per unit (32 rows) products are summed in f16 (HFMA2), then in fp32 (see cuda/exl2_decode.cuh).
//     f16 activations only; f32 activations take the other path.
//   n > threshold: dequantize W (in column chunks of at most 64M elements) into the per-device workspace
//     (cuda/stream.h), in packed row order, gather x's columns through q_perm, then one cuBLAS GEMM per chunk
//     (f16 in, fp32 accumulate; f32 activations: f32 W and SGEMM).
// Weights are repacked once at upload into the tiled layout of cuda/exl2_decode.cuh.
// Both paths dequantize bit-exactly as quant::dequantize_into (shared/specs/exl2-format.md 1.6):
//   s = f16((nib+1)^2 * msc[g]) and w = f16((q - 2^(b-1)) * s), each one IEEE round-to-nearest-even, fp16
//   subnormals kept; y rounded once. cuBLAS path: fp32 products and sums.
// Nothing here allocates or synchronizes after the first call of a given (or larger) shape, so steps can be
// captured into CUDA graphs after one warm-up call (the accumulator, tile counters and workspace grow then).
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "exl2/tensor.h"
#include "quant/exl2_format.h"

// Tells cpp/linear/exl2_linear.cpp that this backend provides exl2::cuda::exl2_gemm.
#define EXL2_HAVE_CUDA_EXL2_GEMM 1

namespace exl2::cuda {

// One EXL2 linear on a CUDA device, built once at load (all tensors on `device`).
struct Exl2DeviceWeights {
  Device device;
  int64_t in = 0, out = 0, out_pad = 0, n_units = 0, n_groups = 0;
  int64_t tiles = 0, tile_words = 0;  // 128-column tiles; u32 word rows per tile (sum of the units' bits)
  int max_bits = 0;                   // widest group
  Tensor q_weight;  // i32 [tiles * tile_words, 128]: the tiled layout of cuda/exl2_decode.cuh (repacked at upload)
  Tensor q_scale;   // i16 (u16 bits) [G, tiles * 32]: 4 scale nibbles per 4 columns
  Tensor msc;       // f16 [G]: f16(q_scale_max * prescale/256)
  Tensor perm_u;    // i32 [n_units * 32]: input feature of each unit value, -1 past a unit's rows
  Tensor units;     // i32 [n_units, 4]: {woff, row, group, bits | nvals << 8 | nwords << 16}
  Tensor bias;      // f32 [out] or undefined
};

// Uploads the validated host tensors. msc: f16 bits [G] (already multiplied by prescale/256 and rounded).
Exl2DeviceWeights exl2_upload(const quant::Exl2Layout& layout, const Tensor& q_weight, const Tensor& q_scale,
                              const std::vector<uint16_t>& msc, const Tensor& bias_f32, Device device);

// y = x @ W + bias on the current stream of w.device. x: f16 or f32 [..., in] on w.device; y: same dtype
// [..., out], not aliasing x. InvalidArgument on mismatched shapes/dtypes/devices.
void exl2_gemm(const Tensor& x, const Exl2DeviceWeights& w, Tensor& y);

// Rows of x up to which the fused kernel is used (n <= threshold); above it, dequantize + cuBLAS.
// Default: env EXL2CPP_EXL2_GEMM_THRESHOLD, else 32. set_exl2_gemm_threshold(-1) restores the default.
int exl2_gemm_threshold();
void set_exl2_gemm_threshold(int rows);

// For bench/: seconds per call of f() on the current stream of `device` (CUDA events, mean over `iters`
// after 3 warm-up calls).
double time_on_stream_seconds(Device device, const std::function<void()>& f, int iters);

}  // namespace exl2::cuda
