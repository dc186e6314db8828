// CPU kv_write: scatter each token's K and V heads into its sequence's page/slot of the paged cache,
// converting act -> cache dtype (indices are range-checked by ops::kv_write); rope_qk_kv_write as rope_qk + kv_write.
#include <vector>

#include "backend/cpu/cpu_common.h"
#include "backend/cpu/thread_pool.h"
#include "backend/kernels.h"

namespace exl2::cpu {

void kv_write(const void* k, const void* v, void* k_pages, void* v_pages, DType cache_dtype, const int32_t* positions,
              const int32_t* seq_of_token, const int32_t* page_table, int64_t pages_per_seq, int64_t n,
              int64_t page_size, int64_t n_heads_kv, int64_t head_dim, DType act) {
  const int64_t row = n_heads_kv * head_dim;  // elements per token
  parallel_for(n, 16, [&](int64_t b, int64_t e) {
    std::vector<float> buf(static_cast<size_t>(row));
    for (int64_t t = b; t < e; ++t) {
      const int64_t pos = positions[t];
      const int64_t page = page_table[static_cast<int64_t>(seq_of_token[t]) * pages_per_seq + pos / page_size];
      const int64_t dst = (page * page_size + pos % page_size) * row;
      detail::row_to_f32(detail::at(k, act, t * row), act, row, buf.data());
      detail::row_from_f32(buf.data(), row, detail::at(k_pages, cache_dtype, dst), cache_dtype);
      detail::row_to_f32(detail::at(v, act, t * row), act, row, buf.data());
      detail::row_from_f32(buf.data(), row, detail::at(v_pages, cache_dtype, dst), cache_dtype);
    }
  });
}

// The CPU reference of the fused op is the two ops in order.
void rope_qk_kv_write(void* q, void* k, const void* v, const int32_t* positions, const float* cos_sin, int64_t n,
                      int64_t nq_heads, int64_t nk_heads, int64_t head_dim, void* k_pages, void* v_pages,
                      DType cache_dtype, const int32_t* seq_of_token, const int32_t* page_table, int64_t pages_per_seq,
                      int64_t page_size, DType act) {
  rope_qk(q, k, positions, cos_sin, n, nq_heads, nk_heads, head_dim, act);
  kv_write(k, v, k_pages, v_pages, cache_dtype, positions, seq_of_token, page_table, pages_per_seq, n, page_size,
           nk_heads, head_dim, act);
}

}  // namespace exl2::cpu
