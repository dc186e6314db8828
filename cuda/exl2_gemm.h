// The CUDA EXL2 quantized linear: y[n, out] = x[n, in] @ W + bias with W kept in ExLlamaV2's packed form on the
// device. Host types only (no CUDA headers), so cpp/linear/exl2_linear.cpp and the bindings can include it.
//
// Two weight layouts, chosen at load by EXL2CPP_GEMV (exl2_gemv_v4_requested); a layer keeps exactly one:
//   "v4" / "v4k" (opt-in until measured on a GPU): the v4 layout (cuda/exl2_gemv_v4.cuh, exl2_v4_tables; the
//     file's 4-bit scale codes inside it, the group maxima per unit in v4_msc);
//   "main" (the default, also when unset): main's tiled layout ("Device layout" below) + q_scale/msc and main's
//     kernels.
// Two paths, chosen per call by the row count n (rows of x):
//   n <= threshold (default 32, env EXL2CPP_EXL2_GEMM_THRESHOLD, or set_exl2_gemm_threshold):
//     fused dequantize + multiply, 16 rows of x per launch: every weight byte is read once per 16 rows.
//     v4 layout: the v4 kernel for 1-16 rows (tensor cores, one or two mma n-tiles). main layout: 1-2 rows on CUDA
//     cores (cuda/exl2_gemv_kernel.cuh), 3-16 rows on tensor cores (cuda/exl2_gemv_tc.cuh). Blocks own a column
//     block and a k slice; when k is split over blocks their fp32 partial sums meet by atomicAdd in a per-device
//     accumulator and the last block of each column block writes y (+ bias) and clears it again (v4 with one
//     slice writes y directly). f16 activations only.
//   n > threshold: dequantize W (in column chunks of at most 64M elements) into the per-device workspace
//     (cuda/stream.h), then one cuBLAS GEMM per chunk (f16 in, fp32 accumulate; f32 activations: f32 W and SGEMM).
//     main layout: W in packed row order and x's columns gathered through q_perm; v4 layout: W written in the
//     original input order (through the v4 xsrc table), x used as is.
// Both paths dequantize bit-exactly as quant::dequantize_into (shared/specs/exl2-format.md 1.6):
//   s = f16((nib+1)^2 * msc[g]) and w = f16((q - 2^(b-1)) * s), each one IEEE round-to-nearest-even, fp16
//   subnormals kept; products and sums in fp32; y rounded once.
// Nothing here allocates or synchronizes after the first call of a given (or larger) shape, so steps can be
// captured into CUDA graphs after one warm-up call (the accumulator, tile counters and workspace grow then).
//
// Device layout (built once at load by exl2_upload; the files keep ExLlamaV2's layout):
//   units (32 packed rows of one group, exl2_unit_table) are ordered by bit width (first appearance), each width's
//   units in file order, and cut into QUADS of 4 units of that width (the last quad of a width padded with empty
//   slots). Slot s = 4 * quad + j. q_weight becomes [out_pad / 8 tiles][tile_stride words]: inside a tile, unit
//   slot s occupies 8 * bits words from woff(s) on (the sum of 8 * bits over the slots before it): column c
//   (0..7) of the tile has the unit's `bits` words (ExLlamaV2's word i = q_weight row qrow + i) at
//   woff + c * bits + i, zero past the unit's nwords. Empty slots store nothing.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "exl2/tensor.h"
#include "quant/exl2_format.h"

// Tells cpp/linear/exl2_linear.cpp that this backend provides exl2::cuda::exl2_gemm.
#define EXL2_HAVE_CUDA_EXL2_GEMM 1

