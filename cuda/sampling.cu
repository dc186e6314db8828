// Sampler helpers on the GPU (sampling.h): one block per row for softmax, argmax and iterative top-k; and the
// backend kernel sample_logprob (backend/kernels.h, the engine's device argmax and device sampling).
#include "backend/cpu/sum_exp.h"  // cpu::fast_exp, host and device
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

// ---- sample_logprob (ops.h): the engine's device argmax and device sampling --------------------------------------

// A float's order as an unsigned key (larger float, larger key; -0 folded into +0 first so that equal floats share
// a key); its inverse.
__device__ __forceinline__ uint32_t order_key(float x) {
  const uint32_t b = __float_as_uint(x == 0.0f ? 0.0f : x);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float key_float(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// The row's settings and the pieces of the host's steps 3-6 (backend/cpu/sample_filter.cpp), per element.
struct RowFilter {
  float lmax, t, zthr;  // z = (x - lmax) / t; top-k keeps z >= zthr (-inf: off)
  uint32_t pkey;        // top-p boundary (z key, id): kept when key > pkey or (key == pkey and id <= pid)
  int32_t pid;          // INT32_MAX: top-p off
  double min_p;         // min-p keeps w >= min_p (0: off)

  __device__ float z(float x) const { return __fdiv_rn(__fsub_rn(x, lmax), t); }
  // Survives top-k (the -inf logits never do); z and w set for a candidate.
  __device__ bool cand(float x, float& zz, float& w) const {
    if (x == -INFINITY) return false;
    zz = z(x);
    if (!(zz >= zthr)) return false;
    w = cpu::fast_exp(zz);  // the host's zmax over the candidates is z(lmax) = 0
    return true;
  }
  __device__ bool kept(float x, int64_t c, float& w) const {
    float zz;
    if (!cand(x, zz, w)) return false;
    if (pid != INT32_MAX) {
      const uint32_t k = order_key(zz);
      if (k < pkey || (k == pkey && c > pid)) return false;
    }
    return static_cast<double>(w) >= min_p;
  }
};

// Radix select, 8 bits a round from the top, over the keys of the elements `in(c, key, weight)` admits. By count
// (weight 1) it finds the key of the k-th largest element; by mass the key of the element at which the running
// mass in key-descending order first reaches `target`. Returns that key and sets `above` to the mass (or count)
// of the elements with larger keys; found = false when the whole mass stays below target (rounding: keep all).
template <typename In>
__device__ uint32_t radix_select(const float* row, int64_t vocab, In in, double target, double& above, bool& found) {
  __shared__ double mass[256];
  __shared__ uint32_t count[256];
  __shared__ uint32_t pick_digit;
  __shared__ double pick_above;
  __shared__ bool pick_found;
  __shared__ double wbuf[32][32];  // [warp][lane]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint32_t prefix = 0, mask = 0;
  above = 0.0;
  found = true;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < 256; b += blockDim.x) mass[b] = 0.0, count[b] = 0;
    __syncthreads();
    // Most keys share their top bytes: the lanes of a warp with one digit add up first (in lane order) and their
    // lowest lane makes the two shared atomics, instead of up to 32 atomics on one address.
    for (int64_t base = threadIdx.x - lane; base < vocab; base += blockDim.x) {  // warp-uniform trip count
      const int64_t c = base + lane;
      uint32_t key = 0;
      double w = 0.0;
      const bool valid = c < vocab && in(row[c], c, key, w) && (key & mask) == prefix;
      const uint32_t d = valid ? (key >> shift) & 0xffu : 0x100u;
      const unsigned peers = __match_any_sync(0xffffffffu, d);
      wbuf[warp][lane] = valid ? w : 0.0;
      __syncwarp();
      if (valid && lane == __ffs(peers) - 1) {
        double m = 0.0;
        for (unsigned b = peers; b; b &= b - 1) m += wbuf[warp][__ffs(b) - 1];
        atomicAdd(&mass[d], m);
        atomicAdd(&count[d], static_cast<uint32_t>(__popc(peers)));
      }
      __syncwarp();
    }
    __syncthreads();
    if (threadIdx.x == 0) {  // 256 bins, scanned from the top by one thread
      double acc = above;
      int d = 255, last = -1;
      for (; d >= 0; --d) {
        if (count[d] == 0) continue;
        last = d;
        if (acc + mass[d] >= target) break;
        acc += mass[d];
      }
      if (d < 0) {  // short of target: the lowest non-empty bin (the whole mass is kept at the end)
        pick_found = false;
        d = last < 0 ? 0 : last;
        acc -= last < 0 ? 0.0 : mass[d];
      } else {
        pick_found = true;
      }
      pick_digit = static_cast<uint32_t>(d);
      pick_above = acc;
    }
    __syncthreads();
    prefix |= pick_digit << shift;
    mask |= 0xffu << shift;
    above = pick_above;
    found = found && pick_found;
    __syncthreads();  // the bins are cleared next round
  }
  return prefix;
}

