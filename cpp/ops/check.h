// Private argument checks shared by the ops in cpp/ops/*.cpp. Each throws InvalidArgument with a message of
// the form "<op>: <arg> must be <expected>, got <found>" (e.g. "rms_norm: w must be [576], got f16[512]").
#pragma once

#include <initializer_list>
#include <string>
#include <utility>

#include "exl2/tensor.h"

namespace exl2::ops::detail {

using Named = std::pair<const char*, const Tensor*>;

// Every tensor defined; every tensor on the device of the first.
void check_defined_same_device(const char* op, std::initializer_list<Named> tensors);
// Activation dtype: f32 or f16.
void check_act(const char* op, const char* name, const Tensor& t);
// Float weight dtype: f32, f16 or bf16.
void check_float(const char* op, const char* name, const Tensor& t);
void check_dtype(const char* op, const char* name, const Tensor& t, DType dtype);
void check_same_dtype(const char* op, const char* name, const Tensor& t, const char* ref_name, const Tensor& ref);
void check_shape(const char* op, const char* name, const Tensor& t, const Shape& expected);
void check_rank(const char* op, const char* name, const Tensor& t, int64_t rank);
// Rejects overlapping storage of two tensors (for "must not alias").
void check_no_overlap(const char* op, const char* name, const Tensor& a, const char* other, const Tensor& b);
// CPU only: positions in [0, pages_per_seq*page_size), seq ids in [0, n_seqs), used pages in [0, n_pages):
// the page of each position, or (whole_prefix, for attention) every page up to it from the first holding a key of
// the row's window (window > 0; pages wholly before it are never read, so they may hold any id).
void check_paged_indices_host(const char* op, const Tensor& positions, const Tensor& seq_of_token,
                              const Tensor& page_table, int64_t n_pages, int64_t page_size, bool whole_prefix,
                              int64_t window = 0);
// The paged-cache arguments shared by kv_write and attention_paged, for a batch of n tokens of n_heads_kv x
// head_dim: k_pages, v_pages f32/f16 (same dtype) [n_pages, page_size, n_heads_kv, head_dim]; positions,
// seq_of_token i32 [n]; page_table i32 [n_seqs, pages_per_seq]. On CPU also the index ranges (see above).
void check_paged_cache(const char* op, const Tensor& k_pages, const Tensor& v_pages, const Tensor& positions,
                       const Tensor& seq_of_token, const Tensor& page_table, int64_t n, int64_t n_heads_kv,
                       int64_t head_dim, bool whole_prefix, int64_t window = 0);
// kv_write's checks (ops/kv_write.cpp): k, v act [n, n_heads_kv, head_dim], same dtype and shape, and the paged
// cache per check_paged_cache.
void check_kv_write(const char* op, const Tensor& k, const Tensor& v, const Tensor& k_pages, const Tensor& v_pages,
                    const Tensor& positions, const Tensor& seq_of_token, const Tensor& page_table);
// A per-row norm's arguments: x act [..., H], w float [H], out like x, eps finite >= 0. Returns the row count (0 when
// x or H is empty: nothing to do).
int64_t check_row_norm(const char* op, const Tensor& x, const Tensor& w, float eps, const Tensor& out);
// A gated activation's arguments (silu_mul, gelu_tanh_mul): gate act, up and out of gate's dtype and shape.
void check_gated(const char* op, const Tensor& gate, const Tensor& up, const Tensor& out);
// Attention's key window (>= 0; 0: none) and score soft-cap (finite, >= 0; 0: none).
void check_window(const char* op, int64_t window, float softcap);
[[noreturn]] void no_cuda_backend(const char* op);

}  // namespace exl2::ops::detail

// Calls cpu::<op>(...) or cuda::<op>(...) for `device`; without the CUDA backend, CUDA raises Unsupported.
#ifdef EXL2_WITH_CUDA
#define EXL2_OPS_DISPATCH(device, op, ...) \
  do {                                     \
    if ((device).is_cpu())                 \
      ::exl2::cpu::op(__VA_ARGS__);        \
    else                                   \
      ::exl2::cuda::op(__VA_ARGS__);       \
  } while (0)
#else
#define EXL2_OPS_DISPATCH(device, op, ...)       \
  do {                                           \
    if ((device).is_cpu())                       \
      ::exl2::cpu::op(__VA_ARGS__);              \
    else                                         \
      ::exl2::ops::detail::no_cuda_backend(#op); \
  } while (0)
#endif
