// GPTQ of one linear into EXL2 groups (the converter's core: python/exl2cpp/convert/gptq.py prepares the inputs
// and packs the result) and the fp32 Hessian X^T X, with a CPU reference (cpp/quant/gptq.cpp) and a CUDA backend
// (cuda/gptq.cu) that compute bit-identical results.
//
// Algorithm (spec §2.5, §2.6; ExLlamaV2's AdaptiveGPTQ). Inputs: W f32 [in, out] (rows already in act order,
// dead inputs zeroed), U f32 [in, in] (upper Cholesky factor of the damped, permuted H^-1; only U[r, c] with
// c >= r is read), groups (bits_g, rows_g) in storage order, rows summing to `in`. Work copy w = W. Per group g
// (rows [a, b), maxq = 2^bits - 1, z = 2^(bits-1)):
//   scale search (find_params) on the current w[a:b]:
//     base_j = (max_r |w[r, j]| + 1e-12f) / float(maxq / 2);  smax = max_j base_j;
//     qs_j = clamp(rint(16 * sqrt(base_j / smax)), 1, 16);  s_j = (qs_j / 16)^2 * smax;
//     p_i = float(0.70 + 0.50 * i / 96) (in double, then rounded), i = 0..96;  sp_j = s_j * p_i;
//     err_i = sum over r, j of |d|^2 * (sqrt|d| * |d|) with d = clamp(rint(w / sp_j), -z, maxq - z) * sp_j - w;
//       each term's two fp32 factors multiplied and summed in fp64 in a fixed order (below);
//     coarse: i in {0, 4, ..., 96}; fine: i in [best-3, best+3] ∩ [0, 96]; best = smallest err, lowest i on ties;
//     q_scale_max = fp16(smax * p_best) (error when not finite or > 65504), nibble_j = qs_j - 1.
//   GptqSearch::kHessianMse instead: the term of err_i is double(d * d) * double(h_r), h_r = 1 / (U[a+r, a+r]^2)
//     (fp32; GPTQ's cost of an error in that row); after q_scale_max, every column's qs_j is replaced by the n in
//     1..16 with the least sum over r (increasing, fp64) of double(e * e) * double(h_r), e = w[r, j] - dq, dq as
//     the row loop computes it (below) with scale fp16(n * n * msc) and w the current group rows (no feedback);
//     ties keep the smaller n.
//   runtime scale (what the EXL2 runtime computes, spec §1.6):
//     scale_j = fp16(qs_j^2 * fp16(float(q_scale_max) * (1/256)));  scale_j == 0 -> code z (column skipped).
//   row loop, c = a..b-1, every column j independently:
//     q = clamp(rint(w[c, j] / scale_j) + z, 0, maxq);  dq = fp16((q - z) * scale_j);
//     e = (w[c, j] - dq) / U[c, c];  w[r, j] -= U[c, r] * e for r in (c, b)  (product rounded, then subtracted);
//     codes[c, j] = q, deq[c, j] = dq, E[c - a, j] = e.
//   trailing update: w[r, j] -= acc with acc = sum over k in [a, b) of U[k, r] * E[k - a, j], accumulated in
//     fp32 from 0 in increasing k, each product rounded then added (no FMA), for every r >= b.
// Every fp32 operation above is a single IEEE-rounded op (the CPU file is compiled without FP contraction and
// the CUDA kernels use __f*_rn intrinsics), so CPU and CUDA agree bit for bit.
// Reduction order of err_i: column sums S_j = sum over r in increasing order (fp64); columns are cut into chunks of
// kGptqChunk; a chunk's sum is a pairwise tree over its kGptqChunk slots (missing columns are 0): for
// s = kGptqChunk/2 .. 1: slot[t] += slot[t + s]; err_i = the chunk sums added in increasing chunk order.
//
// Hessian: H[in, in] = X^T X for X f32 [n, in], fp32 (CPU: blocked loops, CUDA: cuBLAS sgemm, fp32 compute, in
// chunks of tokens so the device holds at most kHessianChunk rows of X); not bit-identical between backends.
#pragma once

#include <cstdint>
#include <vector>

#include "exl2/tensor.h"

namespace exl2 {

constexpr int kGptqGrid = 96;     // scale search points are 0..kGptqGrid
constexpr int kGptqChunk = 256;   // columns per fp64 reduction chunk (= CUDA block size of the search)
constexpr int64_t kHessianChunk = 8192;  // rows of X per device chunk

// How the group scales are chosen: kAbsMax is ExLlamaV2's search (|error|^3.5 over the group, per-column codes
// from the column absmax); kHessianMse weights the squared error of each row by GPTQ's 1 / U[r, r]^2 and then
// searches every column's code.
enum class GptqSearch : int { kAbsMax = 0, kHessianMse = 1 };

struct GptqGroup {
  int bits = 4;
  int64_t rows = 0;
};

namespace ops {

// Quantize w f32 [in, out] with u f32 [in, in] (both on `device`'s side after the op copies them; inputs may live
// on any device) into groups. Outputs (CPU tensors): codes u8 [in, out], nibbles u8 [G, out], q_scale_max f16 [G],
// deq f32 [in, out] (fp16 values). Validates shapes, groups (bits in {2,3,4,5,6,8}, rows > 0, sum = in) and
// finiteness of the group maxima; runs on `device` (cpu or cuda:n).
void gptq_quantize(const Tensor& w, const Tensor& u, const std::vector<GptqGroup>& groups, Device device,
                   Tensor& codes, Tensor& nibbles, Tensor& q_scale_max, Tensor& deq,
                   GptqSearch search = GptqSearch::kAbsMax);

// H f32 [in, in] (CPU tensor) = x^T x for x f32 [n, in] (CPU tensor), computed on `device`.
Tensor gptq_hessian(const Tensor& x, Device device);

}  // namespace ops

}  // namespace exl2

// Backend kernels: raw pointers on the backend's device, no validation. w is the work copy (overwritten).
// group_bits / group_rows are host arrays. q_scale_max: f16 bits. Throws InvalidArgument for scales that overflow
// fp16 (CUDA: checked after the run, naming the first bad group).
#define EXL2_BACKEND_GPTQ_KERNELS                                                                                  \
  void gptq_quantize(float* w, const float* u, const int* group_bits, const int64_t* group_rows, int64_t n_groups, \
                     int64_t in, int64_t out, uint8_t* codes, uint8_t* nibbles, uint16_t* q_scale_max, float* deq,   \
                     GptqSearch search);                                                                             \
  void gptq_hessian(const float* x, int64_t n, int64_t in, float* h, bool accumulate);                      \
  /* partial[r * parts + p] = sum over part p of row r of (a - b)^2 in fp64 (b == nullptr: a^2); rows of `cols` */ \
  /* values cut into `parts` contiguous parts of ceil(cols / parts) */                                         \
  void gptq_sqdiff(const float* a, const float* b, int64_t rows, int64_t cols, int64_t parts, double* partial);

namespace exl2::cpu {
EXL2_BACKEND_GPTQ_KERNELS
}  // namespace exl2::cpu

#ifdef EXL2_WITH_CUDA
namespace exl2::cuda {
EXL2_BACKEND_GPTQ_KERNELS
}  // namespace exl2::cuda
#endif
