// Backend kernel signatures, shared by the CPU reference (namespace exl2::cpu, cpp/backend/cpu/) and the CUDA
// backend (namespace exl2::cuda, cuda/). Kernels take raw pointers, sizes and dtypes; they know nothing of
// Tensor and do no argument validation (cpp/ops/ does that). CUDA versions run on the current stream of
// the current device (cuda/stream.h) and never synchronize; CPU versions may use the thread pool.
// "act" pointers are f32 or f16 as `act` says.
#pragma once

#include <cstdint>

#include "exl2/sample_params.h"
#include "exl2/tensor.h"

#define EXL2_BACKEND_KERNELS                                                                                 \
  /* out[n, H] = table[ids[n]] */                                                                            \
  void embedding(const int32_t* ids, int64_t n, const void* table, DType table_dtype, int64_t vocab,        \
                 int64_t hidden, void* out, DType act);                                                     \
  /* out[rows, H] = x / sqrt(mean(x^2) + eps) * w ; out may equal x */                                      \
  void rms_norm(const void* x, const void* w, DType w_dtype, int64_t rows, int64_t hidden, float eps,        \
                void* out, DType act);                                                                       \
  /* out[rows, H] = (x - mean) / sqrt(var + eps) * w[r % w_rows] (LayerNorm without bias; w [w_rows, H]) ;    \
     out may equal x */                                                                                      \
  void layer_norm(const void* x, const void* w, DType w_dtype, int64_t w_rows, int64_t rows, int64_t hidden, \
                  float eps, void* out, DType act);                                                          \
  /* h[rows, H] = h + r (rounded to act, as add), then out = rms_norm(h); out may equal r */                  \
  void add_rms_norm(void* h, const void* r, const void* w, DType w_dtype, int64_t rows, int64_t hidden,      \
                    float eps, void* out, DType act);                                                        \
  /* x[n, n_heads, head_dim] in place; cos_sin f32 [max_pos, head_dim] (cos half, then sin half) */          \
  void rope(void* x, const int32_t* positions, const float* cos_sin, int64_t n, int64_t n_heads,            \
            int64_t head_dim, DType act);                                                                    \
  /* rope of q [n, nq_heads, head_dim] and k [n, nk_heads, head_dim] in one pass */                          \
  void rope_qk(void* q, void* k, const int32_t* positions, const float* cos_sin, int64_t n, int64_t nq_heads, \
               int64_t nk_heads, int64_t head_dim, DType act);                                               \
  /* y[n, out] = x[n, in] @ w[out, in]^T + bias ; bias may be null */                                        \
  void matmul_nt(const void* x, const void* w, DType w_dtype, const void* bias, DType bias_dtype, void* y,   \
                 int64_t n, int64_t in, int64_t out, DType act);                                             \
  void silu_mul(const void* gate, const void* up, void* out, int64_t numel, DType act);                      \
  void add(const void* a, const void* b, void* out, int64_t numel, DType act);                               \
  void gelu_tanh_mul(const void* gate, const void* up, void* out, int64_t numel, DType act);                 \
  /* out = x * s, then cap > 0: cap * tanh(out / cap); out may equal x */                                    \
  void scale(const void* x, void* out, int64_t numel, float s, float cap, DType act);                        \
  void kv_write(const void* k, const void* v, void* k_pages, void* v_pages, DType cache_dtype,               \
                const int32_t* positions, const int32_t* seq_of_token, const int32_t* page_table,            \
                int64_t pages_per_seq, int64_t n, int64_t page_size, int64_t n_heads_kv, int64_t head_dim,    \
                DType act);                                                                                  \
  /* rope_qk then kv_write of the rotated k and of v, in one pass (the same results as the two calls) */      \
  void rope_qk_kv_write(void* q, void* k, const void* v, const int32_t* positions, const float* cos_sin,      \
                        int64_t n, int64_t nq_heads, int64_t nk_heads, int64_t head_dim, void* k_pages,      \
                        void* v_pages, DType cache_dtype, const int32_t* seq_of_token,                       \
                        const int32_t* page_table, int64_t pages_per_seq, int64_t page_size, DType act);     \
  /* n_decode: rows [0, n_decode) go to the decode kernel, the rest to the prefill kernel (a speed hint; */  \
  /* results do not depend on it beyond rounding); < 0: by n alone (ops/ops.h attention_paged) */            \
  /* window > 0: keys positions[t] - window + 1 .. positions[t] only; softcap > 0: capped scores */          \
  void attention_paged(const void* q, const void* k_pages, const void* v_pages, DType cache_dtype,           \
                       const int32_t* positions, const int32_t* seq_of_token, const int32_t* page_table,     \
                       int64_t pages_per_seq, int64_t n, int64_t n_heads, int64_t n_heads_kv,                \
                       int64_t head_dim, int64_t page_size, float scale, void* out, DType act,               \
                       int64_t n_decode = -1, int64_t window = 0, float softcap = 0.f);                      \
  void convert(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t numel);                 \
  /* out[i, :] = x[idx[i], :] for i < m; rows of `row_bytes` bytes; idx clamped to [0, rows) */               \
  void gather_rows(const void* x, const int32_t* idx, int64_t m, int64_t rows, int64_t row_bytes, void* out);  \
  /* per row of logits f32 [rows, vocab]: index = the token picked under params[r] (null: every row greedy, */  \
  /* argmax with the lowest id on ties), logprob = log_softmax at it; a NaN/+inf at lowest column i: index */     \
  /* -2 - i, logprob that value; all -inf: -1, -inf (ops.h sample_logprob) */                                 \
  void sample_logprob(const float* logits, const SampleParams* params, int64_t rows, int64_t vocab,            \
                      int32_t* index, float* logprob);                                                        \
  /* per row of z, d f32 [rows, vocab]: out[r] = KL(softmax(z_r) || softmax(z_r + d_r)) (ops.h logit_kl) */     \
  void logit_kl(const float* z, const float* d, int64_t rows, int64_t vocab, float* out);

