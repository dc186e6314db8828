// cuda::rope_qk_kv_write: rope of q and k and the paged-cache write of the rotated k and of v in one pass, V pairs
// per thread with vector loads (the fusion of cuda/rope.cu's rope_qk_kernel and cuda/kv_write.cu's kernel).
#include "backend/kernels.h"
#include "cuda/common.cuh"
#include "cuda/pdl.cuh"

namespace exl2::cuda {

namespace {

template <typename T, int V>
struct alignas(sizeof(T) * V) Vec {
  T v[V];
};

// Index space: per token, nq + nk heads of half / V groups of V pairs; pair i of a head is (x[i], x[i + half]).
// A q group is rotated in place. A k group is rotated in place and, with the v group at the same place, written to
// the token's page slot. Rounding as the two kernels: the rotated value is rounded to TA, then converted to TC.
template <typename TA, typename TC, int V>
__global__ void rope_qk_kv_write_kernel(TA* __restrict__ q, TA* __restrict__ k, const TA* __restrict__ v,
                                        const int32_t* __restrict__ positions, const float* __restrict__ cos_sin,
                                        int64_t n, int nq, int nk, int head_dim, TC* __restrict__ k_pages,
                                        TC* __restrict__ v_pages, const int32_t* __restrict__ seq_of_token,
                                        const int32_t* __restrict__ page_table, int64_t pages_per_seq,
                                        int64_t page_size) {
  pdl_wait();  // cuda/pdl.cuh: q, k, v and the cache rows belong to earlier kernels
  const int half = head_dim / 2, groups = half / V;
  const int64_t per_token = int64_t(nq + nk) * groups, total = n * per_token;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = idx / per_token;
    const int r = static_cast<int>(idx - t * per_token);
    const int h = r / groups, i = (r - h * groups) * V;
    const int64_t pos = positions[t];
    const float* cs = cos_sin + pos * head_dim;
    const Vec<float, V> c = *reinterpret_cast<const Vec<float, V>*>(cs + i);
    const Vec<float, V> s = *reinterpret_cast<const Vec<float, V>*>(cs + half + i);
    const bool is_q = h < nq;
    TA* xh = is_q ? q + (t * nq + h) * head_dim : k + (t * nk + (h - nq)) * head_dim;
    Vec<TA, V> a = *reinterpret_cast<const Vec<TA, V>*>(xh + i);
    Vec<TA, V> b = *reinterpret_cast<const Vec<TA, V>*>(xh + half + i);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float x1 = to_f32(a.v[j]), x2 = to_f32(b.v[j]);
      a.v[j] = from_f32<TA>(rope_lo(x1, x2, c.v[j], s.v[j]));
      b.v[j] = from_f32<TA>(rope_hi(x1, x2, c.v[j], s.v[j]));
    }
    *reinterpret_cast<Vec<TA, V>*>(xh + i) = a;
    *reinterpret_cast<Vec<TA, V>*>(xh + half + i) = b;
    if (is_q) continue;
    const int64_t hk = h - nq;
    const int64_t page = page_table[int64_t(seq_of_token[t]) * pages_per_seq + pos / page_size];
    const int64_t dst = ((page * page_size + pos % page_size) * nk + hk) * head_dim;
    const TA* vh = v + (t * nk + hk) * head_dim;
    const Vec<TA, V> va = *reinterpret_cast<const Vec<TA, V>*>(vh + i);
    const Vec<TA, V> vb = *reinterpret_cast<const Vec<TA, V>*>(vh + half + i);
    Vec<TC, V> ka, kb, oa, ob;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      ka.v[j] = from_f32<TC>(to_f32(a.v[j]));
      kb.v[j] = from_f32<TC>(to_f32(b.v[j]));
      oa.v[j] = from_f32<TC>(to_f32(va.v[j]));
      ob.v[j] = from_f32<TC>(to_f32(vb.v[j]));
    }
    *reinterpret_cast<Vec<TC, V>*>(k_pages + dst + i) = ka;
    *reinterpret_cast<Vec<TC, V>*>(k_pages + dst + half + i) = kb;
    *reinterpret_cast<Vec<TC, V>*>(v_pages + dst + i) = oa;
    *reinterpret_cast<Vec<TC, V>*>(v_pages + dst + half + i) = ob;
  }
}

}  // namespace

void rope_qk_kv_write(void* q, void* k, const void* v, const int32_t* positions, const float* cos_sin, int64_t n,
                      int64_t nq_heads, int64_t nk_heads, int64_t head_dim, void* k_pages, void* v_pages,
                      DType cache_dtype, const int32_t* seq_of_token, const int32_t* page_table, int64_t pages_per_seq,
                      int64_t page_size, DType act) {
  const int64_t half = head_dim / 2;
  if (n * (nq_heads + nk_heads) * half == 0) return;
  EXL2_CHECK(nq_heads + nk_heads <= INT_MAX && head_dim <= INT_MAX, "rope_qk_kv_write: too many heads (",
             nq_heads, " + ", nk_heads, ") or head_dim ", head_dim);
  EXL2_DISPATCH_ACT(act, "rope_qk_kv_write", [&](auto ta) {
    using TA = decltype(ta);
    EXL2_DISPATCH_FLOAT(cache_dtype, "rope_qk_kv_write cache", [&](auto tc) {
      using TC = decltype(tc);
      // Vectors of 4 pairs when the halves allow it (then every head row and both halves are multiples of the
      // vector) and the base pointers are aligned to it, else 2, else 1.
      auto fits = [&](int vp) {
        auto al = [&](const void* p, size_t b) { return reinterpret_cast<uintptr_t>(p) % (b * vp) == 0; };
        return half % vp == 0 && al(q, sizeof(TA)) && al(k, sizeof(TA)) && al(v, sizeof(TA)) &&
               al(k_pages, sizeof(TC)) && al(v_pages, sizeof(TC)) && al(cos_sin, sizeof(float));
      };
      const int vec = fits(4) ? 4 : fits(2) ? 2 : 1;
      constexpr int kThreads = 256;
      auto launch = [&](auto kernel, int v_pairs) {
        const int64_t total = n * (nq_heads + nk_heads) * (half / v_pairs);
        EXL2_CUDA_LAUNCH_PDL("rope_qk_kv_write_kernel", kernel, elementwise_blocks(total, kThreads), kThreads, 0,
                             current_stream(), static_cast<TA*>(q), static_cast<TA*>(k), static_cast<const TA*>(v),
                             positions, cos_sin, n, static_cast<int>(nq_heads), static_cast<int>(nk_heads),
                             static_cast<int>(head_dim), static_cast<TC*>(k_pages), static_cast<TC*>(v_pages),
                             seq_of_token, page_table, pages_per_seq, page_size);
      };
      if (vec == 4)
        launch(rope_qk_kv_write_kernel<TA, TC, 4>, 4);
      else if (vec == 2)
        launch(rope_qk_kv_write_kernel<TA, TC, 2>, 2);
      else
        launch(rope_qk_kv_write_kernel<TA, TC, 1>, 1);
    });
  });
}

}  // namespace exl2::cuda