// Warp-segmented search in id order: each warp owns ids [w * seg, (w + 1) * seg); lanes read 32 consecutive ids at
// a time. Pass 1 sums each warp's weights (elements `in` admits); the warp whose segment holds the crossing (base
// + running sum > target, or >= when `reach`) walks it with warp scans and returns that id; every thread gets the
// result. No crossing (rounding): the last admitted id with a positive weight (-1 if none).
template <typename In>
__device__ int32_t first_crossing(const float* row, int64_t vocab, In in, double base, double target, bool reach) {
  __shared__ double warp_total[32];
  __shared__ int32_t result;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
  const int64_t seg = (vocab + n_warps - 1) / n_warps;
  const int64_t lo = warp * seg, hi = lo + seg < vocab ? lo + seg : vocab;
  double sum = 0.0;
  int32_t last_pos = -1;
  for (int64_t c = lo + lane; c < hi; c += 32) {
    double w;
    if (!in(row[c], c, w)) continue;
    sum += w;
    if (w > 0.0) last_pos = static_cast<int32_t>(c);
  }
  sum = warp_sum_f64(sum);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) last_pos = max(last_pos, __shfl_xor_sync(0xffffffffu, last_pos, o));
  if (threadIdx.x == 0) result = -1;
  if (lane == 0) warp_total[warp] = sum;
  __syncthreads();
  double carry = base;
  for (int w = 0; w < warp; ++w) carry += warp_total[w];
  auto crosses = [&](double acc) { return reach ? acc >= target : acc > target; };
  // The walking warp: the first whose segment end crosses (every lane agrees: carry and sum are warp-uniform).
  if (!crosses(carry) && crosses(carry + sum)) {
    double acc = carry;
    int32_t found = last_pos;  // rounding between the two passes: the segment's last positive weight
    for (int64_t c0 = lo; c0 < hi; c0 += 32) {
      const int64_t c = c0 + lane;
      double w = 0.0;
      if (c < hi && !in(row[c], c, w)) w = 0.0;
      double incl = w;  // inclusive warp scan
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const double u = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += u;
      }
      const unsigned hit = __ballot_sync(0xffffffffu, c < hi && w > 0.0 && crosses(acc + incl));
      if (hit) {  // warp-uniform
        found = static_cast<int32_t>(c0) + __ffs(hit) - 1;
        break;
      }
      acc += __shfl_sync(0xffffffffu, incl, 31);
    }
    if (lane == 0) result = found;
  }
  __syncthreads();
  int32_t r = result;
  if (r < 0) {  // nobody crossed: the last positive weight of the row
    __shared__ int32_t s_last[32];
    if (lane == 0) s_last[warp] = last_pos;
    __syncthreads();
    for (int w = 0; w < n_warps; ++w) r = max(r, s_last[w]);
  }
  __syncthreads();
  return r;
}

