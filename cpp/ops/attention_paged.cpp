// ops::attention_paged: checks (q, out act [n, n_heads, head_dim], n_heads a multiple of the cache's n_heads_kv,
// out not aliasing q; paged cache and indices per check.h) and dispatch.
#include "backend/kernels.h"
#include "ops/check.h"
#include "ops/ops.h"

namespace exl2::ops {

void attention_paged(const Tensor& q, const Tensor& k_pages, const Tensor& v_pages, const Tensor& positions,
                     const Tensor& seq_of_token, const Tensor& page_table, float scale, Tensor& out) {
  const char* op = "attention_paged";
  detail::check_defined_same_device(op, {{"q", &q},
                                         {"k_pages", &k_pages},
                                         {"v_pages", &v_pages},
                                         {"positions", &positions},
                                         {"seq_of_token", &seq_of_token},
                                         {"page_table", &page_table},
                                         {"out", &out}});
  detail::check_act(op, "q", q);
  detail::check_rank(op, "q", q, 3);
  detail::check_rank(op, "k_pages", k_pages, 4);
  const int64_t n = q.size(0), n_heads = q.size(1), head_dim = q.size(2), n_heads_kv = k_pages.size(2);
  EXL2_CHECK(n_heads_kv >= 1 && n_heads % n_heads_kv == 0, op, ": q's n_heads (", n_heads,
             ") must be a multiple of k_pages's n_heads_kv (dim 2), got ", k_pages.describe());
  detail::check_paged_cache(op, k_pages, v_pages, positions, seq_of_token, page_table, n, n_heads_kv, head_dim,
                            true);
  detail::check_same_dtype(op, "out", out, "q", q);
  detail::check_shape(op, "out", out, q.shape());
  detail::check_no_overlap(op, "out", out, "q", q);
  if (q.numel() == 0) return;
  EXL2_OPS_DISPATCH(q.device(), attention_paged, q.data(), k_pages.data(), v_pages.data(), k_pages.dtype(),
                    positions.data_as<int32_t>(), seq_of_token.data_as<int32_t>(), page_table.data_as<int32_t>(),
                    page_table.size(1), n, n_heads, n_heads_kv, head_dim, k_pages.size(1), scale, out.data(),
                    q.dtype());
}

}  // namespace exl2::ops
