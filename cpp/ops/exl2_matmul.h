// The quantized matmul as an op: y[n, out] = x[n, in] @ W + bias with W an EXL2 layer. Contract (the checks every
// backend relies on), the pure planner that picks the CUDA kernel, and the CPU reference.
//
// Contract of exl2_matmul (InvalidArgument naming what differs):
//   x: f16 or f32 [..., in] on the layer's device; y: x's dtype [..., out] with x's leading dims, not overlapping x.
//   The CPU path is the reference: W dequantized bit-exactly as quant::dequantize_into (shared/specs/exl2-format.md
//   1.6), products and sums in fp32 in input order, + bias (f32), y rounded once. The CUDA kernels dequantize the
//   same bits; their sums differ from the reference only in order (split-k).
// Groups (2..3 layers sharing x) and fused launches (a prologue folded in) are planned by the same planner; where
// they do not qualify the caller runs the layers one by one (cpp/linear/linear.h forward_group / forward_fused).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "exl2/tensor.h"
#include "quant/exl2_format.h"

namespace exl2::cuda {
struct Exl2DeviceWeights;
}  // namespace exl2::cuda

namespace exl2::ops {

// ---- planner ------------------------------------------------------------------------------------------------------

// What the planner needs to know of a GPU.
struct Exl2GpuInfo {
  std::string name;  // e.g. "NVIDIA H200"
  int cc = 0;        // compute capability, major * 10 + minor
  int sm_count = 0;  // multiprocessors
};

// The GPU the planner's choices were measured on (bench/results/2026-11-30-h200-session7.txt).
Exl2GpuInfo exl2_tuned_gpu();

// One layer (or the first of a group) as the planner sees it.
struct Exl2MatmulShape {
  int64_t rows = 1;  // rows of x
  int64_t in = 0, out = 0;
  bool f16 = true;   // activations f16 (false: f32)
  int n_layers = 1;  // layers sharing x in one launch (1: a single layer)
  bool fused = false;  // a fused launch (prologue / add_into folded in: cuda::exl2_gemm_fused)
};

// The planner's tunable inputs: typed options (exl2/options.h holds them for the runtime; tests sweep them here).
struct Exl2MatmulTuning {
  int gemv_max_rows = 32;     // rows up to which the fused-dequantization GEMV runs; above: dequantize + cuBLAS
  bool m32 = false;           // 17..32 rows in one launch of the 32-row v4 kernel (else two 16-row launches)
  bool group = true;          // one launch for 2..3 layers sharing x
  bool reference = false;     // the simple reference kernels only (dequantize + cuBLAS), for bisecting
  int slices = 0;             // k slices per column block, 0: automatic (1: one warp owns all of k)
  int chunks_per_slice = 8;   // v4: chunks of 4 units per k slice the split aims at
  int blocks_per_sm = 0;      // v4: resident blocks per SM the grid aims at, 0: what occupancy allows
  int prefetch_bytes = 8192;  // v4: L2 bulk prefetch per warp at the start (bytes, 0..65536)
  bool prefetch_ahead = true;  // v4: keep 8 KB prefetched ahead inside the loop
};

// What ships (what the planner can pick). Variants that lost their measurement are in dev/kernels/ (exl2_gemv_*).
enum class Exl2Kernel {
  none,            // group / fused launch does not qualify: the caller runs the layers one by one
  gemv_v4,         // fused dequantization on tensor cores, 1..32 rows per launch (cuda/exl2_gemv_v4.cuh)
  dequant_cublas,  // dequantize W in column chunks + one cuBLAS GEMM per chunk (f16: HGEMM, f32: SGEMM)
};
const char* exl2_kernel_name(Exl2Kernel k);

// One launch of a plan: rows [row0, row0 + rows) of x through `kernel` instantiated for `m_tile` rows.
struct Exl2Launch {
  int64_t row0 = 0;
  int64_t rows = 0;
  Exl2Kernel kernel = Exl2Kernel::none;
  int m_tile = 0;  // GEMV template rows (1, 2, 4, 8, 16, 32); dequant_cublas: 0 (all rows in one GEMM)
};

struct Exl2MatmulPlan {
  Exl2Kernel kernel = Exl2Kernel::none;  // of the first launch (none: the caller composes)
  std::vector<Exl2Launch> launches;
  Exl2MatmulTuning tuning;  // what the kernels read (slices, chunks, prefetch, pdl)
  std::string tuned_on;  // the GPU these choices were measured on
  bool tuned = false;    // gpu matches it (same compute capability)
  std::string note;      // why a choice was made or refused, "" when plain
};

// Picks the kernel(s) for `shape` on `gpu` under `tuning`. Pure: no device access, no globals. A GPU other than
// exl2_tuned_gpu() gets the same choices (every kernel runs on sm_80+) and a note saying they were not tuned for it.
Exl2MatmulPlan plan_exl2_matmul(const Exl2MatmulShape& shape, const Exl2GpuInfo& gpu, const Exl2MatmulTuning& tuning);

// The tuning the runtime's options (exl2/options.h) ask for.
Exl2MatmulTuning exl2_tuning_from_options();

// ---- the op -------------------------------------------------------------------------------------------------------

// An EXL2 layer as the op sees it: on the CPU its packed tensors and validated layout (zero-copy views, valid while
// the caller keeps them), bias f32 [out] or undefined; on CUDA the uploaded weights.
struct Exl2MatmulWeights {
  Device device;
  int64_t in = 0, out = 0;
  const quant::Exl2Tensors* packed = nullptr;  // CPU
  const quant::Exl2Layout* layout = nullptr;   // CPU
  const Tensor* bias = nullptr;                // CPU, may be null
  const cuda::Exl2DeviceWeights* cuda = nullptr;  // CUDA
};

// y = x @ W + bias (see the contract above). CPU: the reference; CUDA: plan_exl2_matmul on the layer's GPU with the
// runtime's options (exl2/options.h), then the planned kernels on the current stream.
void exl2_matmul(const Tensor& x, const Exl2MatmulWeights& w, Tensor& y);

// y_i = x @ W_i + bias_i for 2..3 CUDA layers sharing x in one launch. Returns false, having done nothing, where the
// planner or the arguments do not qualify (another device, in_features or layout between layers, x not f16); the
// caller then runs exl2_matmul per layer. InvalidArgument as exl2_matmul for a bad x / y, or outputs that overlap.
bool exl2_matmul_group(const Tensor& x, const std::vector<const cuda::Exl2DeviceWeights*>& ws,
                       const std::vector<Tensor*>& ys);

// The fused launch for 1..3 CUDA layers sharing src [n, in] f16 (prologue 0: x = src, 1: rms_norm(src) * norm_w,
// 2: silu(src) * up; add_into: *ys[0] += the product; cuda/exl2_gemm.h exl2_gemm_fused). Returns false, having done
// nothing, where it does not qualify (the caller runs the composition). InvalidArgument for bad outputs.
bool exl2_matmul_fused(const Tensor& src, const std::vector<const cuda::Exl2DeviceWeights*>& ws,
                       const std::vector<Tensor*>& ys, int prologue, const Tensor& norm_w, float eps, const Tensor& up,
                       bool add_into);

}  // namespace exl2::ops
