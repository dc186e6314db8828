// Sampler helpers on the GPU (sampling.h): one block per row for softmax, argmax and iterative top-k; and the
// backend kernel argmax_logprob (backend/kernels.h, the engine's device argmax).
#include "backend/kernels.h"
#include "cuda/common.cuh"
#include "cuda/sampling.h"

namespace exl2::cuda {

namespace {

constexpr int kThreads = 1024;

__device__ __forceinline__ float clean(float v) { return isnan(v) ? -INFINITY : v; }

// (value, index) ordered by value descending, then index ascending: a "better" b.
__device__ __forceinline__ bool better(float va, int32_t ia, float vb, int32_t ib) {
  return va > vb || (va == vb && ia < ib);
}

// Block-wide best (value, index); every thread gets the result.
__device__ void block_best(float& v, int32_t& i) {
  __shared__ float sv[32];
  __shared__ int32_t si[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float v2 = __shfl_xor_sync(0xffffffffu, v, o);
    const int32_t i2 = __shfl_xor_sync(0xffffffffu, i, o);
    if (better(v2, i2, v, i)) v = v2, i = i2;
  }
  __syncthreads();
  if (lane == 0) sv[warp] = v, si[warp] = i;
  __syncthreads();
  v = lane < n_warps ? sv[lane] : -INFINITY;
  i = lane < n_warps ? si[lane] : INT32_MAX;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float v2 = __shfl_xor_sync(0xffffffffu, v, o);
    const int32_t i2 = __shfl_xor_sync(0xffffffffu, i, o);
    if (better(v2, i2, v, i)) v = v2, i = i2;
  }
}

// Best element of the row strictly after (prev_v, prev_i) in the order above (prev_i < 0: no bound).
__device__ void row_best_after(const float* row, int64_t vocab, float prev_v, int32_t prev_i, float& v, int32_t& i) {
  v = -INFINITY;
  i = INT32_MAX;
  for (int64_t c = threadIdx.x; c < vocab; c += blockDim.x) {
    const float x = clean(row[c]);
    const int32_t ci = static_cast<int32_t>(c);
    if (prev_i >= 0 && !better(prev_v, prev_i, x, ci)) continue;  // not after the previous pick
    if (better(x, ci, v, i)) v = x, i = ci;
  }
  block_best(v, i);
}

__global__ void softmax_rows_kernel(const float* logits, float* probs, int64_t vocab, float inv_temp, bool greedy) {
  __shared__ float scratch[32];
  const float* x = logits + int64_t(blockIdx.x) * vocab;
  float* y = probs + int64_t(blockIdx.x) * vocab;
  if (greedy) {
    float v;
    int32_t i;
    row_best_after(x, vocab, 0.f, -1, v, i);
    __syncthreads();  // all reads of x done before y (may alias) is written
    for (int64_t c = threadIdx.x; c < vocab; c += blockDim.x) y[c] = c == i ? 1.f : 0.f;
    return;
  }
  float mx = -INFINITY;
  for (int64_t c = threadIdx.x; c < vocab; c += blockDim.x) mx = fmaxf(mx, clean(x[c]) * inv_temp);
  mx = block_max(mx, scratch);
  float sum = 0.f;
  for (int64_t c = threadIdx.x; c < vocab; c += blockDim.x) sum += expf(clean(x[c]) * inv_temp - mx);
  sum = block_sum(sum, scratch);
  const float inv = 1.f / sum;
  // Each element is read and written by the same thread, so probs may alias logits.
  for (int64_t c = threadIdx.x; c < vocab; c += blockDim.x) y[c] = expf(clean(x[c]) * inv_temp - mx) * inv;
}

__global__ void argmax_rows_kernel(const float* values, int64_t vocab, int32_t* out_index) {
  float v;
  int32_t i;
  row_best_after(values + int64_t(blockIdx.x) * vocab, vocab, 0.f, -1, v, i);
  if (threadIdx.x == 0) out_index[blockIdx.x] = i;
}

__global__ void topk_rows_kernel(const float* values, int64_t vocab, int k, float* out_values, int32_t* out_indices) {
  const float* row = values + int64_t(blockIdx.x) * vocab;
  float pv = 0.f;
  int32_t pi = -1;
  for (int r = 0; r < k; ++r) {
    float v;
    int32_t i;
    row_best_after(row, vocab, pv, pi, v, i);
    if (threadIdx.x == 0) {
      out_values[int64_t(blockIdx.x) * k + r] = v;
      out_indices[int64_t(blockIdx.x) * k + r] = i;
    }
    pv = v;
    pi = i;
  }
}

// Block-wide minimum of an int64; every thread gets the result.
__device__ int64_t block_min_i64(int64_t v) {
  __shared__ int64_t s[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const long long u = __shfl_xor_sync(0xffffffffu, static_cast<long long>(v), o);
    v = u < v ? u : v;
  }
  __syncthreads();
  if (lane == 0) s[warp] = v;
  __syncthreads();
  v = lane < n_warps ? s[lane] : INT64_MAX;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const long long u = __shfl_xor_sync(0xffffffffu, static_cast<long long>(v), o);
    v = u < v ? u : v;
  }
  return v;
}

