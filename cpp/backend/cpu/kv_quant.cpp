// CPU kv_write_q / attention_paged_q: centre K (fixed or RoPE-aware), rotate + block-quantize K/V rows into the
// paged cache, and causal GQA attention that dequantizes each cached row into fp32 in the rotated domain (q rotated
// once, the V sum un-rotated once per output row; the RoPE-aware centre added back per key; see cache/kv_quant.h).
#include "cache/kv_quant.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "backend/cpu/cpu_common.h"
#include "backend/cpu/isa.h"
#include "backend/cpu/thread_pool.h"

namespace exl2::cpu {
EXL2_CPU_ISA_BEGIN

namespace {

// Dequantize one row (same values as kv_dequantize_row; unpacking specialized per width; Q4 is asymmetric).
template <int BITS>
void dequant_row(const uint8_t* p, const uint16_t* s, int64_t head_dim, float* y) {
  constexpr int qn = 1 << (BITS - 1);
  for (int64_t b = 0; b < head_dim / kKvQuantBlock; ++b) {
    float* o = y + b * kKvQuantBlock;
    if constexpr (BITS == 4) {  // asymmetric: fma(code, d, z)
      const float d = f16_to_f32(s[2 * b]), z = f16_to_f32(s[2 * b + 1]);
      const uint8_t* q = p + b * 16;
      for (int i = 0; i < 16; ++i) {
        o[2 * i] = std::fma(static_cast<float>(q[i] & 15), d, z);
        o[2 * i + 1] = std::fma(static_cast<float>(q[i] >> 4), d, z);
      }
    } else if constexpr (BITS == 8) {
      const float d = f16_to_f32(s[b]);
      const uint8_t* q = p + b * 32;
      for (int i = 0; i < 32; ++i) o[i] = static_cast<float>(static_cast<int>(q[i]) - qn) * d;
    } else {
      static_assert(BITS == 6, "bits must be 8, 6 or 4");
      const float d = f16_to_f32(s[b]);
      const uint8_t* q = p + b * 24;
      for (int g = 0; g < 8; ++g) {
        const uint32_t w =
            q[3 * g] | (static_cast<uint32_t>(q[3 * g + 1]) << 8) | (static_cast<uint32_t>(q[3 * g + 2]) << 16);
        for (int i = 0; i < 4; ++i) o[4 * g + i] = static_cast<float>(static_cast<int>((w >> (6 * i)) & 63) - qn) * d;
      }
    }
  }
}

using DequantFn = void (*)(const uint8_t*, const uint16_t*, int64_t, float*);

DequantFn dequant_fn(int bits) {
  return bits == 8 ? &dequant_row<8> : bits == 6 ? &dequant_row<6> : &dequant_row<4>;
}

}  // namespace

void kv_write_q(const void* k, const void* v, uint8_t* k_q, uint16_t* k_s, uint8_t* v_q, uint16_t* v_s,
                const float* k_mean, const float* rope, int bits, const int32_t* positions, const int32_t* seq_of_token,
                const int32_t* page_table, int64_t pages_per_seq, int64_t n, int64_t page_size, int64_t n_heads_kv,
                int64_t head_dim, DType act, uint16_t* k_sink, uint16_t* v_sink) {
  const int64_t half = head_dim / 2;
  const int64_t rb = kv_row_bytes(head_dim, bits), ns = kv_n_scales(head_dim, bits);
  parallel_for(n * n_heads_kv, 8, [&](int64_t b, int64_t e) {
    std::vector<float> buf(static_cast<size_t>(head_dim));
    for (int64_t task = b; task < e; ++task) {
      const int64_t t = task / n_heads_kv, h = task % n_heads_kv;
      const int64_t pos = positions[t];
      const int64_t page = page_table[static_cast<int64_t>(seq_of_token[t]) * pages_per_seq + pos / page_size];
      const int64_t slot = (page * page_size + pos % page_size) * n_heads_kv + h;  // (page, slot, head) row
      const int64_t src = (t * n_heads_kv + h) * head_dim;
      detail::row_to_f32(detail::at(k, act, src), act, head_dim, buf.data());
      if (k_mean && rope) {  // RoPE-aware K centre (kv_quant.h): RoPE(mu, pos), fp32 subtract before the rotation
        const float* mu = k_mean + h * head_dim;
        const float* cs = rope + pos * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          float c1, c2;
          kv_rope_centre(mu[i], mu[half + i], cs[i], cs[half + i], &c1, &c2);
          buf[i] -= c1;
          buf[half + i] -= c2;
        }
      } else if (k_mean) {  // fixed K centre: fp32 subtract before the rotation, as the CUDA kernel does
        const float* mu = k_mean + h * head_dim;
        for (int64_t i = 0; i < head_dim; ++i) buf[i] -= mu[i];
      }
      const bool sink = k_sink && pos == 0;  // sink rows (kv_quant.h): the rotated row of position 0, f16
      const int64_t sink_row = (page * n_heads_kv + h) * head_dim;
      kv_rotate(buf.data(), head_dim);
      if (sink)
        for (int64_t i = 0; i < head_dim; ++i) k_sink[sink_row + i] = f32_to_f16(buf[i]);
      kv_quantize_row(buf.data(), head_dim, bits, k_q + slot * rb, k_s + slot * ns);
      detail::row_to_f32(detail::at(v, act, src), act, head_dim, buf.data());
      kv_rotate(buf.data(), head_dim);
      if (sink)
        for (int64_t i = 0; i < head_dim; ++i) v_sink[sink_row + i] = f32_to_f16(buf[i]);
      kv_quantize_row(buf.data(), head_dim, bits, v_q + slot * rb, v_s + slot * ns);
    }
  });
}