namespace exl2::cuda {

// One "unit" = 32 consecutive packed input rows of one group (fewer at a group's end), stored in `bits`
// consecutive q_weight rows: per column one little-endian bit stream of 32*bits bits.
// Device table entry, i32 x4: {qrow (first q_weight row), row (first packed input row), group,
//                              bits | nvals << 8 | nwords << 16} (nvals <= 32 rows, nwords <= bits words).
std::vector<int32_t> exl2_unit_table(const quant::Exl2Layout& layout);

// The tiled layout of one linear (host tables; see "Device layout" above).
struct Exl2TcTables {
  std::vector<int32_t> slots;  // [n_quads * 4][4]: unit_info entries (nwords 0); nvals 0: empty slot
  std::vector<int32_t> xsrc;   // [n_quads * 128]: input feature feeding each mma k slot (-1: none); see
                               //   cuda/exl2_gemv_tc.cuh: quad q, unit j, pair P (rows a, b), h: slot
                               //   q * 128 + (P / 2) * 16 + j * 4 + (P % 2) * 2 + h
  std::vector<int32_t> units;  // [n_units][4]: exl2_unit_table with qrow replaced by woff (CUDA-core kernel)
  std::vector<int32_t> qmap;   // [qrows][2]: ExLlamaV2 q_weight row r -> {woff of its unit + word index, bits}
  int64_t tile_stride = 0;     // words per tile of 8 columns
  int64_t n_quads = 0;
  int max_bits = 0;
};
Exl2TcTables exl2_tc_tables(const quant::Exl2Layout& layout);

// q_weight [qrows, out_pad] (ExLlamaV2 layout) -> the tiled layout [out_pad / 8, tile_stride], on the host.
std::vector<uint32_t> exl2_tc_repack_host(const Exl2TcTables& t, const uint32_t* q_weight, int64_t qrows,
                                          int64_t out_pad);

// The opt-in "v4" GEMV layout (cuda/exl2_gemv_v4.cuh; built at load when EXL2CPP_GEMV=v4): units sorted by width
// into chunks of 4 units of one width (empty slots pad each width), chunks of one width form a run.
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
  std::vector<float> kcoef;        // [n_chunks * 4 * 32]: 2^(10-o) + z of each row (correction variant), 0: none
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

// EXL2CPP_GEMV, read at every exl2_upload: unset, empty or "v4" (1) or "v4k" (2): the layer is stored in the v4
// layout only and every path reads it: the GEMV for 1-16 rows of x is the v4 kernel, exact (q - z) weights (v4) or
// raw weights with the zero point subtracted from the fp32 result (v4k, one HADD2 per weight pair less);
// "main" (0): main's layout and kernels only. InvalidArgument for anything else.
int exl2_gemv_v4_requested();

// One EXL2 linear on a CUDA device, built once at load (all tensors on `device`). gemv == 0: main's layout (the
// tensors of the first block), else the v4 layout (the v4_ tensors); the other block's tensors stay undefined.
struct Exl2DeviceWeights {
  Device device;
  int gemv = 0;  // exl2_gemv_v4_requested() at upload: 0 main, 1 v4, 2 v4k
  int64_t in = 0, out = 0, out_pad = 0, n_groups = 0, n_quads = 0, tile_stride = 0, n_units = 0;
  int max_bits = 0;
  // main's layout (gemv == 0):
  Tensor q_weight;  // i32 [out_pad / 8, tile_stride]: tiled layout
  Tensor q_scale;   // i32 [G, out_pad/8]
  Tensor msc;       // f16 [G]: f16(q_scale_max * prescale/256)
  Tensor q_perm;    // i32 [in]: packed row k holds input feature q_perm[k]
  Tensor slots;     // i32 [n_quads * 4, 4], Exl2TcTables::slots
  Tensor xsrc;      // i32 [n_quads * 128], Exl2TcTables::xsrc
  Tensor units;     // i32 [n_units, 4], Exl2TcTables::units
  Tensor bias;      // f32 [out] or undefined (both layouts)
  // the v4 layout (gemv 1 or 2):
  Tensor v4_q_weight;    // i32 [out_pad / 16, v4_tile_stride]: weights and 4-bit scale codes
  Tensor v4_msc;         // i32 [v4_chunks * 4], exl2_v4_unit_msc (half2 (msc, msc) per unit slot)
  Tensor v4_chunk_woff;  // i32 [v4_chunks + 1], Exl2V4Tables::chunk_woff
  Tensor v4_xsrc;      // i32 [v4_chunks * 4 * 32]
  Tensor v4_kcoef;     // f32 [v4_chunks * 4 * 32], Exl2V4Tables::kcoef (v4k only)
  bool v4_correct = false;  // EXL2CPP_GEMV=v4k
  int64_t v4_chunks = 0, v4_tile_stride = 0;
  std::vector<int32_t> v4_runs;  // start[n + 1], bits[n], woff[n], rpc[n], srow[n] of Exl2V4Tables (n = runs)
};

// Bytes the layer holds on its device (every defined tensor above).
int64_t exl2_device_bytes(const Exl2DeviceWeights& w);
// What exl2_upload of `layout` will allocate on the device (its kept tensors only, each 256-byte aligned as the
// weight arena places them: core/weight_arena.h), for the layout EXL2CPP_GEMV selects now. Builds the layout's
// tables once more (host only, no device work): the loaders' reserve and OOM estimate.
int64_t exl2_upload_bytes(const quant::Exl2Layout& layout);

// Uploads the validated host tensors. msc: f16 bits [G] (already multiplied by prescale/256 and rounded).
Exl2DeviceWeights exl2_upload(const quant::Exl2Layout& layout, const Tensor& q_weight, const Tensor& q_scale,
                              const std::vector<uint16_t>& msc, const Tensor& bias_f32, Device device);

// y = x @ W + bias on the current stream of w.device. x: f16 or f32 [..., in] on w.device; y: same dtype
// [..., out], not aliasing x. InvalidArgument on mismatched shapes/dtypes/devices.
void exl2_gemm(const Tensor& x, const Exl2DeviceWeights& w, Tensor& y);

// y_i = x @ W_i + bias_i for 2..3 layers that share x, in ONE launch of the v4 GEMV (cuda/exl2_gemv_v4.cuh,
// V4Group: each layer its own k split and its own regions of the per-device accumulator); same results as
// exl2_gemm on each layer up to the order of the split-k fp32 sums. Returns false, having done nothing, where the
// group does not qualify: env EXL2CPP_GEMV_GROUP=0, fewer than 2 or more than 3 layers, a layer not in the v4
// layout (EXL2CPP_GEMV=main) or of another variant (v4 vs v4k), another device or in_features, x not f16, rows of x
// outside 1..16 or above exl2_gemm_threshold(), EXL2CPP_CUDA_REF=1; the caller then runs exl2_gemm per layer.
// InvalidArgument as exl2_gemm for a bad x / y of a layer, or outputs that overlap.
bool exl2_gemm_group(const Tensor& x, const std::vector<const Exl2DeviceWeights*>& ws, const std::vector<Tensor*>& ys);
// exl2_gemm_group with the decode step's small kernels folded in (cpp/linear/linear.h forward_fused), ONE launch
// of the v4 GEMV for 1..3 layers sharing src [n, in] f16:
//   prologue 0: x = src; 1 (rms_norm): x = f16(src * rsqrt(mean(src^2) + eps) * norm_w), every block reducing the
//   sum of squares of its rows of src over all of in itself (fp32; norm_w f32/f16/bf16 [in] as cuda/rms_norm.cu
//   reads it); 2 (silu_mul): x = f16(silu(src) * up) computed as cuda/silu_mul.cu does (up f16 like src).
//   add_into (one layer): *ys[0] = f16(f32(*ys[0]) + (x W + bias)) (the split-k's last block, or every warp with one
//   slice, adds; one rounding) instead of writing the product.
// Returns false, having done nothing, where it does not qualify (the caller runs forward_composed): what
// exl2_gemm_group refuses (but a group of ONE layer is fine; EXL2CPP_GEMV_GROUP=0 refuses 2..3 only), add_into with
// more than one layer, v4k layers with more than 8 rows, a norm weight not [in] float on the device, up not like src, outputs overlapping src / up /
// the norm weight. InvalidArgument as exl2_gemm for a bad y of a layer, or outputs that overlap each other.
bool exl2_gemm_fused(const Tensor& src, const std::vector<const Exl2DeviceWeights*>& ws, const std::vector<Tensor*>& ys,
                     int prologue, const Tensor& norm_w, float eps, const Tensor& up, bool add_into);
// EXL2CPP_GEMV_GROUP, read at every call: unset, empty or "1": true; "0": false; InvalidArgument otherwise.
bool exl2_gemm_group_enabled();
// v4 GEMV launches so far (process-wide) that reduced their k slices through thread-block clusters
// (EXL2CPP_GEMV_CLUSTER=1 on sm_90+, a layer of 2+ slices; see v4_plan_cluster in cuda/exl2_gemv_v4.cuh); tests.
int64_t exl2_gemv_cluster_launches();
// v4 GEMV launches so far of the 32-row kernel (EXL2CPP_GEMV_M32=1, 17..32 rows of x); tests.
int64_t exl2_gemv_m32_launches();

// Rows of x up to which the fused kernel is used (n <= threshold); above it, dequantize + cuBLAS.
// Default: env EXL2CPP_EXL2_GEMM_THRESHOLD, else 32. set_exl2_gemm_threshold(-1) restores the default.
int exl2_gemm_threshold();
void set_exl2_gemm_threshold(int rows);

// For bench/: seconds per call of f() on the current stream of `device` (CUDA events, mean over `iters`
// after 3 warm-up calls).
double time_on_stream_seconds(Device device, const std::function<void()>& f, int iters);

}  // namespace exl2::cuda
