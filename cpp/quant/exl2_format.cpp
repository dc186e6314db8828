// EXL2 format: validation, unpack, bit-exact dequantization, pack and bit accounting (contract in exl2_format.h).
#include "quant/exl2_format.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <mutex>
#include <set>
#include <thread>

#include "core/checked.h"

namespace exl2::quant {

namespace {

bool valid_bits(int b) { return b == 2 || b == 3 || b == 4 || b == 5 || b == 6 || b == 8; }

std::string tname(const std::string& name, const char* suffix) {
  return name.empty() ? std::string(suffix) : name + "." + suffix;
}

std::string shape_text(const Shape& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

// Dtype and rank check of one tensor; ModelFormatError naming it.
void check_array(const Exl2Array& a, const std::string& full, std::initializer_list<DType> dtypes, size_t rank,
                 const char* what) {
  EXL2_CHECK_KIND(ModelFormat, a.present, "EXL2 tensor '", full, "' is missing (expected ", what,
                  "); the file is not a complete EXL2 quant");
  bool ok = false;
  for (DType d : dtypes) ok = ok || d == a.dtype;
  EXL2_CHECK_KIND(ModelFormat, ok && a.shape.size() == rank, "EXL2 tensor '", full, "': expected ", what,
                  ", found ", dtype_name(a.dtype), shape_text(a.shape), "; re-convert the model");
}

int64_t round_up32(int64_t v) { return (v + 31) / 32 * 32; }

// Extract the b-bit value starting at bit `off` of the column stream whose word rows start at `col` (stride
// `stride` words).
inline uint32_t read_bits(const uint32_t* col, int64_t stride, int64_t off, int b) {
  const int64_t w = off >> 5;
  const int sh = static_cast<int>(off & 31);
  uint32_t v = col[w * stride] >> sh;
  if (sh + b > 32) v |= col[(w + 1) * stride] << (32 - sh);
  return v & ((1u << b) - 1u);
}

}  // namespace

Exl2Array Exl2Array::of(const Tensor& t) {
  Exl2Array a;
  if (!t.defined()) return a;
  EXL2_CHECK(t.device().is_cpu(), "EXL2 tensors must be on the CPU to unpack, got ", t.describe());
  a.data = t.data();
  a.dtype = t.dtype();
  a.shape = t.shape();
  a.present = true;
  return a;
}

Exl2Layout validate(const Exl2Tensors& t, const std::string& name, int64_t in_features, int64_t out_features) {
  const std::string n_qw = tname(name, "q_weight"), n_qs = tname(name, "q_scale"),
                    n_qsm = tname(name, "q_scale_max"), n_qg = tname(name, "q_groups"),
                    n_inv = tname(name, "q_invperm"), n_perm = tname(name, "q_perm"), n_bias = tname(name, "bias");
  check_array(t.q_weight, n_qw, {DType::I32}, 2, "int32 [packed rows, out_pad]");
  check_array(t.q_groups, n_qg, {DType::I16}, 1, "int16 [2*groups]");
  check_array(t.q_invperm, n_inv, {DType::I32}, 1, "int32 [in_features]");
  check_array(t.q_scale, n_qs, {DType::I32}, 2, "int32 [groups, out_pad/8]");
  check_array(t.q_scale_max, n_qsm, {DType::F16}, 1, "float16 [groups]");

  Exl2Layout L;
  const int64_t qrows = t.q_weight.shape[0];
  L.out_pad = t.q_weight.shape[1];
  L.out = out_features >= 0 ? out_features : L.out_pad;
  EXL2_CHECK_KIND(ModelFormat, L.out_pad > 0 && L.out_pad % 32 == 0, "EXL2 tensor '", n_qw,
                  "': output columns must be padded to a multiple of 32, found ", shape_text(t.q_weight.shape));
  EXL2_CHECK_KIND(ModelFormat, L.out > 0 && round_up32(L.out) == L.out_pad, "EXL2 tensor '", n_qw, "' has ",
                  L.out_pad, " columns but out_features = ", L.out, " needs ", round_up32(L.out),
                  " (out_features rounded up to 32); the tensor does not belong to this layer");

  // Groups.
  const int64_t g2 = t.q_groups.shape[0];
  EXL2_CHECK_KIND(ModelFormat, g2 >= 2 && g2 % 2 == 0, "EXL2 tensor '", n_qg,
                  "' must hold (bits, first q_weight row) pairs: expected an even length >= 2, found ", g2);
  const int64_t G = g2 / 2;
  const int16_t* qg = t.q_groups.as<int16_t>();
  int64_t row = 0;
  for (int64_t g = 0; g < G; ++g) {
    Exl2Group gr;
    gr.bits = qg[2 * g];
    gr.qrow_start = qg[2 * g + 1];
    EXL2_CHECK_KIND(ModelFormat, valid_bits(gr.bits), "EXL2 tensor '", n_qg, "': group ", g,
                    " has unsupported bit width ", gr.bits, " (EXL2 uses 2, 3, 4, 5, 6 or 8 bits)");
    if (g == 0) {
      EXL2_CHECK_KIND(ModelFormat, gr.qrow_start == 0, "EXL2 tensor '", n_qg,
                      "': the first group must start at q_weight row 0, found ", gr.qrow_start);
    } else {
      const Exl2Group& prev = L.groups.back();
      EXL2_CHECK_KIND(ModelFormat, gr.bits <= prev.bits, "EXL2 tensor '", n_qg, "': group ", g, " has ", gr.bits,
                      " bits after a group of ", prev.bits,
                      "; bit widths must never increase (8 -> 6 -> 5 -> 4 -> 3 -> 2)");
      EXL2_CHECK_KIND(ModelFormat, gr.qrow_start > prev.qrow_start, "EXL2 tensor '", n_qg,
                      "': q_weight row starts must increase, group ", g, " starts at ", gr.qrow_start,
                      " after ", prev.qrow_start);
    }
    EXL2_CHECK_KIND(ModelFormat, gr.qrow_start < qrows, "EXL2 tensor '", n_qg, "': group ", g,
                    " starts at q_weight row ", gr.qrow_start, " but '", n_qw, "' has only ", qrows, " rows");
    L.groups.push_back(gr);
  }
  for (int64_t g = 0; g < G; ++g) {
    Exl2Group& gr = L.groups[g];
    const int64_t next = g + 1 < G ? L.groups[g + 1].qrow_start : qrows;
    gr.qrows = next - gr.qrow_start;
    gr.row_start = row;
    if (g + 1 < G) {
      EXL2_CHECK_KIND(ModelFormat, gr.qrows * 32 % gr.bits == 0, "EXL2 tensor '", n_qw, "': group ", g, " spans ",
                      gr.qrows, " rows of ", gr.bits, "-bit values, not a whole number of input rows (",
                      gr.qrows, "*32 % ", gr.bits, " != 0); '", n_qg, "' does not match the packed weights");
      gr.rows = gr.qrows * 32 / gr.bits;
    } else {
      gr.rows = gr.qrows * 32 / gr.bits;  // upper bound; a ragged last group is fixed below
    }
    row += gr.rows;
  }
  // in: from q_invperm (the authoritative length); the last group may be ragged (ExLlamaV2 packs it with ceil).
  L.in = t.q_invperm.shape[0];
  Exl2Group& last = L.groups.back();
  const int64_t last_rows = L.in - last.row_start;
  EXL2_CHECK_KIND(ModelFormat,
                  last_rows > 0 && last_rows <= last.rows && (last_rows * last.bits + 31) / 32 == last.qrows,
                  "EXL2 tensor '", n_qw, "' has ", qrows, " packed rows, which with '", n_qg,
                  "' decode to ", row, " input rows, but '", n_inv, "' has ", L.in,
                  " entries; the groups do not match the weights");
  last.rows = last_rows;
  if (in_features >= 0) {
    EXL2_CHECK_KIND(ModelFormat, in_features == L.in, "EXL2 tensor '", n_inv, "' has ", L.in,
                    " entries, expected in_features = ", in_features);
  }
  // Unpacking and dequantizing index [in, out_pad] arrays of up to 4-byte values: the count must fit 64 bits.
  int64_t unpacked = 0;
  EXL2_CHECK_KIND(ModelFormat, mul_fits({L.in, L.out_pad, 4}, &unpacked), "EXL2 tensors '", n_inv, "' and '", n_qw,
                  "': ", L.in, " inputs x ", L.out_pad, " outputs is too large a layer to unpack");

  // Permutation.
  const int32_t* inv = t.q_invperm.as<int32_t>();
  L.perm.assign(L.in, -1);
  for (int64_t i = 0; i < L.in; ++i) {
    const int32_t v = inv[i];
    EXL2_CHECK_KIND(ModelFormat, v >= 0 && v < L.in && L.perm[v] < 0, "EXL2 tensor '", n_inv,
                    "' is not a permutation of 0..", L.in - 1, ": entry ", i, " = ", v,
                    (v >= 0 && v < L.in ? " repeats" : " is out of range"));
    L.perm[v] = static_cast<int32_t>(i);
  }
  if (t.q_perm.present) {
    check_array(t.q_perm, n_perm, {DType::I32, DType::I16}, 1, "int32 or int16 [in_features]");
    EXL2_CHECK_KIND(ModelFormat, t.q_perm.shape[0] == L.in, "EXL2 tensor '", n_perm, "' has ", t.q_perm.shape[0],
                    " entries, expected ", L.in, " (the length of '", n_inv, "')");
    for (int64_t k = 0; k < L.in; ++k) {
      const int64_t v = t.q_perm.dtype == DType::I32 ? t.q_perm.as<int32_t>()[k]
                                                     : static_cast<uint16_t>(t.q_perm.as<int16_t>()[k]);
      EXL2_CHECK_KIND(ModelFormat, v == L.perm[k], "EXL2 tensor '", n_perm, "' is not argsort('", n_inv,
                      "'): entry ", k, " = ", v, ", expected ", L.perm[k]);
    }
  }

  // Scales.
  EXL2_CHECK_KIND(ModelFormat, t.q_scale.shape[0] == G && t.q_scale.shape[1] == L.out_pad / 8, "EXL2 tensor '",
                  n_qs, "': expected shape [", G, ", ", L.out_pad / 8, "] (groups, out_pad/8), found ",
                  shape_text(t.q_scale.shape));
  EXL2_CHECK_KIND(ModelFormat, t.q_scale_max.shape[0] == G, "EXL2 tensor '", n_qsm, "': expected shape [", G,
                  "] (one per group in '", n_qg, "'), found ", shape_text(t.q_scale_max.shape));
  const uint16_t* qsm = t.q_scale_max.as<uint16_t>();
  for (int64_t g = 0; g < G; ++g) {
    if ((qsm[g] & 0x7c00u) == 0x7c00u) {
      char bits[8];
      std::snprintf(bits, sizeof bits, "%04x", static_cast<unsigned>(qsm[g]));
      EXL2_FAIL(ModelFormat, "EXL2 tensor '", n_qsm, "': group ", g, " holds a non-finite value (f16 bits 0x", bits,
                ")");
    }
  }
  if (t.bias.present) {
    check_array(t.bias, n_bias, {DType::F16, DType::F32, DType::BF16}, 1, "float16 [out_features]");
    EXL2_CHECK_KIND(ModelFormat, t.bias.shape[0] == L.out, "EXL2 tensor '", n_bias, "': expected shape [", L.out,
                    "], found ", shape_text(t.bias.shape));
    L.has_bias = true;
  }
  return L;
}

Exl2Codes unpack(const Exl2Tensors& t, const std::string& name, int64_t in_features, int64_t out_features) {
  Exl2Codes c;
  c.layout = validate(t, name, in_features, out_features);
  const Exl2Layout& L = c.layout;
  const int64_t G = static_cast<int64_t>(L.groups.size());
  c.codes.resize(static_cast<size_t>(L.in * L.out));
  const uint32_t* qw = t.q_weight.as<uint32_t>();
  for (const Exl2Group& g : L.groups) {
    const uint32_t* base = qw + g.qrow_start * L.out_pad;
    for (int64_t j = 0; j < g.rows; ++j) {
      uint8_t* dst = c.codes.data() + (g.row_start + j) * L.out;
      const int64_t off = j * g.bits;
      for (int64_t n = 0; n < L.out; ++n) dst[n] = static_cast<uint8_t>(read_bits(base + n, L.out_pad, off, g.bits));
    }
  }
  c.scale_nibbles.resize(static_cast<size_t>(G * L.out));
  const uint32_t* qs = t.q_scale.as<uint32_t>();
  for (int64_t g = 0; g < G; ++g)
    for (int64_t n = 0; n < L.out; ++n)
      c.scale_nibbles[g * L.out + n] = static_cast<uint8_t>((qs[g * (L.out_pad / 8) + n / 8] >> (4 * (n % 8))) & 15u);
  const uint16_t* qsm = t.q_scale_max.as<uint16_t>();
  c.q_scale_max.assign(qsm, qsm + G);
  return c;
}

namespace {

// Dequantize groups [g_begin, g_end) (see dequantize_into). Groups own disjoint packed rows, hence disjoint
// original rows of W, so ranges of groups may run concurrently.
void dequantize_groups(const Exl2Tensors& t, const Exl2Layout& L, float pre, uint16_t* dst, bool transpose,
                       size_t g_begin, size_t g_end) {
  const uint32_t* qw = t.q_weight.as<uint32_t>();
  const uint32_t* qs = t.q_scale.as<uint32_t>();
  const uint16_t* qsm = t.q_scale_max.as<uint16_t>();
  std::vector<float> scale(static_cast<size_t>(L.out));  // s[g, n] as exact f32 values of f16 numbers
  for (size_t gi = g_begin; gi < g_end; ++gi) {
    const Exl2Group& g = L.groups[gi];
    const float msc = f16_to_f32(f32_to_f16(f16_to_f32(qsm[gi]) * pre));
    for (int64_t n = 0; n < L.out; ++n) {
      const uint32_t nib = (qs[gi * (L.out_pad / 8) + n / 8] >> (4 * (n % 8))) & 15u;
      const float q2 = static_cast<float>((nib + 1) * (nib + 1));  // <= 256, exact
      scale[n] = f16_to_f32(f32_to_f16(q2 * msc));                 // exact product, one rounding
    }
    const int zero = 1 << (g.bits - 1);
    const uint32_t* base = qw + g.qrow_start * L.out_pad;
    for (int64_t j = 0; j < g.rows; ++j) {
      const int64_t orig = L.perm[g.row_start + j];
      const int64_t off = j * g.bits;
      for (int64_t n = 0; n < L.out; ++n) {
        const int q = static_cast<int>(read_bits(base + n, L.out_pad, off, g.bits)) - zero;
        const uint16_t w = f32_to_f16(static_cast<float>(q) * scale[n]);  // exact product, one rounding
        if (transpose)
          dst[n * L.in + orig] = w;
        else
          dst[orig * L.out + n] = w;
      }
    }
  }
}

}  // namespace

void dequantize_into(const Exl2Tensors& t, const Exl2Layout& L, double prescale, uint16_t* dst, bool transpose) {
  // ExLlamaV2 (ext.py make_q_matrix): q_scale_max *= prescale / 256 on an fp16 tensor; torch forms the product
  // in fp32 (the Python double scalar becomes an fp32 operand) and rounds once to fp16.
  const float pre = static_cast<float>(prescale / 256.0);
  const size_t G = L.groups.size();
  // Threads only pay off for big matrices (a 4096x4096 layer is ~0.1 s on one core).
  const int64_t work = L.in * L.out;
  size_t n_threads = std::min<size_t>(std::max(1u, std::thread::hardware_concurrency()), G);
  if (work < (int64_t(1) << 20)) n_threads = 1;
  if (n_threads <= 1) {
    dequantize_groups(t, L, pre, dst, transpose, 0, G);
    return;
  }
  std::vector<std::thread> threads;
  std::exception_ptr error;
  std::mutex error_mutex;
  for (size_t i = 0; i < n_threads; ++i) {
    const size_t b = G * i / n_threads, e = G * (i + 1) / n_threads;
    threads.emplace_back([&, b, e] {
      try {
        dequantize_groups(t, L, pre, dst, transpose, b, e);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex);
        error = std::current_exception();
      }
    });
  }
  for (auto& th : threads) th.join();
  if (error) std::rethrow_exception(error);
}

std::vector<uint16_t> dequantize(const Exl2Tensors& t, const std::string& name, double prescale,
                                 int64_t in_features, int64_t out_features) {
  const Exl2Layout L = validate(t, name, in_features, out_features);
  std::vector<uint16_t> w(static_cast<size_t>(L.in * L.out));
  dequantize_into(t, L, prescale, w.data(), false);
  return w;
}

Exl2Packed pack(const Exl2PackInput& p) {
  EXL2_CHECK(p.in > 0 && p.out > 0, "exl2 pack: in and out must be positive, got in=", p.in, " out=", p.out);
  EXL2_CHECK(p.codes && p.scale_nibbles && p.q_scale_max && p.perm, "exl2 pack: codes, scale_nibbles, ",
             "q_scale_max and perm are required");
  const int64_t G = static_cast<int64_t>(p.group_bits.size());
  EXL2_CHECK(G >= 1 && static_cast<int64_t>(p.group_rows.size()) == G, "exl2 pack: bits_per_group (", G,
             " entries) and group_rows (", p.group_rows.size(), " entries) must have the same length >= 1");
  Exl2Packed r;
  r.in = p.in;
  r.n_groups = G;
  r.out_pad = round_up32(p.out);
  int64_t rows = 0, qrows = 0;
  std::vector<int64_t> qstart(G), rstart(G);
  for (int64_t g = 0; g < G; ++g) {
    const int b = p.group_bits[g];
    const int64_t gr = p.group_rows[g];
    EXL2_CHECK(valid_bits(b), "exl2 pack: bits_per_group[", g, "] = ", b, " is not one of 2, 3, 4, 5, 6, 8");
    EXL2_CHECK(g == 0 || b <= p.group_bits[g - 1], "exl2 pack: bits_per_group must never increase (ExLlamaV2's ",
               "kernels decode 8 -> 6 -> 5 -> 4 -> 3 -> 2 in order), group ", g, " has ", b, " after ",
               p.group_bits[g - 1]);
    EXL2_CHECK(gr > 0, "exl2 pack: group_rows[", g, "] = ", gr, " must be positive");
    EXL2_CHECK(g + 1 == G || gr * b % 32 == 0, "exl2 pack: group ", g, " has ", gr, " rows of ", b,
               " bits, not a whole number of 32-bit words (only the last group may be ragged)");
    EXL2_CHECK(qrows <= 32767, "exl2 pack: group ", g, " would start at q_weight row ", qrows,
               ", which does not fit EXL2's int16 q_groups (in_features too large for one matrix)");
    qstart[g] = qrows;
    rstart[g] = rows;
    rows += gr;
    qrows += (gr * b + 31) / 32;
  }
  EXL2_CHECK(rows == p.in, "exl2 pack: group_rows sum to ", rows, " but in_features = ", p.in);
  r.qrows = qrows;

  // Permutation and its inverse.
  r.q_invperm.assign(static_cast<size_t>(p.in), -1);
  for (int64_t k = 0; k < p.in; ++k) {
    const int32_t v = p.perm[k];
    EXL2_CHECK(v >= 0 && v < p.in && r.q_invperm[v] < 0, "exl2 pack: perm is not a permutation of 0..", p.in - 1,
               ": entry ", k, " = ", v);
    r.q_invperm[v] = static_cast<int32_t>(k);
  }

  // q_weight: one little-endian bit stream per (group, column); padding columns hold the zero point.
  r.q_weight.assign(static_cast<size_t>(qrows * r.out_pad), 0);
  uint32_t* qw = reinterpret_cast<uint32_t*>(r.q_weight.data());
  for (int64_t g = 0; g < G; ++g) {
    const int b = p.group_bits[g];
    const uint32_t maxq = (1u << b) - 1u, zero = 1u << (b - 1);
    uint32_t* base = qw + qstart[g] * r.out_pad;
    for (int64_t j = 0; j < p.group_rows[g]; ++j) {
      const uint8_t* src = p.codes + (rstart[g] + j) * p.out;
      const int64_t off = j * b;
      const int64_t w = off >> 5;
      const int sh = static_cast<int>(off & 31);
      uint32_t* row0 = base + w * r.out_pad;
      uint32_t* row1 = row0 + r.out_pad;
      for (int64_t n = 0; n < r.out_pad; ++n) {
        uint32_t v;
        if (n < p.out) {
          v = src[n];
          EXL2_CHECK(v <= maxq, "exl2 pack: code ", v, " at packed row ", rstart[g] + j, ", column ", n,
                     " does not fit the ", b, " bits of group ", g);
        } else {
          v = zero;
        }
        row0[n] |= v << sh;
        if (sh + b > 32) row1[n] |= v >> (32 - sh);
      }
    }
  }

  // q_scale: nibble = stored code; ExLlamaV2 pads scale codes with qscale 0, whose (uint16)(0 - 1) = 0xffff
  // spills over every higher nibble of the word (pack_tensor.cu pack_rows_4_kernel): padding nibbles read 15.
  const int64_t sw = r.out_pad / 8;
  r.q_scale.assign(static_cast<size_t>(G * sw), 0);
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t j = 0; j < sw; ++j) {
      uint32_t word = 0;
      for (int i = 0; i < 8; ++i) {
        const int64_t n = 8 * j + i;
        uint32_t x;
        if (n < p.out) {
          x = p.scale_nibbles[g * p.out + n];
          EXL2_CHECK(x <= 15, "exl2 pack: scale nibble ", x, " at group ", g, ", column ", n, " exceeds 15");
        } else {
          x = 0xffffu;
        }
        word |= x << (4 * i);
      }
      r.q_scale[g * sw + j] = static_cast<int32_t>(word);
    }
  }
  r.q_scale_max.assign(p.q_scale_max, p.q_scale_max + G);
  r.q_groups.resize(static_cast<size_t>(2 * G));
  for (int64_t g = 0; g < G; ++g) {
    r.q_groups[2 * g] = static_cast<int16_t>(p.group_bits[g]);
    r.q_groups[2 * g + 1] = static_cast<int16_t>(qstart[g]);
  }
  return r;
}

