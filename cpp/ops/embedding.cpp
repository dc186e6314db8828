// ops::embedding: checks (ids i32 [n] in range on CPU, table float [V, H], out act [n, H]) and dispatch.
#include "backend/kernels.h"
#include "ops/check.h"
#include "ops/ops.h"

namespace exl2::ops {

void embedding(const Tensor& ids, const Tensor& table, Tensor& out) {
  const char* op = "embedding";
  detail::check_defined_same_device(op, {{"ids", &ids}, {"table", &table}, {"out", &out}});
  detail::check_dtype(op, "ids", ids, DType::I32);
  detail::check_rank(op, "ids", ids, 1);
  detail::check_float(op, "table", table);
  detail::check_rank(op, "table", table, 2);
  detail::check_act(op, "out", out);
  const int64_t n = ids.size(0), vocab = table.size(0), hidden = table.size(1);
  detail::check_shape(op, "out", out, {n, hidden});
  if (n == 0) return;
  if (ids.device().is_cpu()) {
    const int32_t* p = ids.data_as<int32_t>();
    for (int64_t i = 0; i < n; ++i)
      EXL2_CHECK(p[i] >= 0 && p[i] < vocab, op, ": ids[", i, "] must be a token id in [0, ", vocab,
                 ") (rows of table), got ", p[i]);
  }
  EXL2_OPS_DISPATCH(ids.device(), embedding, ids.data_as<int32_t>(), n, table.data(), table.dtype(), vocab, hidden,
                    out.data(), out.dtype());
}

}  // namespace exl2::ops