void attention_paged_q(const void* q, const uint8_t* k_q, const uint16_t* k_s, const uint8_t* v_q, const uint16_t* v_s,
                       int bits, const int32_t* positions, const int32_t* seq_of_token, const int32_t* page_table,
                       int64_t pages_per_seq, int64_t n, int64_t n_heads, int64_t n_heads_kv, int64_t head_dim,
                       int64_t page_size, float scale, void* out, DType act, const float* k_mean, const float* rope,
                       const uint16_t* k_sink, const uint16_t* v_sink, int64_t window, float softcap) {
  const int64_t group = n_heads / n_heads_kv;  // query heads per KV head
  const int64_t half = head_dim / 2;
  const bool centre = k_mean && rope;  // keys hold K - RoPE(mu, j): add q . RoPE(mu, j) back to each score
  const int64_t rb = kv_row_bytes(head_dim, bits), ns = kv_n_scales(head_dim, bits);
  const DequantFn dequant = dequant_fn(bits);
  parallel_for(n * n_heads_kv, 1, [&](int64_t b, int64_t e) {
    std::vector<float> qf(static_cast<size_t>(group * head_dim)), acc(static_cast<size_t>(group * head_dim));
    std::vector<float> row(static_cast<size_t>(head_dim)), scores;
    std::vector<float> ab(centre ? static_cast<size_t>(group * head_dim) : 0);
    for (int64_t task = b; task < e; ++task) {
      const int64_t t = task / n_heads_kv, g = task % n_heads_kv;
      const int64_t len = static_cast<int64_t>(positions[t]) + 1;  // keys first..positions[t]
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int32_t* pages = page_table + static_cast<int64_t>(seq_of_token[t]) * pages_per_seq;
      detail::row_to_f32(detail::at(q, act, (t * n_heads + g * group) * head_dim), act, group * head_dim, qf.data());
      if (centre) {  // q . RoPE(mu, j) = sum_i a_i cos_j[i] + b_i sin_j[i] (kv_quant.h), from the unrotated q
        const float* mu = k_mean + g * head_dim;
        for (int64_t h = 0; h < group; ++h) {
          const float* qh = qf.data() + h * head_dim;
          float* o = ab.data() + h * head_dim;
          for (int64_t i = 0; i < half; ++i) {
            const float q1 = qh[i], q2 = qh[half + i], m1 = mu[i], m2 = mu[half + i];
            o[i] = q1 * m1 + q2 * m2;
            o[half + i] = q2 * m1 - q1 * m2;
          }
        }
      }
      for (int64_t h = 0; h < group; ++h) kv_rotate(qf.data() + h * head_dim, head_dim);
      auto slot = [&](int64_t j) {
        return (static_cast<int64_t>(pages[j / page_size]) * page_size + j % page_size) * n_heads_kv + g;
      };
      // Key / value j as fp32 rows in the rotated domain: the sink row for j == 0 when the cache keeps them.
      auto read_row = [&](int64_t j, const uint8_t* codes, const uint16_t* scales, const uint16_t* sink) {
        if (sink && j == 0) {
          const uint16_t* r = sink + (static_cast<int64_t>(pages[0]) * n_heads_kv + g) * head_dim;
          for (int64_t i = 0; i < head_dim; ++i) row[i] = f16_to_f32(r[i]);
        } else {
          dequant(codes + slot(j) * rb, scales + slot(j) * ns, head_dim, row.data());
        }
        return row.data();
      };
      auto key_row = [&](int64_t j) { return read_row(j, k_q, k_s, k_sink); };
      auto value_row = [&](int64_t j) { return read_row(j, v_q, v_s, v_sink); };
      if (centre)
        detail::attend_group(qf.data(), group, head_dim, first, len, scale, softcap, key_row, value_row, scores,
                             acc.data(), [&](int64_t j, int64_t h) {  // key j sits at position j
                               return detail::dot_f32(ab.data() + h * head_dim, rope + j * head_dim, head_dim);
                             });
      else
        detail::attend_group(qf.data(), group, head_dim, first, len, scale, softcap, key_row, value_row, scores,
                             acc.data());
      for (int64_t h = 0; h < group; ++h) kv_unrotate(acc.data() + h * head_dim, head_dim);
      detail::row_from_f32(acc.data(), group * head_dim, detail::at(out, act, (t * n_heads + g * group) * head_dim),
                           act);
    }
  });
}