namespace exl2::cpu {
EXL2_BACKEND_KERNELS
}  // namespace exl2::cpu

#ifdef EXL2_WITH_CUDA
namespace exl2::cuda {
EXL2_BACKEND_KERNELS
}  // namespace exl2::cuda
#endif

// MoE kernels (ops/ops.h moe_route / moe_group / moe_combine; cpu/moe.cpp, cuda/moe.cu). P = rows * k.
#define EXL2_BACKEND_MOE_KERNELS                                                                               \
  /* logits act [rows, n_experts] -> ids i32 [rows, k], weights f32 [rows, k] (top-k of softmax, fp32) */       \
  void moe_route(const void* logits, DType act, int64_t rows, int64_t n_experts, int64_t k, bool renormalize,  \
                 int32_t* ids, float* weights);                                                                \
  /* ids i32 [P] (clamped to [0, n_experts)) -> offsets [n_experts + 1], perm [P], inv [P], active */           \
  /* [n_experts + 1] */                                                                                         \
  void moe_group(const int32_t* ids, int64_t n_pairs, int64_t n_experts, int32_t* offsets, int32_t* perm,      \
                 int32_t* inv, int32_t* active);                                                               \
  /* out[r] = (add ? out[r] : 0) + sum_j w[r, j] * eo[inv[r k + j]] + sigmoid(g[r]) * shared[r]; shared and */ \
  /* gate may be null (together); gate_dtype f32 or act */                                                     \
  void moe_combine(const void* expert_out, const float* weights, const int32_t* inv, const void* shared,       \
                   const void* shared_gate, DType gate_dtype, int64_t rows, int64_t k, int64_t hidden, bool add, \
                   void* out, DType act);

namespace exl2::cpu {
EXL2_BACKEND_MOE_KERNELS
}  // namespace exl2::cpu

#ifdef EXL2_WITH_CUDA
namespace exl2::cuda {
EXL2_BACKEND_MOE_KERNELS
}  // namespace exl2::cuda
#endif
