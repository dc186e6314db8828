// ops::rope, rope_qk and rope_qk_kv_write: checks (x act [n, n_heads, head_dim] with even head_dim, positions i32 [n] < max_pos on CPU,
// cos_sin f32 [max_pos, head_dim]) and dispatch.
#include "backend/kernels.h"
#include "ops/check.h"
#include "ops/ops.h"

namespace exl2::ops {

namespace {

// Checks x (act [n, n_heads, head_dim], even head_dim) against positions and cos_sin; returns n_heads.
int64_t check_rope(const char* op, const char* name, const Tensor& x, const Tensor& positions,
                   const Tensor& cos_sin) {
  detail::check_defined_same_device(op, {{name, &x}, {"positions", &positions}, {"cos_sin", &cos_sin}});
  detail::check_act(op, name, x);
  detail::check_rank(op, name, x, 3);
  const int64_t n = x.size(0), head_dim = x.size(2);
  EXL2_CHECK(head_dim % 2 == 0, op, ": ", name, "'s head_dim (last dim) must be even, got ", x.describe());
  detail::check_dtype(op, "positions", positions, DType::I32);
  detail::check_shape(op, "positions", positions, {n});
  detail::check_dtype(op, "cos_sin", cos_sin, DType::F32);
  detail::check_rank(op, "cos_sin", cos_sin, 2);
  const int64_t max_pos = cos_sin.size(0);
  detail::check_shape(op, "cos_sin", cos_sin, {max_pos, head_dim});
  if (positions.device().is_cpu()) {
    const int32_t* p = positions.data_as<int32_t>();
    for (int64_t i = 0; i < n; ++i)
      EXL2_CHECK(p[i] >= 0 && p[i] < max_pos, op, ": positions[", i, "] must be in [0, ", max_pos,
                 ") (rows of cos_sin), got ", p[i], "; build the RoPE table for a longer context");
  }
  return x.size(1);
}

// rope_qk's checks (q and k per check_rope, same n, head_dim and dtype, not aliased); returns q's n_heads.
int64_t check_rope_qk(const char* op, const Tensor& q, const Tensor& k, const Tensor& positions,
                      const Tensor& cos_sin) {
  const int64_t nq = check_rope(op, "q", q, positions, cos_sin);
  EXL2_CHECK(k.defined() && k.dim() == 3 && k.size(0) == q.size(0) && k.size(2) == q.size(2), op,
             ": q and k must share n and head_dim, got q ", q.describe(), ", k ", k.describe());
  check_rope(op, "k", k, positions, cos_sin);
  detail::check_same_dtype(op, "k", k, "q", q);
  EXL2_CHECK(q.data() != k.data() || q.numel() == 0, op, ": q and k must not alias");
  return nq;
}

}  // namespace

void rope(Tensor& x, const Tensor& positions, const Tensor& cos_sin) {
  const int64_t n_heads = check_rope("rope", "x", x, positions, cos_sin);
  if (x.numel() == 0) return;
  EXL2_OPS_DISPATCH(x.device(), rope, x.data(), positions.data_as<int32_t>(), cos_sin.data_as<float>(), x.size(0),
                    n_heads, x.size(2), x.dtype());
}

void rope_qk(Tensor& q, Tensor& k, const Tensor& positions, const Tensor& cos_sin) {
  const int64_t nq = check_rope_qk("rope_qk", q, k, positions, cos_sin);
  if (q.numel() + k.numel() == 0) return;
  EXL2_OPS_DISPATCH(q.device(), rope_qk, q.data(), k.data(), positions.data_as<int32_t>(), cos_sin.data_as<float>(),
                    q.size(0), nq, k.size(1), q.size(2), q.dtype());
}

void rope_qk_kv_write(Tensor& q, Tensor& k, const Tensor& v, const Tensor& positions, const Tensor& cos_sin,
                      Tensor& k_pages, Tensor& v_pages, const Tensor& seq_of_token, const Tensor& page_table) {
  const char* op = "rope_qk_kv_write";
  const int64_t nq = check_rope_qk(op, q, k, positions, cos_sin);
  detail::check_kv_write(op, k, v, k_pages, v_pages, positions, seq_of_token, page_table);
  const int64_t hd = q.size(2);
  if (q.numel() + k.numel() == 0) return;
  EXL2_OPS_DISPATCH(q.device(), rope_qk_kv_write, q.data(), k.data(), v.data(), positions.data_as<int32_t>(),
                    cos_sin.data_as<float>(), q.size(0), nq, k.size(1), hd, k_pages.data(), v_pages.data(),
                    k_pages.dtype(), seq_of_token.data_as<int32_t>(), page_table.data_as<int32_t>(),
                    page_table.size(1), k_pages.size(1), q.dtype());
}

}  // namespace exl2::ops
