// Argument checks shared by the ops (contract in check.h).
#include "ops/check.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace exl2::ops::detail {

void check_defined_same_device(const char* op, std::initializer_list<Named> tensors) {
  const Named* first = nullptr;
  for (const Named& t : tensors) {
    EXL2_CHECK(t.second->defined(), op, ": ", t.first, " must be a defined tensor, got an undefined one");
    if (!first) {
      first = &t;
      continue;
    }
    EXL2_CHECK(t.second->device() == first->second->device(), op, ": ", t.first, " must be on ",
               first->second->device().str(), " like ", first->first, ", got ", t.second->describe(),
               "; move all arguments to one device");
  }
}

void check_act(const char* op, const char* name, const Tensor& t) {
  EXL2_CHECK(t.dtype() == DType::F32 || t.dtype() == DType::F16, op, ": ", name,
             " must be f32 or f16 (activation dtype), got ", t.describe());
}

void check_float(const char* op, const char* name, const Tensor& t) {
  EXL2_CHECK(t.dtype() == DType::F32 || t.dtype() == DType::F16 || t.dtype() == DType::BF16, op, ": ", name,
             " must be f32, f16 or bf16, got ", t.describe());
}

void check_dtype(const char* op, const char* name, const Tensor& t, DType dtype) {
  EXL2_CHECK(t.dtype() == dtype, op, ": ", name, " must be ", dtype_name(dtype), ", got ", t.describe());
}

void check_same_dtype(const char* op, const char* name, const Tensor& t, const char* ref_name, const Tensor& ref) {
  EXL2_CHECK(t.dtype() == ref.dtype(), op, ": ", name, " must have the dtype of ", ref_name, " (",
             dtype_name(ref.dtype()), "), got ", t.describe());
}

void check_shape(const char* op, const char* name, const Tensor& t, const Shape& expected) {
  EXL2_CHECK(t.shape() == expected, op, ": ", name, " must be ", shape_str(expected), ", got ", dtype_name(t.dtype()),
             shape_str(t.shape()));
}

void check_rank(const char* op, const char* name, const Tensor& t, int64_t rank) {
  EXL2_CHECK(t.dim() == rank, op, ": ", name, " must have ", rank, " dimensions, got ", dtype_name(t.dtype()),
             shape_str(t.shape()));
}

void check_no_overlap(const char* op, const char* name, const Tensor& a, const char* other, const Tensor& b) {
  if (a.device() != b.device() || a.nbytes() == 0 || b.nbytes() == 0) return;
  const auto a0 = reinterpret_cast<uintptr_t>(a.data()), b0 = reinterpret_cast<uintptr_t>(b.data());
  const bool overlap = a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
  EXL2_CHECK(!overlap, op, ": ", name, " must not share memory with ", other, "; pass a separate output tensor");
}

void check_paged_indices_host(const char* op, const Tensor& positions, const Tensor& seq_of_token,
                              const Tensor& page_table, int64_t n_pages, int64_t page_size, bool whole_prefix,
                              int64_t window) {
  const int64_t n = positions.numel(), n_seqs = page_table.size(0), pages_per_seq = page_table.size(1);
  const int32_t* pos = positions.data_as<int32_t>();
  const int32_t* seq = seq_of_token.data_as<int32_t>();
  const int32_t* table = page_table.data_as<int32_t>();
  for (int64_t t = 0; t < n; ++t) {
    EXL2_CHECK(seq[t] >= 0 && seq[t] < n_seqs, op, ": seq_of_token[", t, "] must be in [0, ", n_seqs,
               ") (rows of page_table), got ", seq[t]);
    EXL2_CHECK(pos[t] >= 0 && pos[t] < pages_per_seq * page_size, op, ": positions[", t, "] must be in [0, ",
               pages_per_seq * page_size, ") (pages_per_seq * page_size), got ", pos[t],
               "; allocate more pages per sequence");
    const int64_t first = !whole_prefix ? pos[t] : window > 0 ? std::max<int64_t>(0, pos[t] - window + 1) : 0;
    for (int64_t p = first / page_size; p <= pos[t] / page_size; ++p) {
      const int64_t page = table[seq[t] * pages_per_seq + p];
      EXL2_CHECK(page >= 0 && page < n_pages, op, ": page_table[", seq[t], ", ", p, "] (used by token ", t,
                 ") must be in [0, ", n_pages, "), got ", page);
    }
  }
}