EXL2_CPU_ISA_END

#ifdef EXL2_CPU_ISA_DISPATCHER
EXL2_CPU_ISA_DECLARE(EXL2_BACKEND_KV_QUANT_KERNELS)

void kv_write_q(const void* k, const void* v, uint8_t* k_q, uint16_t* k_s, uint8_t* v_q, uint16_t* v_s,
                const float* k_mean, const float* rope, int bits, const int32_t* positions, const int32_t* seq_of_token,
                const int32_t* page_table, int64_t pages_per_seq, int64_t n, int64_t page_size, int64_t n_heads_kv,
                int64_t head_dim, DType act, uint16_t* k_sink, uint16_t* v_sink) {
  EXL2_CPU_DISPATCH(kv_write_q, k, v, k_q, k_s, v_q, v_s, k_mean, rope, bits, positions, seq_of_token, page_table,
                    pages_per_seq, n, page_size, n_heads_kv, head_dim, act, k_sink, v_sink);
}

void attention_paged_q(const void* q, const uint8_t* k_q, const uint16_t* k_s, const uint8_t* v_q, const uint16_t* v_s,
                       int bits, const int32_t* positions, const int32_t* seq_of_token, const int32_t* page_table,
                       int64_t pages_per_seq, int64_t n, int64_t n_heads, int64_t n_heads_kv, int64_t head_dim,
                       int64_t page_size, float scale, void* out, DType act, const float* k_mean, const float* rope,
                       const uint16_t* k_sink, const uint16_t* v_sink, int64_t window, float softcap) {
  EXL2_CPU_DISPATCH(attention_paged_q, q, k_q, k_s, v_q, v_s, bits, positions, seq_of_token, page_table, pages_per_seq,
                    n, n_heads, n_heads_kv, head_dim, page_size, scale, out, act, k_mean, rope, k_sink, v_sink, window,
                    softcap);
}
#endif

}  // namespace exl2::cpu
