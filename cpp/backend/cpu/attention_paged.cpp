// CPU attention_paged: causal GQA attention of each token over its sequence's paged K/V (its sliding window when
// window > 0), two-pass fp32 softmax of the (soft-capped) scores.
// One task per (token, KV head): the group's query heads share each converted K/V row.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "backend/cpu/cpu_common.h"
#include "backend/cpu/thread_pool.h"
#include "backend/cpu/isa.h"
#include "backend/kernels.h"

namespace exl2::cpu {
EXL2_CPU_ISA_BEGIN

void attention_paged(const void* q, const void* k_pages, const void* v_pages, DType cache_dtype,
                     const int32_t* positions, const int32_t* seq_of_token, const int32_t* page_table,
                     int64_t pages_per_seq, int64_t n, int64_t n_heads, int64_t n_heads_kv, int64_t head_dim,
                     int64_t page_size, float scale, void* out, DType act, int64_t /*n_decode: one path*/,
                     int64_t window, float softcap) {
  const int64_t group = n_heads / n_heads_kv;    // query heads per KV head
  const int64_t kv_row = n_heads_kv * head_dim;  // cache elements per (page, slot)
  parallel_for(n * n_heads_kv, 1, [&](int64_t b, int64_t e) {
    std::vector<float> qf(static_cast<size_t>(group * head_dim)), acc(static_cast<size_t>(group * head_dim));
    std::vector<float> kvbuf(static_cast<size_t>(head_dim)), scores;
    for (int64_t task = b; task < e; ++task) {
      const int64_t t = task / n_heads_kv, g = task % n_heads_kv;
      const int64_t len = static_cast<int64_t>(positions[t]) + 1;  // keys first..positions[t]
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int32_t* pages = page_table + static_cast<int64_t>(seq_of_token[t]) * pages_per_seq;
      detail::row_to_f32(detail::at(q, act, (t * n_heads + g * group) * head_dim), act, group * head_dim, qf.data());
      auto cache_row = [&](const void* base, int64_t j) -> const float* {
        const int64_t off =
            ((static_cast<int64_t>(pages[j / page_size]) * page_size + j % page_size) * kv_row) + g * head_dim;
        if (cache_dtype == DType::F32) return static_cast<const float*>(base) + off;
        detail::row_to_f32(detail::at(base, cache_dtype, off), cache_dtype, head_dim, kvbuf.data());
        return kvbuf.data();
      };
      detail::attend_group(
          qf.data(), group, head_dim, first, len, scale, softcap, [&](int64_t j) { return cache_row(k_pages, j); },
          [&](int64_t j) { return cache_row(v_pages, j); }, scores, acc.data());
      detail::row_from_f32(acc.data(), group * head_dim, detail::at(out, act, (t * n_heads + g * group) * head_dim),
                           act);
    }
  });
}

EXL2_CPU_ISA_END

#ifdef EXL2_CPU_ISA_DISPATCHER
EXL2_CPU_ISA_DECLARE(EXL2_BACKEND_KERNELS)

void attention_paged(const void* q, const void* k_pages, const void* v_pages, DType cache_dtype,
                     const int32_t* positions, const int32_t* seq_of_token, const int32_t* page_table,
                     int64_t pages_per_seq, int64_t n, int64_t n_heads, int64_t n_heads_kv, int64_t head_dim,
                     int64_t page_size, float scale, void* out, DType act, int64_t n_decode, int64_t window,
                     float softcap) {
  EXL2_CPU_DISPATCH(attention_paged, q, k_pages, v_pages, cache_dtype, positions, seq_of_token, page_table,
                    pages_per_seq, n, n_heads, n_heads_kv, head_dim, page_size, scale, out, act, n_decode, window,
                    softcap);
}
#endif

}  // namespace exl2::cpu