// One block per row: pass 1 finds the best (value, lowest index) and the lowest NaN/+inf column, pass 2 the
// f32 sum of exp(x - max) for the logprob (the row is re-read from L2). temperature 0 (or no params): the argmax.
// Else the host sampler's steps 4-6 and 8 (sample_filter.cpp) without sorting: top-k by a count radix select on
// the logits' keys (the k-th largest value; boundary ties kept by z >= zthr as on the host); top-p by a mass radix
// select on the candidates' z keys (the boundary's z) and an id-order pass over the boundary's ties; min-p by its
// predicate; then the first id in id order whose running sum exceeds u * total. Weights in f32 as the host's,
// sums in f64 (another order than the host's: ops.h says where a token can differ).
__global__ void sample_logprob_kernel(const float* logits, const SampleParams* params, int64_t vocab,
                                      int32_t* index, float* logprob) {
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
  const float lse_rest = static_cast<float>(log(static_cast<double>(sum)));  // lse = v + log(sum)

  int32_t token = i;
  const SampleParams p = params ? params[blockIdx.x] : SampleParams{};
  if (p.temperature > 0.0f) {
    RowFilter f{v, p.temperature, -INFINITY, 0u, INT32_MAX, 0.0};
    if (p.top_k > 0 && p.top_k < vocab) {  // the k-th largest logit (over every value, -inf included, as the host)
      double above;
      bool found;
      const uint32_t key = radix_select(
          row, vocab,
          [](float x, int64_t, uint32_t& k, double& w) {
            k = order_key(x);
            w = 1.0;
            return true;
          },
          static_cast<double>(p.top_k), above, found);
      const float lthr = key_float(key);
      if (lthr > -INFINITY) f.zthr = f.z(lthr);  // else fewer than k finite logits: all kept
    }
    auto cand_w = [&](float x, int64_t, double& w) {
      float zz, ww;
      if (!f.cand(x, zz, ww)) return false;
      w = ww;
      return true;
    };
    if (p.top_p < 1.0f) {
      double total = 0.0;
      for (int64_t c = threadIdx.x; c < vocab; c += blockDim.x) {
        double w;
        if (cand_w(row[c], c, w)) total += w;
      }
      total = block_sum_f64(total);
      const double target = static_cast<double>(p.top_p) * total;
      double above;
      bool found;
      const uint32_t zkey = radix_select(
          row, vocab,
          [&](float x, int64_t, uint32_t& k, double& w) {
            float zz, ww;
            if (!f.cand(x, zz, ww)) return false;
            k = order_key(zz);
            w = ww;
            return true;
          },
          target, above, found);
      if (found) {  // the boundary's ties in id order: the first whose running mass reaches the target
        auto tie_w = [&](float x, int64_t c, double& w) {
          float zz, ww;
          if (!f.cand(x, zz, ww) || order_key(zz) != zkey) return false;
          w = ww;
          return true;
        };
        const int32_t pid = first_crossing(row, vocab, tie_w, above, target, true);
        f.pkey = zkey;
        f.pid = pid < 0 ? INT32_MAX - 1 : pid;  // rounding left the ties short: keep them all
      }
    }
    if (p.min_p > 0.0f) f.min_p = static_cast<double>(p.min_p);
    auto kept_w = [&](float x, int64_t c, double& w) {
      float ww;
      if (!f.kept(x, c, ww)) return false;
      w = ww;
      return true;
    };
    double total = 0.0;
    for (int64_t c = threadIdx.x; c < vocab; c += blockDim.x) {
      double w;
      if (kept_w(row[c], c, w)) total += w;
    }
    total = block_sum_f64(total);
    const int32_t t = first_crossing(row, vocab, kept_w, 0.0, p.u * total, false);
    token = t >= 0 ? t : i;  // the argmax (weight 1) is always kept: t >= 0 but for a broken invariant
  }
  if (threadIdx.x == 0) {
    index[blockIdx.x] = token;
    // log_softmax at the token: (x - v) - log(sum); the argmax gives -log(sum) as argmax_logprob always did
    logprob[blockIdx.x] = token == i ? -lse_rest : static_cast<float>(static_cast<double>(row[token]) - v - lse_rest);
  }
}

}  // namespace

void sample_logprob(const float* logits, const SampleParams* params, int64_t rows, int64_t vocab, int32_t* index,
                    float* logprob) {
  if (rows == 0) return;
  sample_logprob_kernel<<<static_cast<unsigned>(rows), kThreads, 0, current_stream()>>>(logits, params, vocab, index,
                                                                                          logprob);
  EXL2_CUDA_LAUNCH_CHECK("sample_logprob_kernel");
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
