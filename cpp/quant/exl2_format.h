// The EXL2 tensor format as ExLlamaV2 0.3.2 writes it: validation, unpacking to integer codes, bit-exact fp16
// dequantization, packing back to the exact on-disk tensors, and bits-per-weight accounting.
// Facts: shared/specs/exl2-format.md §1 and shared/fixtures/exl2-smol4/README.md (the 8 dequant steps).
//
// Notation: in = in_features, out = out_features, W = HF weight^T, shape [in, out], y = x @ W (+ bias).
// One quantized linear `<key>` is stored as
//   q_weight    i32 [qrows, out_pad]   packed codes, rows in PACKED (act-order) input order, grouped; out_pad =
//                                      out rounded up to 32; padding columns hold the zero point 2^(b-1)
//   q_scale     i32 [G, out_pad/8]     4-bit scale codes, nibble i of word j = column 8j+i (padding nibbles: 15)
//   q_scale_max f16 [G]                per-group maximum scale
//   q_groups    i16 [2G]               (bits, first q_weight row) per group; bits in {8,6,5,4,3,2}, never increasing
//   q_invperm   i32 [in]               argsort(perm); packed row k holds original input feature perm[k]
//   q_perm      (optional) [in]        == argsort(q_invperm) when present (ExLlamaV2 never writes it)
//   bias        (optional) f16 [out]
// Group g covers rows_g = (qrow_start_{g+1} - qrow_start_g)*32/bits_g packed input rows (the last group ends
// at q_weight.rows, and may be ragged: its last word row only partly used). Within each column a group is one
// little-endian bit stream down consecutive q_weight rows: value j at bit j*b, straddling into the next row.
// Dequantization (one fp16 rounding per step, fp16 subnormals kept, never flushed):
//   msc_g  = f16( f32(q_scale_max[g]) * f32(prescale/256) )
//   s[g,n] = f16( (nib[g,n]+1)^2 * msc_g )
//   W[perm[k], n] = f16( (q[k,n] - 2^(b_g-1)) * s[g(k),n] )
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "exl2/tensor.h"

namespace exl2::quant {

// A borrowed read-only CPU array (e.g. a numpy buffer or a Tensor's memory). present=false means absent.
struct Exl2Array {
  const void* data = nullptr;
  DType dtype = DType::I32;
  Shape shape;
  bool present = false;

  static Exl2Array of(const Tensor& t);  // absent when t is undefined; t must live on the CPU
  template <typename T>
  const T* as() const {
    return static_cast<const T*>(data);
  }
};

// The tensors of one EXL2 linear.
struct Exl2Tensors {
  Exl2Array q_weight, q_scale, q_scale_max, q_groups, q_invperm, q_perm, bias;
};

struct Exl2Group {
  int bits = 0;
  int64_t qrow_start = 0;  // first q_weight row
  int64_t qrows = 0;       // q_weight rows of this group
  int64_t row_start = 0;   // first packed input row
  int64_t rows = 0;        // packed input rows
};

// What validate() derives from the tensors.
struct Exl2Layout {
  int64_t in = 0, out = 0, out_pad = 0;
  std::vector<Exl2Group> groups;
  std::vector<int32_t> perm;  // [in] perm[k] = original input feature of packed row k (argsort(q_invperm))
  bool has_bias = false;
};

// Checks every structural property ExLlamaV2's loader and kernels rely on and throws ModelFormatError naming
// the tensor ("<name>.q_groups ...") otherwise: dtypes and ranks; q_groups of even length >= 2 with bits in
// {2,3,4,5,6,8}, non-increasing bits, qrow starts 0, strictly increasing and inside q_weight, each group's
// (row span * 32) divisible by its bits (the last group may be ragged); sum of group rows == in ==
// len(q_invperm); q_invperm a permutation of 0..in-1; q_perm (if present) == argsort(q_invperm); q_scale
// [G, out_pad/8]; q_scale_max [G] and finite; out_pad % 32 == 0 and out_pad - 32 < out <= out_pad; bias [out].
// `name` is the module key used in messages (may be empty); in_features/out_features (-1 = take from the
// tensors; out then defaults to out_pad) are checked against the tensors.
Exl2Layout validate(const Exl2Tensors& t, const std::string& name, int64_t in_features = -1,
                    int64_t out_features = -1);

// Integer content of a validated EXL2 linear.
struct Exl2Codes {
  Exl2Layout layout;
  std::vector<uint8_t> codes;          // [in, out] unsigned codes, PACKED row order (row k = feature perm[k])
  std::vector<uint8_t> scale_nibbles;  // [G, out] stored scale codes 0..15 (scale factor (nib+1)^2)
  std::vector<uint16_t> q_scale_max;   // [G] f16 bits
};
Exl2Codes unpack(const Exl2Tensors& t, const std::string& name, int64_t in_features = -1,
                 int64_t out_features = -1);

// Bit-exact dequantization of a validated linear into `dst` (f16 bits), in ORIGINAL input order:
// transpose=false -> dst [in, out] (W); transpose=true -> dst [out, in] (the HF weight layout).
// prescale folds a constant into msc exactly as ExLlamaV2 does (lm_head logit_scale, o/down scale_depth).
void dequantize_into(const Exl2Tensors& t, const Exl2Layout& layout, double prescale, uint16_t* dst,
                     bool transpose);
std::vector<uint16_t> dequantize(const Exl2Tensors& t, const std::string& name, double prescale = 1.0,
                                 int64_t in_features = -1, int64_t out_features = -1);

// Packer input: everything a quantizer decides. Groups are listed in storage order.
struct Exl2PackInput {
  const uint8_t* codes = nullptr;          // [in, out] unsigned codes in PACKED row order, < 2^bits of the row's group
  std::vector<int> group_bits;             // [G] in {8,6,5,4,3,2}, non-increasing
  std::vector<int64_t> group_rows;         // [G] packed input rows per group, sum = in; rows*bits % 32 == 0
                                           //     for all but the last group
  const uint8_t* scale_nibbles = nullptr;  // [G, out] 0..15
  const uint16_t* q_scale_max = nullptr;   // [G] f16 bits
  const int32_t* perm = nullptr;           // [in] original input feature of packed row k (a permutation)
  int64_t in = 0, out = 0;
};

// The exact on-disk tensors (row-major).
struct Exl2Packed {
  int64_t qrows = 0, out_pad = 0, n_groups = 0, in = 0;
  std::vector<int32_t> q_weight;      // [qrows, out_pad]
  std::vector<int32_t> q_scale;       // [G, out_pad/8]
  std::vector<uint16_t> q_scale_max;  // [G] f16 bits
  std::vector<int16_t> q_groups;      // [2G]
  std::vector<int32_t> q_invperm;     // [in]
};
// Throws InvalidArgument (naming the argument) on inconsistent input; q_groups qrow starts must fit int16.
Exl2Packed pack(const Exl2PackInput& in);

// Bits as ExLlamaV2 counts them (conversion/qparams.py QParams.total_bits): sum rows_g*out*b_g (no padding)
// + G*16 (q_scale_max) + G*32 (q_groups) + G*out*4 (q_scale) + in*32 (q_invperm) + 16*out (bias, if any).
int64_t total_bits(const Exl2Layout& layout);
// total_bits / (in*out (+ out with bias)), ExLlamaV2's QParams.bpw.
double bits_per_weight(const Exl2Layout& layout);
// "8b:5% 4b:95% (g32/g128)": share of input rows per bit width (storage order), then the distinct group sizes.
std::string bits_desc(const Exl2Layout& layout);

}  // namespace exl2::quant