void check_paged_cache(const char* op, const Tensor& k_pages, const Tensor& v_pages, const Tensor& positions,
                       const Tensor& seq_of_token, const Tensor& page_table, int64_t n, int64_t n_heads_kv,
                       int64_t head_dim, bool whole_prefix, int64_t window) {
  EXL2_CHECK(k_pages.dtype() == DType::F32 || k_pages.dtype() == DType::F16, op,
             ": k_pages must be f32 or f16 (cache dtype), got ", k_pages.describe());
  check_rank(op, "k_pages", k_pages, 4);
  const int64_t n_pages = k_pages.size(0), page_size = k_pages.size(1);
  EXL2_CHECK(page_size >= 1, op, ": k_pages's page_size (dim 1) must be >= 1, got ", k_pages.describe());
  check_shape(op, "k_pages", k_pages, {n_pages, page_size, n_heads_kv, head_dim});
  check_same_dtype(op, "v_pages", v_pages, "k_pages", k_pages);
  check_shape(op, "v_pages", v_pages, k_pages.shape());
  check_dtype(op, "positions", positions, DType::I32);
  check_shape(op, "positions", positions, {n});
  check_dtype(op, "seq_of_token", seq_of_token, DType::I32);
  check_shape(op, "seq_of_token", seq_of_token, {n});
  check_dtype(op, "page_table", page_table, DType::I32);
  check_rank(op, "page_table", page_table, 2);
  if (positions.device().is_cpu())
    check_paged_indices_host(op, positions, seq_of_token, page_table, n_pages, page_size, whole_prefix, window);
}

int64_t check_row_norm(const char* op, const Tensor& x, const Tensor& w, float eps, const Tensor& out) {
  check_defined_same_device(op, {{"x", &x}, {"w", &w}, {"out", &out}});
  check_act(op, "x", x);
  EXL2_CHECK(x.dim() >= 1, op, ": x must have >= 1 dimension, got ", x.describe());
  check_float(op, "w", w);
  const int64_t hidden = x.size(-1);
  check_shape(op, "w", w, {hidden});
  check_same_dtype(op, "out", out, "x", x);
  check_shape(op, "out", out, x.shape());
  EXL2_CHECK(std::isfinite(eps) && eps >= 0.0f, op, ": eps must be a finite number >= 0, got ", eps);
  return hidden ? x.numel() / hidden : 0;
}

void check_gated(const char* op, const Tensor& gate, const Tensor& up, const Tensor& out) {
  check_defined_same_device(op, {{"gate", &gate}, {"up", &up}, {"out", &out}});
  check_act(op, "gate", gate);
  check_same_dtype(op, "up", up, "gate", gate);
  check_same_dtype(op, "out", out, "gate", gate);
  check_shape(op, "up", up, gate.shape());
  check_shape(op, "out", out, gate.shape());
}

void check_window(const char* op, int64_t window, float softcap) {
  EXL2_CHECK(window >= 0, op, ": window must be >= 0 (0: no sliding window), got ", window);
  EXL2_CHECK(std::isfinite(softcap) && softcap >= 0.0f, op, ": softcap must be a finite number >= 0 (0: none), got ",
             softcap);
}

void no_cuda_backend(const char* op) {
  EXL2_FAIL(Unsupported, op,
            ": this build of exl2cpp has no CUDA backend (built without nvcc); use CPU tensors or "
            "reinstall with the CUDA toolkit on PATH");
}

}  // namespace exl2::ops::detail