int64_t total_bits(const Exl2Layout& L) {
  const int64_t G = static_cast<int64_t>(L.groups.size());
  int64_t bits = 0;
  for (const Exl2Group& g : L.groups) bits += g.rows * L.out * g.bits;  // q_weight
  bits += G * 16;                                                        // q_scale_max
  bits += G * (16 + 16);                                                 // q_groups
  bits += G * L.out * 4;                                                 // q_scale
  bits += L.in * 32;                                                     // q_invperm
  if (L.has_bias) bits += 16 * L.out;
  return bits;
}

double bits_per_weight(const Exl2Layout& L) {
  const int64_t numel = L.in * L.out + (L.has_bias ? L.out : 0);
  return static_cast<double>(total_bits(L)) / static_cast<double>(numel);
}

std::string bits_desc(const Exl2Layout& L) {
  std::vector<std::pair<int, int64_t>> share;  // (bits, rows) in storage order
  std::set<int64_t> sizes;
  for (const Exl2Group& g : L.groups) {
    if (share.empty() || share.back().first != g.bits) share.push_back({g.bits, 0});
    share.back().second += g.rows;
  }
  // Group size per width = its largest group (the last group of a matrix may be clipped).
  for (size_t i = 0; i < L.groups.size(); ++i) {
    const Exl2Group& g = L.groups[i];
    const bool clipped = i + 1 == L.groups.size() && L.groups.size() > 1 && g.bits == L.groups[i - 1].bits &&
                         g.rows < L.groups[i - 1].rows;
    if (!clipped) sizes.insert(g.rows);
  }
  std::string s;
  char buf[64];
  for (auto& [b, r] : share) {
    const double pct = 100.0 * static_cast<double>(r) / static_cast<double>(L.in);
    std::snprintf(buf, sizeof buf, pct >= 1.0 || pct == 0.0 ? "%db:%.0f%%" : "%db:%.1f%%", b, pct);
    s += (s.empty() ? "" : " ") + std::string(buf);
  }
  s += " (";
  bool first = true;
  for (int64_t gs : sizes) {
    s += (first ? "g" : "/g") + std::to_string(gs);
    first = false;
  }
  return s + ")";
}

}  // namespace exl2::quant
