// ops::kv_write: checks (k, v act [n, n_heads_kv, head_dim]; paged cache and indices per check.h) and dispatch.
#include "backend/kernels.h"
#include "ops/check.h"
#include "ops/ops.h"

namespace exl2::ops {

void detail::check_kv_write(const char* op, const Tensor& k, const Tensor& v, const Tensor& k_pages,
                            const Tensor& v_pages, const Tensor& positions, const Tensor& seq_of_token,
                            const Tensor& page_table) {
  detail::check_defined_same_device(op, {{"k", &k},
                                         {"v", &v},
                                         {"k_pages", &k_pages},
                                         {"v_pages", &v_pages},
                                         {"positions", &positions},
                                         {"seq_of_token", &seq_of_token},
                                         {"page_table", &page_table}});
  detail::check_act(op, "k", k);
  detail::check_rank(op, "k", k, 3);
  detail::check_same_dtype(op, "v", v, "k", k);
  detail::check_shape(op, "v", v, k.shape());
  detail::check_paged_cache(op, k_pages, v_pages, positions, seq_of_token, page_table, k.size(0), k.size(1), k.size(2),
                            false);
}

void kv_write(const Tensor& k, const Tensor& v, Tensor& k_pages, Tensor& v_pages, const Tensor& positions,
              const Tensor& seq_of_token, const Tensor& page_table) {
  detail::check_kv_write("kv_write", k, v, k_pages, v_pages, positions, seq_of_token, page_table);
  const int64_t n = k.size(0), n_heads_kv = k.size(1), head_dim = k.size(2);
  if (k.numel() == 0) return;
  EXL2_OPS_DISPATCH(k.device(), kv_write, k.data(), v.data(), k_pages.data(), v_pages.data(), k_pages.dtype(),
                    positions.data_as<int32_t>(), seq_of_token.data_as<int32_t>(), page_table.data_as<int32_t>(),
                    page_table.size(1), n, k_pages.size(1), n_heads_kv, head_dim, k.dtype());
}

}  // namespace exl2::ops
