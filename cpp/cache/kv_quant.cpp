// Host side of the quantized KV cache: the rotation and row (de)quantization helpers of kv_quant.h, and the
// checked ops kv_write_q / attention_paged_q that dispatch to cpu:: or cuda::.
#include "cache/kv_quant.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "exl2/kv_cache.h"

#include "backend/kernels.h"
#include "ops/check.h"

namespace exl2 {

namespace {

void fwht(float* x, int64_t n) {  // unnormalized, Sylvester order
  for (int64_t h = 1; h < n; h <<= 1)
    for (int64_t i = 0; i < n; i += 2 * h)
      for (int64_t j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
}

void hadamard_blocks(float* x, int64_t head_dim) {
  const int64_t blk = kv_rot_block(head_dim);
  const float norm = static_cast<float>(1.0 / std::sqrt(static_cast<double>(blk)));
  for (int64_t b = 0; b < head_dim; b += blk) fwht(x + b, blk);
  for (int64_t i = 0; i < head_dim; ++i) x[i] *= norm;
}

}  // namespace

void kv_rotate(float* x, int64_t head_dim) {
  for (int64_t i = 0; i < head_dim; ++i) x[i] *= kv_rot_sign(static_cast<uint32_t>(i));
  hadamard_blocks(x, head_dim);
}

void kv_unrotate(float* x, int64_t head_dim) {
  hadamard_blocks(x, head_dim);
  for (int64_t i = 0; i < head_dim; ++i) x[i] *= kv_rot_sign(static_cast<uint32_t>(i));
}

namespace {

void put_code(uint8_t* bytes, int64_t i, int bits, uint32_t code) {
  const int64_t bit = i * bits;
  bytes[bit >> 3] |= static_cast<uint8_t>(code << (bit & 7));
  if ((bit & 7) + bits > 8) bytes[(bit >> 3) + 1] |= static_cast<uint8_t>(code >> (8 - (bit & 7)));
}

uint32_t get_code(const uint8_t* bytes, int64_t i, int bits) {
  const int64_t bit = i * bits;
  uint32_t w = bytes[bit >> 3];
  if ((bit & 7) + bits > 8) w |= static_cast<uint32_t>(bytes[(bit >> 3) + 1]) << 8;
  return (w >> (bit & 7)) & ((1u << bits) - 1);
}

// Q4 codes of one block x[32] for scale d and offset z (d == 0 -> all 0); returns the tree-summed squared error.
float q4_block(const float* x, float d, float z, uint8_t* codes) {
  float sq[kKvQuantBlock];
  for (int i = 0; i < kKvQuantBlock; ++i) {
    int q = 0;
    if (d != 0.0f) {
      const float r = std::nearbyint((x[i] - z) / d);
      q = r < 0.0f ? 0 : (r > 15.0f ? 15 : static_cast<int>(r));
    }
    codes[i] = static_cast<uint8_t>(q);
    const float e = std::fma(static_cast<float>(q), d, z) - x[i];
    sq[i] = std::fma(e, e, 0.0f);  // a plain product that the compiler cannot fuse into the sum below
  }
  for (int h = kKvQuantBlock / 2; h > 0; h >>= 1)
    for (int i = 0; i < h; ++i) sq[i] = sq[i] + sq[i + h];
  return sq[0];
}

// Tree sums (as q4_block) over a block of: code, code^2, x, code * x (products rounded once, never fused).
void q4_fit_sums(const float* x, const uint8_t* codes, float* sums) {
  float a[4][kKvQuantBlock];
  for (int i = 0; i < kKvQuantBlock; ++i) {
    const float q = static_cast<float>(codes[i]);
    a[0][i] = q;
    a[1][i] = q * q;  // exact
    a[2][i] = x[i];
    a[3][i] = std::fma(q, x[i], 0.0f);
  }
  for (int h = kKvQuantBlock / 2; h > 0; h >>= 1)
    for (int i = 0; i < h; ++i)
      for (int r = 0; r < 4; ++r) a[r][i] = a[r][i] + a[r][i + h];
  for (int r = 0; r < 4; ++r) sums[r] = a[r][0];
}

}  // namespace

void kv_quantize_row(const float* y, int64_t head_dim, int bits, uint8_t* bytes, uint16_t* scales) {
  const int qn = 1 << (bits - 1);
  const int64_t nbytes = kv_row_bytes(head_dim, bits);
  for (int64_t i = 0; i < nbytes; ++i) bytes[i] = 0;
  for (int64_t b = 0; b < head_dim / kKvQuantBlock; ++b) {
    const float* x = y + b * kKvQuantBlock;
    if (bits == 4) {
      float mn = x[0], mx = x[0];
      for (int i = 1; i < kKvQuantBlock; ++i) {
        mn = std::min(mn, x[i]);
        mx = std::max(mx, x[i]);
      }
      uint8_t codes[kKvQuantBlock], best[kKvQuantBlock];
      float best_err = std::numeric_limits<float>::infinity();
      uint16_t best_d = 0, best_z = 0;
      for (int j = 0; j < kKvQ4Clips; ++j) {
        const float c = kv_q4_clip(j), lo = mn * c, hi = mx * c;
        const uint16_t d16 = f32_to_f16((hi - lo) / 15.0f), z16 = f32_to_f16(lo);
        const float err = q4_block(x, f16_to_f32(d16), f16_to_f32(z16), codes);
        if (err < best_err || j == 0) {
          best_err = err;
          best_d = d16;
          best_z = z16;
          std::copy(codes, codes + kKvQuantBlock, best);
        }
      }
      for (int it = 0; it < kKvQ4Refits; ++it) {  // least-squares refit of (d, z) to the chosen codes
        float sums[4];
        q4_fit_sums(x, best, sums);
        const float n = static_cast<float>(kKvQuantBlock), sq = sums[0], sqq = sums[1], sy = sums[2], sqy = sums[3];
        const float det = n * sqq - sq * sq;  // exact: integers < 2^24
        if (!(det > 0.0f)) break;
        const float d = (n * sqy - std::fma(sq, sy, 0.0f)) / det;  // n * sqy is exact, so a fused form agrees
        const float z = (sy - std::fma(d, sq, 0.0f)) / n;
        const uint16_t d16 = f32_to_f16(d), z16 = f32_to_f16(z);
        const float err = q4_block(x, f16_to_f32(d16), f16_to_f32(z16), codes);
        if (!(err < best_err)) break;
        best_err = err;
        best_d = d16;
        best_z = z16;
        std::copy(codes, codes + kKvQuantBlock, best);
      }
      scales[2 * b] = best_d;
      scales[2 * b + 1] = best_z;
      for (int i = 0; i < kKvQuantBlock; ++i) put_code(bytes, b * kKvQuantBlock + i, 4, best[i]);
      continue;
    }
    float m = 0.0f;
    for (int i = 0; i < kKvQuantBlock; ++i)
      if (std::fabs(x[i]) > std::fabs(m)) m = x[i];
    const uint16_t d16 = f32_to_f16(m / static_cast<float>(-qn));
    scales[b] = d16;
    const float d = f16_to_f32(d16);
    for (int i = 0; i < kKvQuantBlock; ++i) {
      int q = 0;
      if (d != 0.0f) {
        const float r = std::nearbyint(x[i] / d);
        q = r < static_cast<float>(-qn) ? -qn : (r > static_cast<float>(qn - 1) ? qn - 1 : static_cast<int>(r));
      }
      put_code(bytes, b * kKvQuantBlock + i, bits, static_cast<uint32_t>(q + qn));
    }
  }
}

void kv_dequantize_row(const uint8_t* bytes, const uint16_t* scales, int64_t head_dim, int bits, float* y) {
  const int qn = 1 << (bits - 1);
  for (int64_t b = 0; b < head_dim / kKvQuantBlock; ++b) {
    for (int i = 0; i < kKvQuantBlock; ++i) {
      const int64_t k = b * kKvQuantBlock + i;
      const float code = static_cast<float>(get_code(bytes, k, bits));
      y[k] = bits == 4 ? std::fma(code, f16_to_f32(scales[2 * b]), f16_to_f32(scales[2 * b + 1]))
                       : (code - static_cast<float>(qn)) * f16_to_f32(scales[b]);
    }
  }
}

namespace ops {

namespace {

// The quantized-cache arguments shared by both ops (see kv_quant.h); returns page_size.
void check_q_cache(const char* op, const Tensor& k_q, const Tensor& k_s, const Tensor& v_q, const Tensor& v_s, int bits,
                   const Tensor& positions, const Tensor& seq_of_token, const Tensor& page_table, int64_t n,
                   int64_t n_heads_kv, int64_t head_dim, bool whole_prefix, int64_t window = 0) {
  EXL2_CHECK(bits == 8 || bits == 6 || bits == 4, op, ": bits must be 8, 6 or 4, got ", bits);
  EXL2_CHECK(head_dim % kKvQuantBlock == 0, op, ": head_dim must be a multiple of ", kKvQuantBlock,
             " for a quantized cache, got ", head_dim, "; use cache_type fp16");
  detail::check_dtype(op, "k_q", k_q, DType::U8);
  detail::check_rank(op, "k_q", k_q, 4);
  const int64_t n_pages = k_q.size(0), page_size = k_q.size(1);
  EXL2_CHECK(page_size >= 1, op, ": k_q's page_size (dim 1) must be >= 1, got ", k_q.describe());
  detail::check_shape(op, "k_q", k_q, {n_pages, page_size, n_heads_kv, kv_row_bytes(head_dim, bits)});
  detail::check_dtype(op, "v_q", v_q, DType::U8);
  detail::check_shape(op, "v_q", v_q, k_q.shape());
  detail::check_dtype(op, "k_s", k_s, DType::F16);
  detail::check_shape(op, "k_s", k_s, {n_pages, page_size, n_heads_kv, kv_n_scales(head_dim, bits)});
  detail::check_dtype(op, "v_s", v_s, DType::F16);
  detail::check_shape(op, "v_s", v_s, k_s.shape());
  detail::check_dtype(op, "positions", positions, DType::I32);
  detail::check_shape(op, "positions", positions, {n});
  detail::check_dtype(op, "seq_of_token", seq_of_token, DType::I32);
  detail::check_shape(op, "seq_of_token", seq_of_token, {n});
  detail::check_dtype(op, "page_table", page_table, DType::I32);
  detail::check_rank(op, "page_table", page_table, 2);
  if (positions.device().is_cpu())
    detail::check_paged_indices_host(op, positions, seq_of_token, page_table, n_pages, page_size, whole_prefix,
                                     window);
}

// The K centring arguments (kv_quant.h): k_mean f32 [n_heads_kv, head_dim] and the rope table f32
// [max_pos, head_dim] on `dev`; positions (host ones) below max_pos.
void check_centre(const char* op, const Tensor& k_mean, const Tensor& rope, const Tensor& positions, Device dev,
                  int64_t n_heads_kv, int64_t head_dim) {
  if (k_mean.defined()) {
    EXL2_CHECK(k_mean.device() == dev, op, ": k_mean must be on ", dev.str(), ", got ", k_mean.device().str());
    detail::check_dtype(op, "k_mean", k_mean, DType::F32);
    detail::check_shape(op, "k_mean", k_mean, {n_heads_kv, head_dim});
  }
  if (!rope.defined()) return;
  EXL2_CHECK(k_mean.defined(), op, ": a rope table (RoPE-aware K centring) needs k_mean; pass both or neither");
  EXL2_CHECK(rope.device() == dev, op, ": rope must be on ", dev.str(), ", got ", rope.device().str());
  detail::check_dtype(op, "rope", rope, DType::F32);
  detail::check_rank(op, "rope", rope, 2);
  EXL2_CHECK(rope.size(1) == head_dim && rope.size(0) >= 1, op, ": rope must be [max_pos, ", head_dim, "], got ",
             rope.describe());
  if (positions.device().is_cpu()) {
    const int32_t* p = positions.data_as<int32_t>();
    for (int64_t t = 0; t < positions.numel(); ++t)
      EXL2_CHECK(p[t] < rope.size(0), op, ": position ", p[t], " (row ", t, ") is past the rope table's ", rope.size(0),
                 " rows; build the table for a longer max_seq_len");
  }
}

// The sink stores (kv_quant.h): both undefined, or both f16 [k_q's n_pages, n_heads_kv, head_dim] on `dev`.
void check_sink(const char* op, const Tensor& k_sink, const Tensor& v_sink, const Tensor& k_q, Device dev,
                int64_t n_heads_kv, int64_t head_dim) {
  EXL2_CHECK(k_sink.defined() == v_sink.defined(), op, ": k_sink and v_sink go together; got only ",
             k_sink.defined() ? "k_sink" : "v_sink");
  if (!k_sink.defined()) return;
  for (const auto& [name, t] : {std::pair<const char*, const Tensor*>{"k_sink", &k_sink}, {"v_sink", &v_sink}}) {
    EXL2_CHECK(t->device() == dev, op, ": ", name, " must be on ", dev.str(), ", got ", t->device().str());
    detail::check_dtype(op, name, *t, DType::F16);
    detail::check_shape(op, name, *t, {k_q.size(0), n_heads_kv, head_dim});
  }
}

}  // namespace

void kv_write_q(const Tensor& k, const Tensor& v, Tensor& k_q, Tensor& k_s, Tensor& v_q, Tensor& v_s, int bits,
                const Tensor& positions, const Tensor& seq_of_token, const Tensor& page_table, const Tensor& k_mean,
                const Tensor& rope, Tensor k_sink, Tensor v_sink) {
  const char* op = "kv_write_q";
  detail::check_defined_same_device(op, {{"k", &k},
                                         {"v", &v},
                                         {"k_q", &k_q},
                                         {"k_s", &k_s},
                                         {"v_q", &v_q},
                                         {"v_s", &v_s},
                                         {"positions", &positions},
                                         {"seq_of_token", &seq_of_token},
                                         {"page_table", &page_table}});
  detail::check_act(op, "k", k);
  detail::check_rank(op, "k", k, 3);
  detail::check_same_dtype(op, "v", v, "k", k);
  detail::check_shape(op, "v", v, k.shape());
  const int64_t n = k.size(0), n_heads_kv = k.size(1), head_dim = k.size(2);
  check_q_cache(op, k_q, k_s, v_q, v_s, bits, positions, seq_of_token, page_table, n, n_heads_kv, head_dim, false);
  check_centre(op, k_mean, rope, positions, k.device(), n_heads_kv, head_dim);
  check_sink(op, k_sink, v_sink, k_q, k.device(), n_heads_kv, head_dim);
  if (k.numel() == 0) return;
  EXL2_OPS_DISPATCH(k.device(), kv_write_q, k.data(), v.data(), k_q.data_as<uint8_t>(), k_s.data_as<uint16_t>(),
                    v_q.data_as<uint8_t>(), v_s.data_as<uint16_t>(),
                    k_mean.defined() ? k_mean.data_as<float>() : nullptr,
                    rope.defined() ? rope.data_as<float>() : nullptr, bits, positions.data_as<int32_t>(),
                    seq_of_token.data_as<int32_t>(), page_table.data_as<int32_t>(), page_table.size(1), n, k_q.size(1),
                    n_heads_kv, head_dim, k.dtype(), k_sink.defined() ? k_sink.data_as<uint16_t>() : nullptr,
                    v_sink.defined() ? v_sink.data_as<uint16_t>() : nullptr);
}

void attention_paged_q(const Tensor& q, const Tensor& k_q, const Tensor& k_s, const Tensor& v_q, const Tensor& v_s,
                       int bits, const Tensor& positions, const Tensor& seq_of_token, const Tensor& page_table,
                       float scale, Tensor& out, const Tensor& k_mean, const Tensor& rope, const Tensor& k_sink,
                       const Tensor& v_sink, int64_t window, float softcap) {
  const char* op = "attention_paged_q";
  detail::check_window(op, window, softcap);
  detail::check_defined_same_device(op, {{"q", &q},
                                         {"k_q", &k_q},
                                         {"k_s", &k_s},
                                         {"v_q", &v_q},
                                         {"v_s", &v_s},
                                         {"positions", &positions},
                                         {"seq_of_token", &seq_of_token},
                                         {"page_table", &page_table},
                                         {"out", &out}});
  detail::check_act(op, "q", q);
  detail::check_rank(op, "q", q, 3);
  detail::check_rank(op, "k_q", k_q, 4);
  const int64_t n = q.size(0), n_heads = q.size(1), head_dim = q.size(2), n_heads_kv = k_q.size(2);
  EXL2_CHECK(n_heads_kv >= 1 && n_heads % n_heads_kv == 0, op, ": q's n_heads (", n_heads,
             ") must be a multiple of k_q's n_heads_kv (dim 2), got ", k_q.describe());
  check_q_cache(op, k_q, k_s, v_q, v_s, bits, positions, seq_of_token, page_table, n, n_heads_kv, head_dim, true,
                window);
  detail::check_same_dtype(op, "out", out, "q", q);
  detail::check_shape(op, "out", out, q.shape());
  detail::check_no_overlap(op, "out", out, "q", q);
  EXL2_CHECK(k_mean.defined() == rope.defined(), op,
             ": k_mean and rope go together (keys written with the RoPE-aware K centre) or are both omitted; got ",
             k_mean.defined() ? "k_mean without rope" : "rope without k_mean");
  check_centre(op, k_mean, rope, positions, q.device(), n_heads_kv, head_dim);
  check_sink(op, k_sink, v_sink, k_q, q.device(), n_heads_kv, head_dim);
  if (q.numel() == 0) return;
  EXL2_OPS_DISPATCH(
      q.device(), attention_paged_q, q.data(), k_q.data_as<uint8_t>(), k_s.data_as<uint16_t>(), v_q.data_as<uint8_t>(),
      v_s.data_as<uint16_t>(), bits, positions.data_as<int32_t>(), seq_of_token.data_as<int32_t>(),
      page_table.data_as<int32_t>(), page_table.size(1), n, n_heads, n_heads_kv, head_dim, k_q.size(1), scale,
      out.data(), q.dtype(), k_mean.defined() ? k_mean.data_as<float>() : nullptr,
      rope.defined() ? rope.data_as<float>() : nullptr, k_sink.defined() ? k_sink.data_as<uint16_t>() : nullptr,
      v_sink.defined() ? v_sink.data_as<uint16_t>() : nullptr, window, softcap);
}

}  // namespace ops

void KVCache::set_k_mean(int64_t layer, const Tensor& k, const Tensor& positions, const Tensor& rope) {
  EXL2_CHECK(quantized(), "KVCache::set_k_mean: only quantized caches centre K (this one is ", cache_type_name(type_),
             ")");
  const int64_t shards = static_cast<int64_t>(slot_.size());  // layers, or layers * tp() under tensor parallel
  EXL2_CHECK(layer >= 0 && layer < shards, "KVCache::set_k_mean: layer ", layer, " out of range [0, ", shards, ")");
  if (k_mean_ready_[layer]) return;
  Tensor& mu = k_mean_[layer];
  const int64_t nkv = mu.size(0), hd = mu.size(1), half = hd / 2;
  EXL2_CHECK(k.dim() == 3 && k.size(1) == nkv && k.size(2) == hd, "KVCache::set_k_mean: k must be [n, ", nkv, ", ",
             hd, "], got ", k.describe());
  const int64_t n = k.size(0);
  if (n == 0) return;
  // Host mean in double (a one-off per layer; the same on every backend for the same rows).
  const Tensor host = k.to(Device::cpu()).to_dtype(DType::F32);
  const float* x = host.data_as<float>();
  std::vector<double> acc(static_cast<size_t>(nkv * hd), 0.0);
  if (k_centre_rope_) {  // un-rotate each row by its position: the inverse of the table's map (any yarn factor)
    EXL2_CHECK(positions.defined() && rope.defined(),
               "KVCache::set_k_mean: this cache centres K RoPE-aware (option kv_k_centre rope), so the rows' "
               "positions and the model's rope table are needed");
    EXL2_CHECK(positions.dtype() == DType::I32 && positions.dim() == 1 && positions.size(0) == n,
               "KVCache::set_k_mean: positions must be i32 [", n, "], got ", positions.describe());
    EXL2_CHECK(rope.dtype() == DType::F32 && rope.dim() == 2 && rope.size(1) == hd,
               "KVCache::set_k_mean: rope must be f32 [max_pos, ", hd, "], got ", rope.describe());
    const Tensor pos_host = positions.to(Device::cpu());
    const int32_t* pos = pos_host.data_as<int32_t>();
    int32_t lo = pos[0], hi = pos[0];
    for (int64_t t = 0; t < n; ++t) {
      lo = std::min(lo, pos[t]);
      hi = std::max(hi, pos[t]);
    }
    EXL2_CHECK(lo >= 0 && hi < rope.size(0), "KVCache::set_k_mean: positions must be in [0, ", rope.size(0), "), got ",
               lo, "..", hi);
    const Tensor tab = rope.slice(lo, static_cast<int64_t>(hi) + 1).to(Device::cpu());  // the rows needed only
    const float* cs = tab.data_as<float>();
    for (int64_t t = 0; t < n; ++t) {
      const float* r = cs + static_cast<int64_t>(pos[t] - lo) * hd;
      for (int64_t h = 0; h < nkv; ++h) {
        const float* y = x + (t * nkv + h) * hd;
        double* a = acc.data() + h * hd;
        for (int64_t i = 0; i < half; ++i) {
          const double c = r[i], s = r[half + i], y1 = y[i], y2 = y[half + i];
          const double inv = 1.0 / (c * c + s * s);  // 1 / factor^2
          a[i] += (y1 * c + y2 * s) * inv;
          a[half + i] += (y2 * c - y1 * s) * inv;
        }
      }
    }
  } else {
    for (int64_t t = 0; t < n; ++t)
      for (int64_t i = 0; i < nkv * hd; ++i) acc[i] += x[t * nkv * hd + i];
  }
  std::vector<float> m(acc.size());
  for (size_t i = 0; i < acc.size(); ++i) m[i] = static_cast<float>(acc[i] / static_cast<double>(n));
  mu.copy_from(Tensor::from_host(m.data(), {nkv, hd}, DType::F32));
  k_mean_ready_[layer] = 1;
}

}  // namespace exl2
