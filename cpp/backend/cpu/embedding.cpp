// CPU embedding: out[i, :] = table[ids[i], :] converted to act (ids are range-checked by ops::embedding).
#include <vector>

#include "backend/cpu/cpu_common.h"
#include "backend/cpu/thread_pool.h"
#include "backend/kernels.h"

namespace exl2::cpu {

void embedding(const int32_t* ids, int64_t n, const void* table, DType table_dtype, int64_t vocab, int64_t hidden,
               void* out, DType act) {
  parallel_for(n, 16, [&](int64_t b, int64_t e) {
    std::vector<float> row(static_cast<size_t>(hidden));
    for (int64_t i = b; i < e; ++i) {
      detail::row_to_f32(detail::at(table, table_dtype, static_cast<int64_t>(ids[i]) * hidden), table_dtype, hidden,
                         row.data());
      detail::row_from_f32(row.data(), hidden, detail::at(out, act, i * hidden), act);
    }
  });
}

}  // namespace exl2::cpu
