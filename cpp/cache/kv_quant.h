// Quantized KV-cache format (Q8/Q6/Q4 with a Hadamard rotation) and the backend kernels that write and read it.
//
// Format. Each (token, KV head) row x of head_dim values is stored rotated, y = R x with R = H_blk * S:
//   S: diag(+-1), s_i = kv_rot_sign(i) (fixed pseudo-random signs over the row index i, so structured rows do not
//      collapse onto one Hadamard basis vector);
//   H_blk: the normalized Walsh-Hadamard transform (Sylvester order, entries +-1/sqrt(B)) on consecutive blocks of
//      B = kv_rot_block(head_dim) values (B = head_dim when it is a power of two, else its largest power-of-two
//      divisor; >= 32 since head_dim % 32 == 0). R is orthonormal, R^-1 = S * H_blk.
// y is then quantized per block of kKvQuantBlock = 32 values with `bits` in {8, 6, 4}.
// Q8/Q6 (symmetric, one f16 per block; qn = 2^(bits-1)):
//   m = the value of largest |y| in the block (first one on ties), d = fp16(m / -qn) (stored scale, f16 bits);
//   code_i = clamp(rint(y_i / d), -qn, qn - 1) + qn (unsigned, in [0, 2^bits)); d == 0 -> every code is qn;
//   dequantized value = (code_i - qn) * d. rint = round half to even (std::nearbyint, np.rint, __float2int_rn).
// Q4 (asymmetric with an MSE-chosen clip, two f16 per block: scale d then offset z):
//   mn, mx = min and max of the block; for each clip c_j of kv_q4_clip(j), j = 0..kKvQ4Clips-1 (1.0 down to 0.7):
//     d_j = fp16((mx*c_j - mn*c_j) / 15), z_j = fp16(mn*c_j), code_i = clamp(rint((y_i - z_j) / d_j), 0, 15)
//     (d_j == 0 -> code 0), err_j = sum of fp32 (fma(code_i, d_j, z_j) - y_i)^2 summed as a pairwise tree
//     (s_i + s_{i+16}, then + 8, 4, 2, 1: a warp butterfly's order, so CPU and CUDA pick the same j);
//   the first j with the smallest err_j is kept (d, z, codes, err). Then up to kKvQ4Refits = 2 least-squares
//   refits: with the kept codes q_i, tree sums (same order) Sq = sum q_i, Sqq = sum q_i^2, Sy = sum y_i,
//   Sqy = sum fp32(q_i * y_i); det = 32 * Sqq - Sq^2 (exact); stop unless det > 0;
//   d' = fp16((32 * Sqy - fp32(Sq * Sy)) / det), z' = fp16((Sy - fp32(d' * Sq)) / 32) (d' before its f16 rounding),
//   codes and err' as above for (d', z'); stop unless err' < err, else keep (d', z', codes', err') and repeat.
//   The kept (d, z) is stored; dequantized value = fma(code_i, d, z). (On SmolLM2 the asymmetric clipped grid
//   halved the Q4 perplexity loss of a symmetric absmax grid; the refit, which fixes skewed blocks that the clip
//   search shrinks at both ends alike, halves it again: bench/kv_cache_quality.py.)
// Codes of one row form a little-endian bit stream: code i occupies bits [bits*i, bits*i + bits) of the row's
// kv_row_bytes(head_dim, bits) = head_dim * bits / 8 bytes (Q4: code 2i in the low nibble of byte i; Q6: 4 codes
// in 3 bytes). Per layer the cache holds
//   k_q, v_q: u8 [n_pages, page_size, n_heads_kv, head_dim * bits / 8]
//   k_s, v_s: f16 [n_pages, page_size, n_heads_kv, kv_n_scales(head_dim, bits)] (Q4: d_0, z_0, d_1, z_1, ...)
// = Q4: 5 bits per value (codes + scale + offset), Q6: 6.5, Q8: 8.5; f16: 16.
//
// K centring: kv_write_q may subtract a centre c from every K row before the rotation: x <- x - c (fp32), then
// y = R x as above. V is never centred. Two kinds, both from mu [n_heads_kv, head_dim] (f32) per KV head h:
//   fixed: c = mu_h, the same for every position. Attention needs no change: every score of one query row shifts
//     by the same q . mu_h and softmax is invariant to that.
//   RoPE-aware (a rope table is passed): c = RoPE(mu_h, p), mu_h a PRE-RoPE vector rotated to the row's position p
//     with the model's table rope f32 [max_pos, head_dim] (row p: cos in [0, d/2), sin after, yarn's factor
//     included; the "rotate_half" convention of ops::rope). With m1 = mu_h[i], m2 = mu_h[d/2 + i],
//     co = rope[p][i], si = rope[p][d/2 + i] (i < d/2):
//       c[i] = fma(m1, co, -(m2 * si)),  c[d/2 + i] = fma(m2, co, m1 * si)   (the product rounded once, then fused).
//     RoPE turns a constant pre-RoPE mean into a vector that rotates with the position; a fixed c removes only the
//     pairs that barely turn (the lowest frequencies), this one removes all of them (SmolLM2 Q4 KL -34..40%:
//     bench/kv_cache_quality.py). Softmax is no longer invariant, so attention adds the centre back per key:
//     score_j = scale * (q . k_hat_j + q . RoPE(mu_h, j)), with q . RoPE(mu_h, j) = sum_i a_i co_j[i] + b_i si_j[i],
//     a_i = q1_i m1_i + q2_i m2_i, b_i = q2_i m1_i - q1_i m2_i (q1, q2: halves of the post-RoPE query row, fp32;
//     one d-long dot per key against rope row j, the key's position).
// The attention's k_mean/rope must be the ones the keys were written with; mu must stay constant while any key
// written with it is in the cache. KVCache fixes it per layer from the first K rows written (KVCache::set_k_mean:
// their plain mean for the fixed kind, the mean of the rows un-rotated by their positions for the RoPE-aware one).
// (SmolLM2 Q4, fixed centring: +3.7% -> +3.4%; see bench/kv_cache_quality.py.)
//
// Sink rows: the first key of a sequence (position 0, the "attention sink" that most heads attend to heavily)
// carries ~1/3 of Q4's KL on SmolLM2, so a cache may keep it unquantized: sink stores k_sink, v_sink f16
// [n_pages, n_heads_kv, head_dim] hold, for the page that holds a sequence's position 0 (page_table[seq][0]), the
// rotated (and, for K, centred) fp32 rows y of that position rounded to f16. kv_write_q writes them (besides the
// quantized slot) for every row with positions[t] == 0; attention reads key and value 0 of a sequence from them
// instead of dequantizing (everything else as above: the centre is still added back for key 0). Pages shared
// by prefix deduplication share their sink rows with the position 0 they hold. (SmolLM2 Q4 KL -35% on top of the
// RoPE-aware centre: bench/kv_cache_quality.py.)
//
// Attention never un-rotates K: since R is orthonormal, q . k = (R q) . (R k), so q is rotated once per row; the
// softmax-weighted sum of V is accumulated in the rotated domain and un-rotated once per output row
// (sum_j p_j v_j = R^T sum_j p_j (R v_j)). The result equals attention over the dequantized, un-rotated K/V
// up to fp32 rounding.
#pragma once