// One block per row: pass 1 finds the best (value, lowest index) and the lowest NaN/+inf column, pass 2 the
// f32 sum of exp(x - max) (the row is re-read from L2). The host sampler's outcomes: see ops.h argmax_logprob.
__global__ void argmax_logprob_kernel(const float* logits, int64_t vocab, int32_t* index, float* logprob) {
  __shared__ float scratch[32];
  const float* row = logits + int64_t(blockIdx.x) * vocab;
  float v = -INFINITY;
  int32_t i = INT32_MAX;
  int64_t bad = INT64_MAX;
  for (int64_t c = threadIdx.x; c < vocab; c += blockDim.x) {
    const float x = row[c];
    if (!(x < INFINITY)) {
      bad = c < bad ? c : bad;
      continue;
    }
    if (better(x, static_cast<int32_t>(c), v, i)) v = x, i = static_cast<int32_t>(c);
  }
  block_best(v, i);
  bad = block_min_i64(bad);
  if (bad != INT64_MAX) {
    if (threadIdx.x == 0) index[blockIdx.x] = static_cast<int32_t>(-2 - bad), logprob[blockIdx.x] = row[bad];
    return;
  }
  if (v == -INFINITY) {  // every logit -inf (the block returns uniformly: v is block-wide)
    if (threadIdx.x == 0) index[blockIdx.x] = -1, logprob[blockIdx.x] = -INFINITY;
    return;
  }
  float sum = 0.f;
  for (int64_t c = threadIdx.x; c < vocab; c += blockDim.x) sum += expf(row[c] - v);
  sum = block_sum(sum, scratch);
  if (threadIdx.x == 0) {
    index[blockIdx.x] = i;
    logprob[blockIdx.x] = static_cast<float>(-log(static_cast<double>(sum)));  // x_max - (x_max + log sum)
  }
}

}  // namespace

void argmax_logprob(const float* logits, int64_t rows, int64_t vocab, int32_t* index, float* logprob) {
  if (rows == 0) return;
  argmax_logprob_kernel<<<static_cast<unsigned>(rows), kThreads, 0, current_stream()>>>(logits, vocab, index,
                                                                                          logprob);
  EXL2_CUDA_LAUNCH_CHECK("argmax_logprob_kernel");
}

void softmax_rows(const float* logits, float* probs, int64_t rows, int64_t vocab, float temperature) {
  if (rows == 0) return;
  EXL2_CHECK(vocab > 0 && vocab <= INT32_MAX, "softmax_rows: vocab in [1, 2^31) expected, got ", vocab);
  const bool greedy = !(temperature > 0.f);
  softmax_rows_kernel<<<static_cast<unsigned>(rows), kThreads, 0, current_stream()>>>(
      logits, probs, vocab, greedy ? 1.f : 1.f / temperature, greedy);
  EXL2_CUDA_LAUNCH_CHECK("softmax_rows_kernel");
}

void argmax_rows(const float* values, int64_t rows, int64_t vocab, int32_t* out_index) {
  if (rows == 0) return;
  EXL2_CHECK(vocab > 0 && vocab <= INT32_MAX, "argmax_rows: vocab in [1, 2^31) expected, got ", vocab);
  argmax_rows_kernel<<<static_cast<unsigned>(rows), kThreads, 0, current_stream()>>>(values, vocab, out_index);
  EXL2_CUDA_LAUNCH_CHECK("argmax_rows_kernel");
}

void topk_rows(const float* values, int64_t rows, int64_t vocab, int k, float* out_values, int32_t* out_indices) {
  if (rows == 0) return;
  EXL2_CHECK(vocab > 0 && vocab <= INT32_MAX, "topk_rows: vocab in [1, 2^31) expected, got ", vocab);
  EXL2_CHECK(k >= 1 && k <= vocab, "topk_rows: k in [1, vocab=", vocab, "] expected, got ", k);
  topk_rows_kernel<<<static_cast<unsigned>(rows), kThreads, 0, current_stream()>>>(values, vocab, k, out_values,
                                                                                    out_indices);
  EXL2_CUDA_LAUNCH_CHECK("topk_rows_kernel");
}

}  // namespace exl2::cuda
