// The CUDA EXL2 quantized linear: the v4 device layout (built once at load), the launch of what the op's planner
// picked (cpp/ops/exl2_matmul.h plan_exl2_matmul: the v4 GEMV for few rows, dequantize + cuBLAS for many) and the
// per-device split-k accumulator the GEMV shares between launches. Host types only (no CUDA headers), so
// cpp/ops/, cpp/linear/ and the bindings can include it. Arguments are checked by the op (cpp/ops/exl2_matmul.cpp);
// these launchers take raw pointers and trust them.
//
// gemv_v4 (1..32 rows per launch, f16 activations): fused dequantize + multiply on tensor cores
//   (cuda/exl2_gemv_v4.cuh). Blocks own a column block and a k slice; when k is split over blocks their fp32
//   partial sums meet by atomicAdd in a per-device accumulator and the last block of each column block writes
//   y (+ bias) and clears it again (with one slice each warp writes y directly).
// dequant_cublas: dequantize W (in column chunks of at most 64M elements, original input order through the v4 xsrc
//   table) into the per-device workspace (cuda/stream.h), then one cuBLAS GEMM per chunk (f16 in, fp32 accumulate;
//   f32 activations: f32 W and SGEMM).
// Both paths dequantize bit-exactly as quant::dequantize_into (shared/specs/exl2-format.md 1.6):
//   s = f16((nib+1)^2 * msc[g]) and w = f16((q - 2^(b-1)) * s), each one IEEE round-to-nearest-even, fp16
//   subnormals kept; products and sums in fp32; y rounded once.
// Nothing here allocates or synchronizes after the first call of a given (or larger) shape, so steps can be
// captured into CUDA graphs after one warm-up call (the accumulator, tile counters and workspace grow then).
// The older tiled layout and its kernels, the v4k correction variant, the L1 prefetch variant and the cluster
// split-k lost their measurements and live in dev/kernels/ (exl2_gemv_notes.md).
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "exl2/tensor.h"
#include "ops/exl2_matmul.h"
#include "quant/exl2_format.h"

// Tells cpp/linear/exl2_linear.cpp that this backend provides exl2::cuda::exl2_gemm.
#define EXL2_HAVE_CUDA_EXL2_GEMM 1