#include <cmath>
#include <cstdint>

#include "exl2/tensor.h"

#ifdef __CUDACC__
#define EXL2_HD __host__ __device__ __forceinline__
#else
#define EXL2_HD inline
#endif

namespace exl2 {

constexpr int kKvQuantBlock = 32;  // values per fp16 scale

// +1 or -1 for row index i: the low bit of murmur3's fmix32(i + 0x9E3779B9) (1 -> -1).
EXL2_HD float kv_rot_sign(uint32_t i) {
  uint32_t h = i + 0x9E3779B9u;
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  return (h & 1u) ? -1.0f : 1.0f;
}

// Hadamard block size for a row of head_dim values (head_dim % 32 == 0): its largest power-of-two divisor.
EXL2_HD int64_t kv_rot_block(int64_t head_dim) {
  return head_dim & -head_dim;
}

EXL2_HD int64_t kv_row_bytes(int64_t head_dim, int bits) {
  return head_dim * bits / 8;
}
// f16 values per row: one scale per block (Q8/Q6) or a scale and an offset per block (Q4).
EXL2_HD int64_t kv_n_scales(int64_t head_dim, int bits) {
  return head_dim / kKvQuantBlock * (bits == 4 ? 2 : 1);
}

constexpr int kKvQ4Refits = 2;  // Q4 least-squares refits of (d, z) after the clip search

// Q4's clip candidates (fractions of the block's min/max), tried in this order.
constexpr int kKvQ4Clips = 7;
EXL2_HD float kv_q4_clip(int j) {
  switch (j) {
    case 0: return 1.0f;
    case 1: return 0.95f;
    case 2: return 0.9f;
    case 3: return 0.85f;
    case 4: return 0.8f;
    case 5: return 0.75f;
    default: return 0.7f;
  }
}

// The RoPE-aware K centre of one pair (i, d/2 + i) (K centring above): m1, m2 = mu[i], mu[d/2 + i]; co, si = the
// rope table's cos and sin of the pair at the row's position. The same ops on the CPU and the GPU.
EXL2_HD void kv_rope_centre(float m1, float m2, float co, float si, float* c1, float* c2) {
  *c1 = fmaf(m1, co, -(m2 * si));
  *c2 = fmaf(m2, co, m1 * si);
}

// Host helpers (CPU reference; also bound to Python for the tests).
// x[0..head_dim) <- R x (kv_rotate) or R^-1 x (kv_unrotate), in place.
void kv_rotate(float* x, int64_t head_dim);
void kv_unrotate(float* x, int64_t head_dim);
// One rotated row y[head_dim] -> codes (bytes[kv_row_bytes]) and f16 scales[kv_n_scales]; and back.
void kv_quantize_row(const float* y, int64_t head_dim, int bits, uint8_t* bytes, uint16_t* scales);
void kv_dequantize_row(const uint8_t* bytes, const uint16_t* scales, int64_t head_dim, int bits, float* y);

namespace ops {

// Quantized-cache counterparts of ops::kv_write / ops::attention_paged (ops.h), same index arguments and rules.
//   k, v: act [n, n_heads_kv, head_dim], head_dim % 32 == 0; bits in {8, 6, 4};
//   k_q, v_q: u8 [n_pages, page_size, n_heads_kv, head_dim * bits / 8]; k_s, v_s: f16 [.., kv_n_scales(d, bits)].
// kv_write_q rotates and quantizes each (token, head) row into its page/slot (see the format above).
//   k_mean: f32 [n_heads_kv, head_dim] on k's device, the K centring vectors (above), or undefined (no centring).
//   rope: undefined (fixed centre k_mean), or f32 [max_pos, head_dim] on k's device (RoPE-aware centre
//   RoPE(k_mean, positions[t]); needs k_mean; positions must be < max_pos: checked when positions are on the CPU).
//   k_sink, v_sink: both undefined (no sink rows), or both f16 [n_pages, n_heads_kv, head_dim] on k's device (sink
//   rows above; n_pages as k_q's).
void kv_write_q(const Tensor& k, const Tensor& v, Tensor& k_q, Tensor& k_s, Tensor& v_q, Tensor& v_s, int bits,
                const Tensor& positions, const Tensor& seq_of_token, const Tensor& page_table,
                const Tensor& k_mean = Tensor(), const Tensor& rope = Tensor(), Tensor k_sink = Tensor(),
                Tensor v_sink = Tensor());
// Causal GQA attention over the quantized pages: q, out act [n, n_heads, head_dim] (out must not alias q).
//   k_mean, rope: both undefined (keys stored uncentred or with a fixed centre: nothing to add back), or both
//   defined as for kv_write_q (keys written with the RoPE-aware centre: each score gains q . RoPE(k_mean, j)).
//   k_sink, v_sink: as for kv_write_q; defined: key and value 0 of each sequence come from them.
//   window, softcap: as ops::attention_paged (sliding window; capped scores).
void attention_paged_q(const Tensor& q, const Tensor& k_q, const Tensor& k_s, const Tensor& v_q, const Tensor& v_s,
                       int bits, const Tensor& positions, const Tensor& seq_of_token, const Tensor& page_table,
                       float scale, Tensor& out, const Tensor& k_mean = Tensor(), const Tensor& rope = Tensor(),
                       const Tensor& k_sink = Tensor(), const Tensor& v_sink = Tensor(), int64_t window = 0,
                       float softcap = 0.f);

}  // namespace ops
}  // namespace exl2

