// cuda::moe_route / moe_group / moe_combine (ops/ops.h): the MoE router's top-k, the grouping of (row, slot) pairs
// by expert and the weighted combine, each one kernel reading its indices on the device (no host sync, so a decode
// step with them can be captured into a CUDA graph and replayed with new router logits).
#include <cmath>

#include "backend/kernels.h"
#include "cuda/common.cuh"
#include "cuda/pdl.cuh"

namespace exl2::cuda {

namespace {

constexpr int kRouteWarps = 4;      // rows per router block (one warp each)
constexpr int kGroupThreads = 256;  // the grouping's one block
constexpr int kCombineThreads = 256;

// The router's order (as cpu/moe.cpp): larger logit first, NaN below -inf, ties to the lower id.
__device__ __forceinline__ bool route_before(float a, int ia, float b, int ib) {
  const bool na = isnan(a), nb = isnan(b);
  if (na != nb) return nb;
  if (!na && a != b) return a > b;
  return ia < ib;
}

// One warp per row: the row's logits in shared memory (f32), max and exp-sum by warp reductions, then k rounds of
// a warp arg-best over the experts not yet taken. Lane 0 writes ids and weights (renormalized in slot order).
template <typename TA>
__global__ void __launch_bounds__(kRouteWarps * 32)
    moe_route_kernel(const TA* __restrict__ logits, int64_t rows, int n_experts, int k, bool renormalize,
                     int32_t* __restrict__ ids, float* __restrict__ weights) {
  __shared__ float sl[kRouteWarps][1024];  // ops::kMoeMaxExperts
  __shared__ unsigned char taken[kRouteWarps][1024];
  pdl_wait();  // cuda/pdl.cuh
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t r = int64_t(blockIdx.x) * kRouteWarps + w;
  if (r >= rows) return;
  float* l = sl[w];
  unsigned char* tk = taken[w];
  float mx = -INFINITY;
  for (int e = lane; e < n_experts; e += 32) {
    const float v = to_f32(logits[r * n_experts + e]);
    l[e] = v;
    tk[e] = 0;
    mx = fmaxf(mx, v);  // NaN ignored, as the CPU's `v > mx`
  }
  mx = warp_max(mx);
  float z = 0.f;
  for (int e = lane; e < n_experts; e += 32) z += expf(l[e] - mx);
  z = warp_sum(z);
  __syncwarp();
  float sel = 0.f;
  for (int j = 0; j < k; ++j) {
    int best = -1;
    float bv = 0.f;
    for (int e = lane; e < n_experts; e += 32)
      if (!tk[e] && (best < 0 || route_before(l[e], e, bv, best))) best = e, bv = l[e];
#pragma unroll
    for (int o = 16; o > 0; o /= 2) {
      const int ob = __shfl_xor_sync(0xffffffffu, best, o);
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      if (ob >= 0 && (best < 0 || route_before(ov, ob, bv, best))) best = ob, bv = ov;
    }
    if (lane == 0) {
      tk[best] = 1;
      const float p = expf(bv - mx) / z;
      ids[r * k + j] = best;
      weights[r * k + j] = p;
      sel += p;
    }
    __syncwarp();
  }
  if (lane == 0 && renormalize)
    for (int j = 0; j < k; ++j) weights[r * k + j] /= sel;
}

// One block. Warp 0 ranks the pairs in ascending flat order, 32 at a time (lanes of one expert found by
// __match_any_sync; rank = the expert's running count + the lanes of it below), which also counts them; then the
// scan of the counts into offsets and the active list (warp 0, ballots); then every thread places its pairs.
__global__ void __launch_bounds__(kGroupThreads)
    moe_group_kernel(const int32_t* __restrict__ ids, int n_pairs, int n_experts, int32_t* __restrict__ offsets,
                     int32_t* __restrict__ perm, int32_t* __restrict__ inv, int32_t* __restrict__ active) {
  __shared__ int run[1024 + 1];  // ops::kMoeMaxExperts: running counts, then offsets
  pdl_wait();
  for (int e = threadIdx.x; e <= n_experts; e += kGroupThreads) run[e] = 0;
  __syncthreads();
  const int lane = threadIdx.x % 32;
  auto expert = [&](int i) {
    const int e = ids[i];
    return e < 0 ? 0 : (e >= n_experts ? n_experts - 1 : e);
  };
  if (threadIdx.x < 32) {
    const unsigned lt = (1u << lane) - 1u;
    for (int base = 0; base < n_pairs; base += 32) {
      const int i = base + lane;
      const bool on = i < n_pairs;
      const unsigned live = __ballot_sync(0xffffffffu, on);
      const int e = on ? expert(i) : -1 - lane;  // inactive lanes match nobody
      const unsigned same = __match_any_sync(0xffffffffu, e) & live;
      const int before = run[on ? e : 0];
      __syncwarp();
      if (on) {
        inv[i] = before + __popc(same & lt);                           // the rank inside the expert, for now
        if (lane == 31 - __clz(same)) run[e] = before + __popc(same);  // the expert's highest lane updates
      }
      __syncwarp();
    }
    // exclusive scan of run[0 .. n_experts) into offsets; run[e] becomes offsets[e]; active list by ballots
    int carry = 0, n_active = 0;
    for (int base = 0; base < n_experts; base += 32) {
      const int e = base + lane;
      const int c = e < n_experts ? run[e] : 0;
      int s = c;
#pragma unroll
      for (int o = 1; o < 32; o *= 2) {
        const int t = __shfl_up_sync(0xffffffffu, s, o);
        if (lane >= o) s += t;
      }
      const unsigned has = __ballot_sync(0xffffffffu, c > 0);
      if (e < n_experts) {
        const int off = carry + s - c;
        offsets[e] = off;
        run[e] = off;
        if (c > 0) active[n_active + __popc(has & ((1u << lane) - 1u))] = e;
      }
      carry += __shfl_sync(0xffffffffu, s, 31);
      n_active += __popc(has);
      __syncwarp();
    }
    for (int e = n_active + lane; e < n_experts; e += 32) active[e] = -1;
    if (lane == 0) {
      offsets[n_experts] = carry;
      active[n_experts] = n_active;
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < n_pairs; i += kGroupThreads) {
    const int p = run[expert(i)] + inv[i];
    perm[p] = i;
    inv[i] = p;
  }
}

// One thread per output element; the sum in slot order, then the shared expert, then the residual: as cpu/moe.cpp.
template <typename TA, typename TG>
__global__ void __launch_bounds__(kCombineThreads)
    moe_combine_kernel(const TA* __restrict__ eo, const float* __restrict__ weights, const int32_t* __restrict__ inv,
                       const TA* __restrict__ shared, const TG* __restrict__ gate, int64_t rows, int k, int64_t hidden,
                       bool add, TA* __restrict__ out) {
  pdl_wait();
  const int64_t r = blockIdx.y, c = int64_t(blockIdx.x) * kCombineThreads + threadIdx.x;
  if (r >= rows || c >= hidden) return;
  const int64_t n_pairs = rows * k;
  float sum = 0.f;
  for (int j = 0; j < k; ++j) {
    int64_t p = inv[r * k + j];
    p = p < 0 ? 0 : (p >= n_pairs ? n_pairs - 1 : p);
    sum += weights[r * k + j] * to_f32(eo[p * hidden + c]);
  }
  if (shared != nullptr) {
    const float s = 1.f / (1.f + expf(-to_f32(gate[r])));
    sum += s * to_f32(shared[r * hidden + c]);
  }
  const int64_t o = r * hidden + c;
  out[o] = from_f32<TA>(add ? to_f32(out[o]) + sum : sum);
}

}  // namespace

void moe_route(const void* logits, DType act, int64_t rows, int64_t n_experts, int64_t k, bool renormalize,
               int32_t* ids, float* weights) {
  if (rows == 0) return;
  EXL2_CHECK_KIND(Unsupported, n_experts <= 1024 && rows <= int64_t(kRouteWarps) * 0x7fffffff,
                  "CUDA moe_route: at most 1024 experts, got ", n_experts);
  EXL2_DISPATCH_ACT(act, "moe_route", [&](auto ta) {
    using TA = decltype(ta);
    EXL2_CUDA_LAUNCH_PDL("moe_route_kernel", moe_route_kernel<TA>, static_cast<unsigned>(ceil_div(rows, kRouteWarps)),
                         kRouteWarps * 32, 0, current_stream(), static_cast<const TA*>(logits), rows,
                         static_cast<int>(n_experts), static_cast<int>(k), renormalize, ids, weights);
  });
}

void moe_group(const int32_t* ids, int64_t n_pairs, int64_t n_experts, int32_t* offsets, int32_t* perm, int32_t* inv,
               int32_t* active) {
  EXL2_CHECK_KIND(Unsupported, n_experts <= 1024, "CUDA moe_group: at most 1024 experts, got ", n_experts);
  EXL2_CUDA_LAUNCH_PDL("moe_group_kernel", moe_group_kernel, 1u, kGroupThreads, 0, current_stream(), ids,
                       static_cast<int>(n_pairs), static_cast<int>(n_experts), offsets, perm, inv, active);
}

void moe_combine(const void* expert_out, const float* weights, const int32_t* inv, const void* shared,
                 const void* shared_gate, DType gate_dtype, int64_t rows, int64_t k, int64_t hidden, bool add,
                 void* out, DType act) {
  if (rows == 0 || hidden == 0) return;
  EXL2_CHECK_KIND(Unsupported, rows <= 65535, "CUDA moe_combine: at most 65535 rows per call, got ", rows);
  const dim3 grid(static_cast<unsigned>(ceil_div(hidden, kCombineThreads)), static_cast<unsigned>(rows));
  EXL2_DISPATCH_ACT(act, "moe_combine", [&](auto ta) {
    using TA = decltype(ta);
    auto launch = [&](auto tg) {
      using TG = decltype(tg);
      EXL2_CUDA_LAUNCH_PDL("moe_combine_kernel", moe_combine_kernel<TA, TG>, grid, kCombineThreads, 0, current_stream(),
                           static_cast<const TA*>(expert_out), weights, inv, static_cast<const TA*>(shared),
                           static_cast<const TG*>(shared_gate), rows, static_cast<int>(k), hidden, add,
                           static_cast<TA*>(out));
    };
    if (gate_dtype == DType::F32)
      launch(float{});
    else
      launch(TA{});
  });
}

}  // namespace exl2::cuda