namespace exl2::cuda {

// One "unit" = 32 consecutive packed input rows of one group (fewer at a group's end), stored in `bits`
// consecutive q_weight rows: per column one little-endian bit stream of 32*bits bits.
// Device table entry, i32 x4: {qrow (first q_weight row), row (first packed input row), group,
//                              bits | nvals << 8 | nwords << 16} (nvals <= 32 rows, nwords <= bits words).
std::vector<int32_t> exl2_unit_table(const quant::Exl2Layout& layout);

// The v4 GEMV layout (cuda/exl2_gemv_v4.cuh): units sorted by width into chunks of 4 units of one width (empty
// slots pad each width), chunks of one width form a run.
struct Exl2V4Tables {
  std::vector<int32_t> slot_info;  // [n_chunks * 4][2]: {first q_weight row of the unit, nvals (0: empty)}
  std::vector<int32_t> ugroup;     // [n_chunks * 4]: group of the unit, -1: empty
  std::vector<int32_t> xsrc;       // [n_chunks * 4 * 32]: input feature of row r of slot s at s * 32 + r, -1: none
  std::vector<int32_t> run_start;  // [n_runs + 1]: first chunk of each run (last: n_chunks)
  std::vector<int32_t> run_bits;   // [n_runs]
  std::vector<int32_t> run_woff;   // [n_runs]: first word of each run inside a tile of 16 columns
  std::vector<int32_t> run_rpc;    // [n_runs]: scale rows per chunk, 1 (every chunk of the run is of one group), 2
                                   // (units 0-1 and 2-3 of every chunk share one) or 4
  std::vector<int32_t> run_srow;   // [n_runs]: first scale row of each run
  std::vector<int32_t> srow_group; // [scale rows]: group of each scale row, -1: empty slot
  std::vector<int32_t> chunk_srow; // [n_chunks + 1]: first scale row of each chunk (last: number of rows)
  std::vector<int32_t> chunk_woff; // [n_chunks + 1]: first word of each chunk inside a tile (last: tile_stride)
  int64_t n_chunks = 0;
  int64_t tile_stride = 0;  // words per tile of 16 columns
};
Exl2V4Tables exl2_v4_tables(const quant::Exl2Layout& layout);

// q_weight [qrows, out_pad] (ExLlamaV2 layout) + q_scale [G, out_pad / 8] -> the v4 layout [out_pad / 16,
// tile_stride] (weights and the file's 4-bit scale codes), on the host (the load uses the same per-word code on the
// GPU).
std::vector<uint32_t> exl2_v4_repack_host(const Exl2V4Tables& t, const uint32_t* q_weight, int64_t qrows,
                                          int64_t out_pad, const uint32_t* q_scale);
// The v4 layout's group maxima per unit slot [n_chunks * 4]: half2 (msc, msc) bits of the slot's group (msc: f16 bits
// [G], already multiplied by prescale/256 and rounded), 0 for empty slots.
std::vector<int32_t> exl2_v4_unit_msc(const Exl2V4Tables& t, const std::vector<uint16_t>& msc);

// One EXL2 linear on a CUDA device in the v4 layout, built once at load (all tensors on `device`).
struct Exl2DeviceWeights {
  Device device;
  int64_t in = 0, out = 0, out_pad = 0, n_groups = 0;
  int max_bits = 0;
  Tensor bias;           // f32 [out] or undefined
  Tensor v4_q_weight;    // i32 [out_pad / 16, v4_tile_stride]: weights and 4-bit scale codes
  Tensor v4_msc;         // i32 [v4_chunks * 4], exl2_v4_unit_msc (half2 (msc, msc) per unit slot)
  Tensor v4_chunk_woff;  // i32 [v4_chunks + 1], Exl2V4Tables::chunk_woff
  Tensor v4_xsrc;        // i32 [v4_chunks * 4 * 32]
  int64_t v4_chunks = 0, v4_tile_stride = 0;
  std::vector<int32_t> v4_runs;  // start[n + 1], bits[n], woff[n], rpc[n], srow[n] of Exl2V4Tables (n = runs)
};

// Bytes the layer holds on its device (every defined tensor above).
int64_t exl2_device_bytes(const Exl2DeviceWeights& w);
// What exl2_upload of `layout` will allocate on the device (its kept tensors only, each 256-byte aligned as the
// weight arena places them: core/weight_arena.h). Builds the layout's tables once more (host only, no device work):
// the loaders' reserve and OOM estimate.
int64_t exl2_upload_bytes(const quant::Exl2Layout& layout);

// Uploads the validated host tensors. msc: f16 bits [G] (already multiplied by prescale/256 and rounded).
Exl2DeviceWeights exl2_upload(const quant::Exl2Layout& layout, const Tensor& q_weight, const Tensor& q_scale,
                              const std::vector<uint16_t>& msc, const Tensor& bias_f32, Device device);

// The GPU as the planner sees it (name, compute capability, SMs), cached per device.
ops::Exl2GpuInfo exl2_gpu_info(int device);

// y = x @ W + bias on the current stream of w.device, as `plan` says (its launches, its tuning). x: [n, in] of dtype
// act (f16 or f32; f32 only through dequant_cublas); y: [n, out] of act, not aliasing x.
void exl2_gemm(const void* x, DType act, int64_t n, const Exl2DeviceWeights& w, void* y,
               const ops::Exl2MatmulPlan& plan);

// y_i = x @ W_i + bias_i for the 2..3 layers of a gemv_v4 group plan in ONE launch (V4Group: each layer its own
// k split and its own regions of the per-device accumulator); x f16 [n, in], ys f16 [n, out_i], not overlapping.
// Same results as exl2_gemm on each layer up to the order of the split-k fp32 sums.
void exl2_gemm_group(const void* x, int64_t n, const std::vector<const Exl2DeviceWeights*>& ws,
                     const std::vector<void*>& ys, const ops::Exl2MatmulPlan& plan);

// The decode step's small kernels folded into a group launch (cpp/linear/linear.h forward_fused), checked by
// ops::exl2_matmul_fused:
//   kind 0: x = src; 1 (rms_norm): x = f16(src * rsqrt(mean(src^2) + eps) * norm_w), every block reducing the
//   sum of squares of its rows of src over all of in itself (fp32; norm_w f32/f16/bf16 [in] as cuda/rms_norm.cu
//   reads it; vec: in % 8 == 0 and src 16-byte aligned); 2 (silu_mul): x = f16(silu(src) * up) as cuda/silu_mul.cu.
//   add_into (one layer): y = f16(f32(y) + (x W + bias)) (one rounding) instead of writing the product.
struct Exl2Prologue {
  int kind = 0;
  bool add_into = false;
  const void* norm_w = nullptr;
  DType norm_dtype = DType::F32;
  float eps = 0.f;
  bool vec = false;
  const void* up = nullptr;
};
void exl2_gemm_fused(const void* src, int64_t n, const std::vector<const Exl2DeviceWeights*>& ws,
                     const std::vector<void*>& ys, const ops::Exl2MatmulPlan& plan, const Exl2Prologue& pro);

// v4 GEMV launches so far (process-wide) of the 32-row kernel (gemv_m32 on, 17..32 rows of x); tests.
int64_t exl2_gemv_m32_launches();

// For bench/: seconds per call of f() on the current stream of `device` (CUDA events, mean over `iters`
// after 3 warm-up calls).
double time_on_stream_seconds(Device device, const std::function<void()>& f, int iters);

}  // namespace exl2::cuda