// Backend kernels (raw pointers, no validation; same conventions as backend/kernels.h). Scales are f16 bits.
// k_mean: null (no centring) or [n_heads_kv, head_dim]; rope: null (fixed centre) or the [max_pos, head_dim] table
// (RoPE-aware centre; attention adds it back only when both are non-null); k_sink, v_sink: null (no sink rows) or
// [pages, n_heads_kv, head_dim] f16 bits, indexed by page id like k_q.
#define EXL2_BACKEND_KV_QUANT_KERNELS                                                                                \
  void kv_write_q(const void* k, const void* v, uint8_t* k_q, uint16_t* k_s, uint8_t* v_q, uint16_t* v_s,            \
                  const float* k_mean, const float* rope, int bits, const int32_t* positions,                        \
                  const int32_t* seq_of_token, const int32_t* page_table, int64_t pages_per_seq, int64_t n,          \
                  int64_t page_size, int64_t n_heads_kv, int64_t head_dim, DType act, uint16_t* k_sink,              \
                  uint16_t* v_sink);                                                                                 \
  void attention_paged_q(const void* q, const uint8_t* k_q, const uint16_t* k_s, const uint8_t* v_q,                 \
                         const uint16_t* v_s, int bits, const int32_t* positions, const int32_t* seq_of_token,       \
                         const int32_t* page_table, int64_t pages_per_seq, int64_t n, int64_t n_heads,               \
                         int64_t n_heads_kv, int64_t head_dim, int64_t page_size, float scale, void* out, DType act, \
                         const float* k_mean, const float* rope, const uint16_t* k_sink, const uint16_t* v_sink,     \
                         int64_t window, float softcap);

namespace exl2::cpu {
EXL2_BACKEND_KV_QUANT_KERNELS
}  // namespace exl2::cpu

#ifdef EXL2_WITH_CUDA
namespace exl2::cuda {
EXL2_BACKEND_KV_QUANT_KERNELS
}  // namespace exl2::cuda
#endif
