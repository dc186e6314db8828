// The "v4" EXL2 GEMV for 1 to 32 rows of x (the shipped layout; the kernel template still carries the v4k correction
// (KC) and L1 prefetch (L1P) variants and the cluster epilogue, which the product no longer instantiates or plans): its own load-time layout of q_weight (then the layer's only copy of the
// weights), the per-width decoders (host-callable, so dev/kernels/exl2_decode_check.cu checks them), the repack of
// one layout word, the per-column dequantization the prefill path uses (v4_dequant_col), and the kernel, whose one
// launch covers 1-3 layers that share x (V4Group: q/k/v, gate/up; a single layer is a group of one). Launch setup
// and the host tables are in cuda/exl2_gemm.cu.
//
// Idea: per weight as few instructions as possible. Tensor cores do the multiply-add in fp32 (mma.m16n8k16, A =
// weights as f16 integers, 16 output columns x 16 k; B = x, 16 k x 8 rows of x, two such n-tiles for 9..16 rows
// of x), so a weight costs only its
// extraction: ONE lop3 per pair of weights ((word & mask) | magic, the field landing in the mantissa of a power of
// two whose ulp is 1, so it reads as 2^(10-o) + q). v4: one HADD2 per pair subtracts 2^(10-o) + z (exact q - z).
// v4k: no HADD2; the mma's fp32 C starts at minus sum (2^(10-o) + z) x over the unit(s), computed while staging x.
// The group scale s = f16((nib+1)^2 * msc), as in the reference, is rebuilt from the file's 4-bit code nib (in the
// weight stream) and the group's f16 maximum msc (a per-unit side table staged in shared memory with x): one lop3
// puts the codes of a lane's two columns into two f16 mantissas (2^(10-o) + nib), one HADD2 gives nib + 1, one
// HMUL2 squares it (exact, <= 256) and one HMUL2 by msc rounds once, so s is the reference's f16 bit for bit
// (v4_code_scale). s multiplies the fp32 result once per scale row (32, 64 or 128 rows: RPC below); the weights are
// thus (q - z) * s unrounded in the dot product, within f16 rounding of the reference weights (one-hot x reads them
// back exactly).
//
// Layout (built by exl2_v4_tables / the repack kernel in cuda/exl2_gemm.cu):
//   units (32 packed rows of one group) sorted by width (first appearance), each width's units in file order and
//   padded with empty units to a multiple of 4: a CHUNK = 4 units of one width. Chunks of one width form a RUN,
//   whose chunks all have RPC scale rows (1: every chunk of the run is of one group; 2: units 0, 1 and units 2, 3
//   share one, e.g. 64-row groups; else 4: one per unit). Scale row j of a chunk covers its units
//   [4j / RPC, 4(j+1) / RPC). Output columns in TILES of 16 (one warp, the mma's M). q_weight_v4 =
//   [out_pad / 16 tiles][tile_stride words]; inside a tile, chunk c of width B occupies 64 * B + SW words (SW =
//   v4_code_words(RPC): 4 for RPC 1 and 2, 8 for RPC 4) from run woff + (c - run start) * that on: first the
//   weights, then the SCALE CODES, the file's 4-bit q_scale codes of the tile's 16 columns per scale row, per lane
//   row g = 0..7 (columns g and g + 8):
//     RPC 4: word g: bits 4j..4j+3 = code of column g, bits 16+4j..16+4j+3 = code of column g + 8 (row j);
//     RPC 1, 2: 16-bit half g of the 4 words (bits 16(g%2).. of word g/2): bits 4j = column g, bits 8+4j =
//     column g + 8 (row j < RPC; the other nibbles 0).
//   So a tile carries 4 bits per column per scale row, as the file does, plus 2 padding words per chunk at RPC 1
//   (16-byte alignment of the next chunk). The group maxima are not per column: v4_msc [n_chunks * 4] holds, per
//   unit slot, half2 (msc, msc) of its group (0: empty slot), f16(q_scale_max * prescale / 256) as the reference. Lane
//   (g = lane / 4, t = lane % 4) holds, per chunk, B words for column g and B words for column g + 8; they carry
//   the 8 values of rows 8t .. 8t+7 of each of the chunk's 4 units (bit positions: V4Decode below; the packer
//   derives them by probing the decoder). The B words are split in pieces of V0 = (B >= 4 ? 4 : 2) and B - V0
//   words, each piece laid out [16 columns][4 t][V] so that a warp's load of a piece is contiguous.
//   x is staged per block in packed-row order per unit ([unit][row of x][32]); lane (g, t) reads rows 8t..8t+7
//   of a unit in ONE 16-byte shared load: decoded output 4u + 2s (+1) of a column is the A register for
//   k = 2t, 2t+1 (k = 2t+8, 2t+9) of mma step s of unit u, and unit row 8t + v is value v of lane t.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cuda/exl2_decode.cuh"
#include "exl2/errors.h"

namespace exl2::cuda::exl2k {

constexpr int kV4Warps = 8;                // warps per block, one 16-column tile each
constexpr int kV4Threads = kV4Warps * 32;  // threads per block
constexpr int kV4Cols = kV4Warps * 16;     // output columns per block
constexpr int kV4PrefetchBytes = 8192;     // L2 prefetch per warp at the kernel's start, at most

// Width runs of one layer (at most 6 widths): chunks [start[r], start[r+1]) have bits[r]; run r's first chunk
// begins at word woff[r] of a tile. Scales: every chunk of run r has rpc[r] SCALE ROWS (1: all its units are of
// one group, 2: one per unit pair, 4: one per unit), run r's first is row srow[r]; a scale row = the 4-bit scale
// codes of one group for the tile's columns (v4_code_words).
// Passed to the kernels by value.
struct V4Runs {
  int n = 0;
  int start[7] = {};
  int bits[6] = {};
  int woff[6] = {};
  int rpc[6] = {};
  int srow[6] = {};
};

// First scale row of chunk c (c == start[n] gives the number of rows).
EXL2_HD int v4_srow(const V4Runs& R, int c) {
  int r = 0;
  while (r + 1 < R.n && c >= R.start[r + 1]) ++r;
  return R.srow[r] + (c - R.start[r]) * R.rpc[r];
}

// The runs of Exl2DeviceWeights::v4_runs (start[n + 1], bits[n], woff[n], rpc[n], srow[n]) as a V4Runs (host).
inline V4Runs v4_runs(const std::vector<int32_t>& flat) {
  V4Runs r;
  r.n = static_cast<int>((flat.size() - 1) / 5);
  EXL2_CHECK(r.n >= 1 && r.n <= 6 && flat.size() == size_t(5 * r.n + 1), "v4 GEMV: bad run table");
  for (int i = 0; i <= r.n; ++i) r.start[i] = flat[size_t(i)];
  for (int i = 0; i < r.n; ++i) {
    r.bits[i] = flat[size_t(r.n + 1 + i)];
    r.woff[i] = flat[size_t(2 * r.n + 1 + i)];
    r.rpc[i] = flat[size_t(3 * r.n + 1 + i)];
    r.srow[i] = flat[size_t(4 * r.n + 1 + i)];
  }
  return r;
}

// ---- bit tricks (host and device) ------------------------------------------------------------------------------

// (a & MASK) | c in one lop3 (c in a register, so the immediate slot holds the mask).
template <uint32_t MASK>
EXL2_HD uint32_t v4_lop(uint32_t a, uint32_t c) {
#ifdef __CUDA_ARCH__
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "n"(MASK), "r"(c));
  return d;
#else
  return (a & MASK) | c;
#endif
}

// (a & MASK) | (b & ~MASK-free) : (a & MASK) | b, b already holding disjoint bits.
EXL2_HD uint32_t v4_rot(uint32_t w, int r) {
#ifdef __CUDA_ARCH__
  return __funnelshift_r(w, w, r);
#else
  return r == 0 ? w : (w >> r) | (w << (32 - r));
#endif
}

EXL2_HD uint32_t v4_prmt(uint32_t a, uint32_t b, uint32_t sel) {
#ifdef __CUDA_ARCH__
  return __byte_perm(a, b, sel);
#else
  const uint64_t v = (uint64_t(b) << 32) | a;
  uint32_t d = 0;
  for (int i = 0; i < 4; ++i) d |= uint32_t((v >> (8 * ((sel >> (4 * i)) & 7))) & 0xff) << (8 * i);
  return d;
#endif
}

// f16 exponent bits of 2^(10 - o) in both halves: a field at mantissa bit o reads as 2^(10-o) + q.
constexpr uint32_t v4_magic(int o) { return uint32_t((25 - o) << 10) * 0x10001u; }

// ---- scale codes (host and device) -------------------------------------------------------------------------------

// Scale-code words of one chunk of a tile with rpc scale rows: 4 bits per column per row, rounded up to 16 bytes so
// that the next chunk's weights stay 16-byte aligned (RPC 1 uses 2 of its 4 words).
EXL2_HD constexpr int v4_code_words(int rpc) { return rpc == 4 ? 8 : 4; }
// Words of one chunk of width `bits` in a tile: the weights, then the scale codes.
EXL2_HD constexpr int v4_chunk_words(int bits, int rpc) { return 64 * bits + v4_code_words(rpc); }

// Where the code of (lane row g, column half h: column g + 8h, scale row j) lives inside the chunk's code words:
// returns the word, sets the bit (the layout in the header comment; the packer's side of v4_code_scale).
EXL2_HD int v4_code_pos(int rpc, int g, int h, int j, int& bit) {
  if (rpc == 4) {
    bit = 16 * h + 4 * j;
    return g;
  }
  bit = 16 * (g % 2) + 8 * h + 4 * j;
  return g / 2;
}

// The lane's code word in the kernel's form (bits 4j: column g, 16 + 4j: column g + 8, row j): RPC 4 loads it as
// is; RPC 1, 2 load 16 bits (bits 8 + 4j: column g + 8) and spread them over the two halves with one prmt.
EXL2_HD uint32_t v4_code_spread(uint32_t c16) { return v4_prmt(c16, 0u, 0x4140); }

// Scale row J of a lane from its code word cw (kernel form) and msc2 = half2 (msc, msc) bits of the row's group:
// half2 (s[col g], s[col g + 8]) with s = f16((code + 1)^2 * msc), the reference's bits: one lop3 puts the two codes
// into f16 mantissas (2^(10-o) + code), HADD2 gives code + 1, HMUL2 squares it (exact) and HMUL2 by msc rounds once
// (the f32 product of the reference is exact, so both round the same real number).
template <int J>
EXL2_HD __half2 v4_code_scale(uint32_t cw, uint32_t msc2) {
  constexpr int o = (J % 2) * 4;
  const uint32_t y = J >= 2 ? cw >> 8 : cw;
  const uint32_t raw = v4_lop<(0x000f000fu << o)>(y, v4_magic(o));
  const __half2 a = __hadd2(as_half2(raw), __float2half2_rn(-float((1 << (10 - o)) - 1)));
  return __hmul2_rn(__hmul2_rn(a, a), as_half2(msc2));
}

// Run-time row (the prefill dequantization and host checks).
EXL2_HD __half2 v4_code_scale_rt(uint32_t cw, int j, uint32_t msc2) {
  switch (j) {
    case 0: return v4_code_scale<0>(cw, msc2);
    case 1: return v4_code_scale<1>(cw, msc2);
    case 2: return v4_code_scale<2>(cw, msc2);
    default: return v4_code_scale<3>(cw, msc2);
  }
}

// half2 bits of (raw - (2^(10-o) + z)): exact small integers q - z.
// S false: raw (2^(10-o) + q) is returned as is (the kernel's correction variant subtracts sum (2^(10-o) + z) x
// from the mma's fp32 result instead).
template <int O, int Z, bool S>
EXL2_HD uint32_t v4_sub(uint32_t raw) {
  if constexpr (S) {
    const __half2 c = __float2half2_rn(-float((1 << (10 - O)) + Z));
    return h2_bits(__hadd2(as_half2(raw), c));
  } else {
    return raw;
  }
}

// ---- per-width decoders: B words of one column -> 16 half2 (q - z) -----------------------------------------------

// V4Decode<B>::unit<U>(w, h) gives outputs 4U .. 4U+3 (unit U of the chunk: values 0..7 of this lane, pairs
// (0,1), (2,3), (4,5), (6,7)); run() all 16.
template <int B>
struct V4Decode;

template <>
struct V4Decode<4> {  // word U: fields at 0 and 4 of each half, then the word >> 8
  template <int U, bool S = true>
  EXL2_HD static void unit(const uint32_t (&w)[4], uint32_t (&h)[4]) {
    const uint32_t m0 = v4_magic(0), m4 = v4_magic(4);
    const uint32_t a = w[U], b = w[U] >> 8;
    h[0] = v4_sub<0, 8, S>(v4_lop<0x000f000fu>(a, m0));
    h[1] = v4_sub<4, 8, S>(v4_lop<0x00f000f0u>(a, m4));
    h[2] = v4_sub<0, 8, S>(v4_lop<0x000f000fu>(b, m0));
    h[3] = v4_sub<4, 8, S>(v4_lop<0x00f000f0u>(b, m4));
  }
};

template <>
struct V4Decode<2> {  // word U / 2: fields at 0, 2, 4, 6, 8, then the word >> 10: 0, 2, 4
  template <int U, bool S = true>
  EXL2_HD static void unit(const uint32_t (&w)[2], uint32_t (&h)[4]) {
    const uint32_t a = w[U / 2], b = w[U / 2] >> 10;
    if constexpr (U % 2 == 0) {
      h[0] = v4_sub<0, 2, S>(v4_lop<0x00030003u>(a, v4_magic(0)));
      h[1] = v4_sub<2, 2, S>(v4_lop<0x000c000cu>(a, v4_magic(2)));
      h[2] = v4_sub<4, 2, S>(v4_lop<0x00300030u>(a, v4_magic(4)));
      h[3] = v4_sub<6, 2, S>(v4_lop<0x00c000c0u>(a, v4_magic(6)));
    } else {
      h[0] = v4_sub<8, 2, S>(v4_lop<0x03000300u>(a, v4_magic(8)));
      h[1] = v4_sub<0, 2, S>(v4_lop<0x00030003u>(b, v4_magic(0)));
      h[2] = v4_sub<2, 2, S>(v4_lop<0x000c000cu>(b, v4_magic(2)));
      h[3] = v4_sub<4, 2, S>(v4_lop<0x00300030u>(b, v4_magic(4)));
    }
  }
};

template <>
struct V4Decode<8> {  // words 2U, 2U+1: bytes 0 and 2, then 1 and 3, under the 0x64 exponent byte (prmt)
  template <int U, bool S = true>
  EXL2_HD static void unit(const uint32_t (&w)[8], uint32_t (&h)[4]) {
    const uint32_t m = 0x64646464u;
    h[0] = v4_sub<0, 128, S>(v4_prmt(w[2 * U], m, 0x4240));
    h[1] = v4_sub<0, 128, S>(v4_prmt(w[2 * U], m, 0x4341));
    h[2] = v4_sub<0, 128, S>(v4_prmt(w[2 * U + 1], m, 0x4240));
    h[3] = v4_sub<0, 128, S>(v4_prmt(w[2 * U + 1], m, 0x4341));
  }
};

// 3, 5, 6 bits: a low plane of L = 2 or 4 bits laid out as the 2/4-bit decoders read it (fields at o), and a
// high plane whose bits land at o + L after a rotation of its word: two lop3 per pair.
template <>
struct V4Decode<3> {  // low plane w0, w1 (fields 0, 2, 4, 6; then >> 8), high bit plane w2 rotated 0, 1, 8, 9
  template <int O, bool S>
  EXL2_HD static uint32_t f(uint32_t lo, uint32_t hi) {
    constexpr uint32_t ml = 0x00030003u << O, mh = 0x00040004u << O;
    return v4_sub<O, 4, S>(v4_lop<mh>(hi, v4_lop<ml>(lo, v4_magic(O))));
  }
  template <int U, bool S = true>
  EXL2_HD static void unit(const uint32_t (&w)[3], uint32_t (&h)[4]) {
    constexpr int rot[4] = {0, 1, 8, 9};
    const uint32_t lo = (U & 1) ? w[U / 2] >> 8 : w[U / 2];
    const uint32_t hi = v4_rot(w[2], rot[U]);
    h[0] = f<0, S>(lo, hi);
    h[1] = f<2, S>(lo, hi);
    h[2] = f<4, S>(lo, hi);
    h[3] = f<6, S>(lo, hi);
  }
};

template <>
struct V4Decode<5> {  // low plane w0..w3 (4-bit reading), high bit plane w4 rotated 0..3, 8..11
  template <int O, bool S>
  EXL2_HD static uint32_t f(uint32_t lo, uint32_t hi) {
    constexpr uint32_t ml = 0x000f000fu << O, mh = 0x00100010u << O;
    return v4_sub<O, 16, S>(v4_lop<mh>(hi, v4_lop<ml>(lo, v4_magic(O))));
  }
  template <int U, bool S = true>
  EXL2_HD static void unit(const uint32_t (&w)[5], uint32_t (&h)[4]) {
    constexpr int rot[8] = {0, 1, 2, 3, 8, 9, 10, 11};
    const uint32_t lo0 = w[U], lo1 = w[U] >> 8;
    const uint32_t hi0 = v4_rot(w[4], rot[2 * U]), hi1 = v4_rot(w[4], rot[2 * U + 1]);
    h[0] = f<0, S>(lo0, hi0);
    h[1] = f<4, S>(lo0, hi0);
    h[2] = f<0, S>(lo1, hi1);
    h[3] = f<4, S>(lo1, hi1);
  }
};

template <>
struct V4Decode<6> {  // low plane w0..w3 (4-bit reading), high 2-bit plane w4, w5 rotated 0, 2, 8, 10
  template <int O, bool S>
  EXL2_HD static uint32_t f(uint32_t lo, uint32_t hi) {
    constexpr uint32_t ml = 0x000f000fu << O, mh = 0x00300030u << O;
    return v4_sub<O, 32, S>(v4_lop<mh>(hi, v4_lop<ml>(lo, v4_magic(O))));
  }
  template <int U, bool S = true>
  EXL2_HD static void unit(const uint32_t (&w)[6], uint32_t (&h)[4]) {
    constexpr int rot[4] = {0, 2, 8, 10};
    const uint32_t lo0 = w[U], lo1 = w[U] >> 8;
    const uint32_t hi0 = v4_rot(w[4 + U / 2], rot[(2 * U) % 4]), hi1 = v4_rot(w[4 + U / 2], rot[(2 * U + 1) % 4]);
    h[0] = f<0, S>(lo0, hi0);
    h[1] = f<4, S>(lo0, hi0);
    h[2] = f<0, S>(lo1, hi1);
    h[3] = f<4, S>(lo1, hi1);
  }
};

template <int B, bool S = true>
EXL2_HD void v4_decode(const uint32_t (&w)[B], uint32_t (&h)[16]) {
  uint32_t q[4];
  V4Decode<B>::template unit<0, S>(w, q);
  for (int i = 0; i < 4; ++i) h[i] = q[i];
  V4Decode<B>::template unit<1, S>(w, q);
  for (int i = 0; i < 4; ++i) h[4 + i] = q[i];
  V4Decode<B>::template unit<2, S>(w, q);
  for (int i = 0; i < 4; ++i) h[8 + i] = q[i];
  V4Decode<B>::template unit<3, S>(w, q);
  for (int i = 0; i < 4; ++i) h[12 + i] = q[i];
}

// Run-time width (host tables and checks); sub false: raw 2^(10-o) + q (see v4_sub).
inline void v4_decode_any(int bits, const uint32_t* w, uint32_t (&h)[16], bool sub = true) {
  switch (bits) {
#define EXL2_V4_CASE(B)                                 \
  case B: {                                             \
    uint32_t v[B];                                      \
    for (int i = 0; i < B; ++i) v[i] = w[i];            \
    sub ? v4_decode<B, true>(v, h) : v4_decode<B, false>(v, h); \
    break;                                              \
  }
    EXL2_V4_CASE(2)
    EXL2_V4_CASE(3)
    EXL2_V4_CASE(4)
    EXL2_V4_CASE(5)
    EXL2_V4_CASE(6)
    EXL2_V4_CASE(8)
#undef EXL2_V4_CASE
    default:
      break;
  }
}

// ---- layout arithmetic (host and device) -----------------------------------------------------------------------

EXL2_HD constexpr int v4_piece0(int bits) { return bits >= 4 ? 4 : 2; }

// Word index (inside its chunk's 64 * bits words) of word i of lane (column c of the tile, t).
EXL2_HD int v4_word_offset(int bits, int c, int t, int i) {
  const int v0 = v4_piece0(bits);
  if (i < v0) return (c * 4 + t) * v0 + i;
  const int v1 = bits - v0;
  return 64 * v0 + (c * 4 + t) * v1 + (i - v0);
}

// Bit map of one width (the inverse of the decoder, found by probing it with single bits): map[i * 32 + j] for
// bit j of word i = u << 8 | v << 4 | k: bit k of value v (row 8t + v) of unit u of the chunk. -1: unused.
inline void v4_bitmap(int bits, int32_t* map) {
  for (int i = 0; i < bits; ++i) {
    for (int j = 0; j < 32; ++j) {
      uint32_t w[8] = {};
      w[i] = 1u << j;
      uint32_t h[16];
      v4_decode_any(bits, w, h);
      const float z = float(1 << (bits - 1));
      int found = -1, n = 0;
      for (int q = 0; q < 16; ++q) {
        for (int hh = 0; hh < 2; ++hh) {
          const float v = __half2float(hh ? __high2half(as_half2(h[q])) : __low2half(as_half2(h[q]))) + z;
          if (v != 0.f) {
            int k = 0;
            while ((1 << k) < int(v)) ++k;
            found = (q / 4) << 8 | (2 * (q % 4) + hh) << 4 | k;
            ++n;
            if (float(1 << k) != v) n += 100;  // not a single bit: reported by the caller's check
          }
        }
      }
      map[i * 32 + j] = n == 1 ? found : -1;
    }
  }
}

// What the repack reads (all device pointers on the GPU, host pointers in the host check).
struct V4Src {
  const uint32_t* q_weight;    // ExLlamaV2's [qrows, out_pad]
  const uint32_t* q_scale;     // [G, out_pad / 8]: the file's 4-bit codes (the scale code words copy them)
  const int2* slot_info;       // [n_chunks * 4]: {first q_weight row of the unit, nvals (0: empty slot)}
  const int32_t* maps;         // [9][256]: v4_bitmap of each width
  const int32_t* srow_group;   // [scale rows]: group (-1: empty)
  const int32_t* chunk_srow;   // [n_chunks + 1]: first scale row of each chunk
  int64_t out_pad;
  V4Runs runs;
};

// One word of the v4 layout: word `off` of tile `tile`. Inside a chunk of width B with rpc scale rows: 64 * B
// weight words (v4_word_offset), then v4_code_words(rpc) scale-code words (v4_code_pos; empty rows and padding 0).
EXL2_HD uint32_t v4_layout_word(const V4Src& S, int64_t tile, int64_t off) {
  const V4Runs& runs = S.runs;
  int r = 0;
  while (r + 1 < runs.n && off >= runs.woff[r + 1]) ++r;
  const int bits = runs.bits[r], rpc = runs.rpc[r], stride = v4_chunk_words(bits, rpc);
  const int64_t rel = off - runs.woff[r];
  const int chunk = runs.start[r] + int(rel / stride);
  int w = int(rel % stride);
  if (w >= 64 * bits) {  // scale-code word
    w -= 64 * bits;
    uint32_t word = 0;
    for (int j = 0; j < rpc; ++j) {
      const int grp = S.srow_group[S.chunk_srow[chunk] + j];
      if (grp < 0) continue;
      for (int g = 0; g < 8; ++g)
        for (int h = 0; h < 2; ++h) {
          int bit = 0;
          if (v4_code_pos(rpc, g, h, j, bit) != w) continue;
          const int64_t col = tile * 16 + g + 8 * h;
          const uint32_t nib = (S.q_scale[int64_t(grp) * (S.out_pad / 8) + col / 8] >> (4 * (col % 8))) & 15u;
          word |= nib << bit;
        }
    }
    return word;
  }
  const int v0 = v4_piece0(bits);
  int v = v0, pstart = 0;
  if (w >= 64 * v0) {
    w -= 64 * v0;
    v = bits - v0;
    pstart = v0;
  }
  const int ct = w / v, i = pstart + w % v, c = ct / 4, t = ct % 4;
  uint32_t word = 0;
  for (int j = 0; j < 32; ++j) {
    const int32_t e = S.maps[bits * 256 + i * 32 + j];
    if (e < 0) continue;
    const int u = e >> 8, val = (e >> 4) & 15, k = e & 15;
    const int2 si = S.slot_info[chunk * 4 + u];
    const int row = 8 * t + val;
    if (row >= si.y) continue;
    const int bp = row * bits + k;
    const uint32_t sw = S.q_weight[(int64_t(si.x) + bp / 32) * S.out_pad + tile * 16 + c];
    word |= ((sw >> (bp % 32)) & 1u) << j;
  }
  return word;
}

// ---- dequantization from the v4 layout (the prefill path; host and device) ----------------------------------------

// Loads N words from p (16-byte aligned, N % 4 == 0) into w[at..].
template <int N, int W>
EXL2_HD void v4_ldn(const uint32_t* p, uint32_t (&w)[W], int at) {
#pragma unroll
  for (int i = 0; i < N; i += 4) {
    const uint4 v = ld_u4(p + i);
    w[at + i] = v.x, w[at + i + 1] = v.y, w[at + i + 2] = v.z, w[at + i + 3] = v.w;
  }
}

// The f16 weights of column c16 (0..15) of one chunk of width B: p = the chunk's first word in its tile, rpc its
// scale rows, msc4 the chunk's 4 entries of v4_msc (the kernel's v4_code_scale gives the scales). Calls f(u, r, bits)
// for unit u (0..3) of the chunk and row r (0..31) of the unit with the f16 bits
// of f16((q - z) * s) (exact q - z, one IEEE rounding of the product: the reference's weight, including rows past a
// unit's end, which the caller skips). The column's words of all 4 lane rows t are one contiguous range per piece
// (v4_word_offset): 4 * V0 words, then 4 * (B - V0).
template <int B, typename F>
EXL2_HD void v4_dequant_col(const uint32_t* p, int rpc, const uint32_t* msc4, int c16, F& f) {
  constexpr int V0 = v4_piece0(B), V1 = B - V0;
  uint32_t lo[4 * V0], hi[V1 > 0 ? 4 * V1 : 1];
  v4_ldn<4 * V0>(p + c16 * 4 * V0, lo, 0);
  if constexpr (V1 > 0) v4_ldn<4 * V1>(p + 64 * V0 + c16 * 4 * V1, hi, 0);
  const int g = c16 % 8;
  const uint32_t cw = rpc == 4 ? ld_u32(p + 64 * B + g)
                                : v4_code_spread((ld_u32(p + 64 * B + g / 2) >> (16 * (g % 2))) & 0xffffu);
  __half2 s2[4];
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    const int j = u * rpc / 4;  // the unit's scale row; its msc: the row's first unit's (the same group)
    const uint32_t sw = h2_bits(v4_code_scale_rt(cw, j, ld_u32(msc4 + 4 * j / rpc)));
    s2[u] = as_half2(c16 < 8 ? (sw & 0xffffu) * 0x10001u : (sw >> 16) * 0x10001u);
  }
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    uint32_t w[B];
#pragma unroll
    for (int i = 0; i < V0; ++i) w[i] = lo[t * V0 + i];
#pragma unroll
    for (int i = 0; i < V1; ++i) w[V0 + i] = hi[t * (V1 > 0 ? V1 : 1) + i];
    uint32_t h[16];
    v4_decode<B, true>(w, h);
#pragma unroll
    for (int q = 0; q < 16; ++q) {
      const uint32_t v = h2_bits(__hmul2_rn(as_half2(h[q]), s2[q / 4]));
      f(q / 4, 8 * t + 2 * (q % 4), v & 0xffffu);
      f(q / 4, 8 * t + 2 * (q % 4) + 1, v >> 16);
    }
  }
}

template <typename F>
EXL2_HD void v4_dequant_col_any(int bits, const uint32_t* p, int rpc, const uint32_t* msc4, int c16, F& f) {
  switch (bits) {
    case 2: v4_dequant_col<2>(p, rpc, msc4, c16, f); break;
    case 3: v4_dequant_col<3>(p, rpc, msc4, c16, f); break;
    case 4: v4_dequant_col<4>(p, rpc, msc4, c16, f); break;
    case 5: v4_dequant_col<5>(p, rpc, msc4, c16, f); break;
    case 6: v4_dequant_col<6>(p, rpc, msc4, c16, f); break;
    case 8: v4_dequant_col<8>(p, rpc, msc4, c16, f); break;
    default: break;
  }
}

// ---- one launch for several layers that share x (q/k/v, gate/up) -------------------------------------------------

constexpr int kV4MaxGroup = 3;  // layers per launch at most (q, k, v)

// One layer of a launch: its weights and tables (Exl2DeviceWeights' v4_ tensors), y, and its own regions of the
// per-device split-k state (acc [m][out_pad] and counters [col_blocks], all zero between launches; the layers of a
// group get disjoint regions). cps, slices, block0: set by v4_plan.
struct V4Layer {
  const uint32_t* qw = nullptr;         // [out_pad / 16][tile_stride]
  const uint32_t* msc = nullptr;        // [n_chunks * 4]: half2 (msc, msc) of each unit slot's group (v4_msc)
  const int32_t* chunk_woff = nullptr;  // [n_chunks + 1]
  const int32_t* xsrc = nullptr;        // [n_chunks * 4 * 32]
  const float* kcoef = nullptr;         // [n_chunks * 4 * 32], the KC variant only
  const float* bias = nullptr;          // [out] or null
  __half* y = nullptr;                  // [m][out]
  float* acc = nullptr;                 // [m][out_pad]
  unsigned* counters = nullptr;         // [col_blocks]
  int64_t tile_stride = 0, out = 0, out_pad = 0;
  V4Runs runs;
  int n_chunks = 0;
  int col_blocks = 0;  // ceil(out_pad / kV4Cols)
  int cps = 1;         // chunks per k slice
  int slices = 1;      // k slices: blocks col_blocks * slices, from flat block block0 on
  int block0 = 0;
};

// The kernel's parameter (__grid_constant__: read in place, one copy per launch, ~0.8 KB of the 4 KB limit).
struct V4Group {
  V4Layer l[kV4MaxGroup];
  int n = 0;        // layers
  int blocks = 0;   // the 1-D grid: sum of col_blocks * slices
  int cluster = 0;  // > 1: every layer has this many slices, launched as clusters of them (v4_plan_cluster)
};

// Grid shape: ONE flat 1-D grid, layer i owning blocks [block0, block0 + col_blocks * slices), inside it column
// blocks fastest (as blockIdx.x of a (col_blocks, slices) grid). Chosen over a 3-D grid (z = layer, x/y = the
// largest layer's shape, blocks outside their layer's shape exiting): with GQA, k and v have 4-8x fewer column blocks
// than q, so most z-slices would be idle blocks that still cost a scheduling slot and, under PDL, a
// griddepcontrol.wait each (a block must wait before exiting, or the grid can finish before its predecessor). The
// flat grid has no idle block; each block finds its layer in a <= 3-entry prefix table (a few uniform
// instructions against the ~250 of a block's fixed costs).
struct V4Block {
  int layer, cb, slice;
};
EXL2_HD V4Block v4_block(const V4Group& g, int b) {
  int li = 0;
#pragma unroll
  for (int i = 1; i < kV4MaxGroup; ++i)
    if (i < g.n && b >= g.l[i].block0) li = i;
  const int local = b - g.l[li].block0, cb = g.l[li].col_blocks;
  if (g.cluster > 1) return {li, local / g.cluster, local % g.cluster};  // a cluster = the slices of one column block
  return {li, local % cb, local / cb};
}

// Splits k for every layer of g (host): slices of about `target` chunks (a block's fixed costs against ~80
// instructions per chunk), but together at least `sms` blocks (one per SM) and at most `wave` (one wave of resident
// blocks: a second, partial wave would cost a whole block time); every layer gets at most wave / (sum of column
// blocks) slices, so the limit holds for the group. forced > 0: that many slices per layer (env
// option gemv_slices). cps is capped by max_cps (the staged x's shared memory). Sets cps, slices, block0 and
// g.blocks; false when the grid exceeds int range. A group of one gets the single-layer grid of before.
inline bool v4_plan(V4Group& g, int64_t sms, int64_t wave, int target, int max_cps, int forced) {
  auto cdiv = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
  int64_t cols = 0;
  for (int i = 0; i < g.n; ++i) cols += g.l[i].col_blocks;
  if (cols <= 0) return false;
  const int64_t most = std::max<int64_t>(1, wave / cols), fill = cdiv(sms, cols);
  int64_t block0 = 0;
  for (int i = 0; i < g.n; ++i) {
    V4Layer& L = g.l[i];
    const int64_t nc = std::max(L.n_chunks, 1);
    int64_t slices = std::max(fill, cdiv(nc, target));
    slices = std::max<int64_t>(1, std::min({slices, most, nc}));
    if (forced > 0) slices = std::min<int64_t>(forced, nc);
    const int64_t cps = std::max<int64_t>(1, std::min<int64_t>(cdiv(nc, slices), max_cps));
    slices = cdiv(nc, cps);
    L.cps = int(cps);
    L.slices = int(slices);
    L.block0 = int(block0);
    block0 += slices * L.col_blocks;
    if (block0 > INT_MAX) return false;
  }
  g.blocks = int(block0);
  return true;
}

// The cluster variant of the plan (host; not planned by the product: it lost its measurement): the k slices of a column block form one
// thread-block cluster and add their partial sums through distributed shared memory (no accumulator, atomics, fence
// or counter; the sum runs in slice order, so the result is deterministic). Every layer of g gets the same number of
// slices S, since a launch has one cluster shape: the largest S <= min(max_cluster, the largest of v4_plan's
// slices) at which every layer's cps = ceil(chunks / S) fills all S slices (no empty slice: the kernel's prologue
// assumes one) and stays <= max_cps. Blocks: per layer, column blocks x S, slices fastest (v4_block). Returns false,
// g unchanged, when no S >= 2 qualifies; then the plain plan applies.
inline bool v4_plan_cluster(V4Group& g, int max_cluster, int max_cps) {
  int target = 1;
  for (int i = 0; i < g.n; ++i) target = std::max(target, g.l[i].slices);
  for (int s = std::min(target, max_cluster); s >= 2; --s) {  // the most slices at which no slice is empty
    V4Group c = g;
    int64_t block0 = 0;
    bool ok = true;
    for (int i = 0; i < c.n && ok; ++i) {
      V4Layer& L = c.l[i];
      const int64_t nc = std::max(L.n_chunks, 1);
      const int64_t cps = (nc + s - 1) / s;
      ok = cps <= max_cps && (nc + cps - 1) / cps == s;
      L.cps = int(cps);
      L.slices = s;
      L.block0 = int(block0);
      block0 += int64_t(s) * L.col_blocks;
      ok = ok && block0 <= INT_MAX;
    }
    if (!ok) continue;
    c.blocks = int(block0);
    c.cluster = s;
    g = c;
    return true;
  }
  return false;
}

// ---- the kernel ---------------------------------------------------------------------------------------------------

#ifdef __CUDACC__

// Weight loads, read-only path. L1 false: no L1 allocation (streamed once); true: L1-allocating, for the L1P
// variant whose loads find the lines its prefetch.global.L1 brought in.
template <bool L1>
__device__ __forceinline__ uint4 v4_ld4(const uint32_t* p) {
  uint4 v;
  if constexpr (L1)
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  else
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
  return v;
}
template <bool L1>
__device__ __forceinline__ uint2 v4_ld2(const uint32_t* p) {
  uint2 v;
  if constexpr (L1)
    asm volatile("ld.global.nc.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  else
    asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}
template <bool L1>
__device__ __forceinline__ uint32_t v4_ld16(const uint16_t* p) {
  unsigned short v;
  if constexpr (L1)
    asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(v) : "l"(p));
  else
    asm volatile("ld.global.nc.L1::no_allocate.u16 %0, [%1];" : "=h"(v) : "l"(p));
  return v;
}
template <bool L1>
__device__ __forceinline__ uint32_t v4_ld1(const uint32_t* p) {
  uint32_t v;
  if constexpr (L1)
    asm volatile("ld.global.nc.u32 %0, [%1];" : "=r"(v) : "l"(p));
  else
    asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

// The L1P variant's prefetch depth: chunks of its slice each warp keeps requested into L1 ahead of its loads.
constexpr int kV4L1Ahead = 3;

// prefetch.global.L1 of `bytes` bytes from p (128-byte lines, one per lane; bytes <= 4096).
__device__ __forceinline__ void v4_prefetch_l1(const uint32_t* p, int lane, int bytes) {
  if (lane * 128 < bytes) asm volatile("prefetch.global.L1 [%0];" ::"l"(p + lane * 32));
}

// c = A B (zero C), fp32 out.
__device__ __forceinline__ void v4_mma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                       uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Loads V words at p (V = 4, 2, 1) into w[at..].
template <int V, bool L1, int N>
__device__ __forceinline__ void v4_ldv(const uint32_t* p, uint32_t (&w)[N], int at) {
  if constexpr (V == 4) {
    const uint4 v = v4_ld4<L1>(p);
    w[at] = v.x, w[at + 1] = v.y, w[at + 2] = v.z, w[at + 3] = v.w;
  } else if constexpr (V == 2) {
    const uint2 v = v4_ld2<L1>(p);
    w[at] = v.x, w[at + 1] = v.y;
  } else if constexpr (V == 1) {
    w[at] = v4_ld1<L1>(p);
  }
}

template <int B, int RPC>
struct V4Buf {
  uint32_t a[B], b[B];  // columns g and g + 8
  uint32_t s;           // the lane's scale codes (RPC 4: kernel form; 1, 2: 16 bits, v4_code_spread)
};

// Loads one chunk (p = the chunk's first word in this tile + lt * V0; lt = g * 4 + t; so = the lane's code offset
// from p: RPC 4: 64 * B - lt * V0 + g words; RPC 1, 2: 2 * (64 * B - lt * V0) + g 16-bit halves).
template <int B, int RPC, bool L1>
__device__ __forceinline__ void v4_load(const uint32_t* p, int lt, int so, V4Buf<B, RPC>& d) {
  constexpr int V0 = v4_piece0(B), V1 = B - V0;
  v4_ldv<V0, L1>(p, d.a, 0);
  v4_ldv<V0, L1>(p + 32 * V0, d.b, 0);
  if constexpr (V1 > 0) {
    const uint32_t* q = p + 64 * V0 + lt * (V1 - V0);
    v4_ldv<V1, L1>(q, d.a, V0);
    v4_ldv<V1, L1>(q + 32 * V1, d.b, V0);
  }
  if constexpr (RPC == 4)
    d.s = v4_ld1<L1>(p + so);
  else
    d.s = v4_ld16<L1>(reinterpret_cast<const uint16_t*>(p) + so);
}

// N-tiles of the mma (8 rows of x each) a kernel for M rows of x needs.
template <int M>
constexpr int v4_ntiles() {
  return M > 8 ? M / 8 : 1;  // 16: 2, 32: 4 (option gemv_m32)
}

// acc += c * (s[g], s[g + 8]) (sh: the scale row's half2 for this lane, v4_code_scale), for every n-tile.
template <int M>
__device__ __forceinline__ void v4_scale(const float (&c)[v4_ntiles<M>()][4], __half2 sh,
                                         float (&acc)[v4_ntiles<M>()][4]) {
  const float2 s = __half22float2(sh);
#pragma unroll
  for (int j = 0; j < v4_ntiles<M>(); ++j) {
    acc[j][0] = fmaf(c[j][0], s.x, acc[j][0]);
    acc[j][2] = fmaf(c[j][2], s.y, acc[j][2]);
    if constexpr (M > 1) {
      acc[j][1] = fmaf(c[j][1], s.x, acc[j][1]);
      acc[j][3] = fmaf(c[j][3], s.y, acc[j][3]);
    }
  }
}

// RPC 1: the chunk's 4 units share a group, one fp32 result for all 8 mma steps and one scale row; RPC 2: one per
// unit pair; RPC 4: one per unit. cw: the lane's code word (kernel form), ms: the chunk's 4 staged v4_msc entries.
// C's start: 0, or with KC (raw 2^(10-o) + q weights) minus the correction sum (2^(10-o) + z) x of the unit(s):
// ks = the lane's correction sums (rows (2t) % M, +1 of x; n-tile 1: rows 2t + 8, 2t + 9) of the first unit, unit
// stride M floats.
template <int M, bool KC, int NU>
__device__ __forceinline__ void v4_cinit(const float* ks, float (&c)[v4_ntiles<M>()][4]) {
#pragma unroll
  for (int j = 0; j < v4_ntiles<M>(); ++j) {
    if constexpr (!KC) {
      c[j][0] = c[j][1] = c[j][2] = c[j][3] = 0.f;
    } else if constexpr (M == 1) {
      float k = ks[0];
#pragma unroll
      for (int u = 1; u < NU; ++u) k += ks[u];
      c[j][0] = c[j][2] = -k;
      c[j][1] = c[j][3] = 0.f;
    } else {
      float2 k = *reinterpret_cast<const float2*>(ks + 8 * j);
#pragma unroll
      for (int u = 1; u < NU; ++u) {
        const float2 v = *reinterpret_cast<const float2*>(ks + u * M + 8 * j);
        k.x += v.x;
        k.y += v.y;
      }
      c[j][0] = c[j][2] = -k.x;
      c[j][1] = c[j][3] = -k.y;
    }
  }
}

template <int B, int M, bool KC, int RPC, int U>
__device__ __forceinline__ void v4_unit(const V4Buf<B, RPC>& d, uint32_t cw, const __half* xs, const float* ks,
                                        const uint32_t* ms, float (&c)[v4_ntiles<M>()][4],
                                        float (&acc)[v4_ntiles<M>()][4]) {
  uint32_t h0[4], h1[4];
  V4Decode<B>::template unit<U, !KC>(d.a, h0);
  V4Decode<B>::template unit<U, !KC>(d.b, h1);
  if constexpr (RPC == 4) v4_cinit<M, KC, 1>(ks + U * M, c);
  if constexpr (RPC == 2 && U % 2 == 0) v4_cinit<M, KC, 2>(ks + U * M, c);
#pragma unroll
  for (int j = 0; j < v4_ntiles<M>(); ++j) {  // n-tile j: rows 8j + (g % M) of x
    const uint4 xv = *reinterpret_cast<const uint4*>(xs + U * M * 32 + j * 8 * 32);
    v4_mma(c[j], h0[0], h1[0], h0[1], h1[1], xv.x, xv.y);
    v4_mma(c[j], h0[2], h1[2], h0[3], h1[3], xv.z, xv.w);
  }
  if constexpr (RPC == 4) v4_scale<M>(c, v4_code_scale<U>(cw, ms[U]), acc);
  if constexpr (RPC == 2 && U % 2 == 1) v4_scale<M>(c, v4_code_scale<U / 2>(cw, ms[U - 1]), acc);
}

template <int B, int M, bool KC, int RPC>
__device__ __forceinline__ void v4_chunk(const V4Buf<B, RPC>& d, const __half* xs, const float* ks,
                                         const uint32_t* ms, float (&acc)[v4_ntiles<M>()][4]) {
  float c[v4_ntiles<M>()][4];
  const uint32_t cw = RPC == 4 ? d.s : v4_code_spread(d.s);
  if constexpr (RPC == 1) v4_cinit<M, KC, 4>(ks, c);
  v4_unit<B, M, KC, RPC, 0>(d, cw, xs, ks, ms, c, acc);
  v4_unit<B, M, KC, RPC, 1>(d, cw, xs, ks, ms, c, acc);
  v4_unit<B, M, KC, RPC, 2>(d, cw, xs, ks, ms, c, acc);
  v4_unit<B, M, KC, RPC, 3>(d, cw, xs, ks, ms, c, acc);
  if constexpr (RPC == 1) v4_scale<M>(c, v4_code_scale<0>(cw, ms[0]), acc);
}

// Chunks [0, n) of one width run, starting at p (this tile), staged x / corrections / maxima of the first at xs / ks
// / ms.
// Register double buffer: the next chunk's loads are issued before this one is decoded. ahead: whether the loop
// keeps an L2 bulk prefetch window of kV4PrefetchBytes ahead (sm_90; a run-time window size costs registers).
// L1P: every chunk also asks L1 for the chunk kV4L1Ahead further on in the run, and the loads allocate in L1.
template <int B, int M, bool KC, int RPC, bool L1P>
__device__ __forceinline__ void v4_run_rpc(const uint32_t* p, int n, int lt, const __half* xs, const float* ks,
                                           const uint32_t* ms, bool ahead, float (&acc)[v4_ntiles<M>()][4]) {
  constexpr int kStride = v4_chunk_words(B, RPC);
  V4Buf<B, RPC> b0, b1;
  p += lt * v4_piece0(B);  // lane offset of piece 0 (piece 1 and the scale codes: v4_load adds the rest)
  const int so = (RPC == 4 ? 1 : 2) * (64 * B - lt * v4_piece0(B)) + lt / 4;
  v4_load<B, RPC, L1P>(p, lt, so, b0);
  // Loads are unconditional (past the run's end they re-read its last chunk), so the buffers are always whole.
  // The kernel's start asked L2 for the first bytes of the slice; keep that window ahead.
  [[maybe_unused]] constexpr int kAhead = (kV4PrefetchBytes / 4 + kStride - 1) / kStride;  // chunks (sm_90)
  for (int i = 0; i < n; i += 2) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (lt == 0 && ahead && i + kAhead < n)
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p - lt * v4_piece0(B) + kAhead * kStride),
                   "r"(4 * kStride * min(2, n - i - kAhead))
                   : "memory");
#endif
    if constexpr (L1P) {  // chunks i + A and i + 1 + A when inside the run
      const uint32_t* pc = p - lt * v4_piece0(B) + kV4L1Ahead * kStride;
      if (i + kV4L1Ahead < n) v4_prefetch_l1(pc, lt, 4 * kStride);
      if (i + 1 + kV4L1Ahead < n) v4_prefetch_l1(pc + kStride, lt, 4 * kStride);
    }
    const uint32_t* p1 = i + 1 < n ? p + kStride : p;
    v4_load<B, RPC, L1P>(p1, lt, so, b1);
    v4_chunk<B, M, KC, RPC>(b0, xs, ks, ms, acc);
    if (i + 1 >= n) break;
    const uint32_t* p2 = i + 2 < n ? p + 2 * kStride : p1;
    v4_load<B, RPC, L1P>(p2, lt, so, b0);
    v4_chunk<B, M, KC, RPC>(b1, xs + 4 * M * 32, ks + 4 * M, ms + 4, acc);
    p += 2 * kStride;
    xs += 8 * M * 32;
    ks += 8 * M;
    ms += 8;
  }
}

template <int B, int M, bool KC, bool L1P>
__device__ __forceinline__ void v4_run(int rpc, const uint32_t* p, int n, int lt, const __half* xs, const float* ks,
                                       const uint32_t* ms, bool ahead, float (&acc)[v4_ntiles<M>()][4]) {
  if (rpc == 1)
    v4_run_rpc<B, M, KC, 1, L1P>(p, n, lt, xs, ks, ms, ahead, acc);
  else if (rpc == 2)
    v4_run_rpc<B, M, KC, 2, L1P>(p, n, lt, xs, ks, ms, ahead, acc);
  else
    v4_run_rpc<B, M, KC, 4, L1P>(p, n, lt, xs, ks, ms, ahead, acc);
}

// Tuning knobs of one launch (the plan's tuning: cpp/ops/exl2_matmul.h; the defaults are what was measured).
struct V4Knobs {
  int prefetch_bytes = kV4PrefetchBytes;  // L2 bulk prefetch per warp at the start (0: none)
  int ahead = 1;  // 1: the loop keeps a kV4PrefetchBytes window prefetched ahead (sm_90), 0: none
  int pdl = 0;    // 1: launched as a programmatic dependent (sm_90): the weights' L2 prefetch overlaps the previous
                  // kernel; x, acc and counters are touched only after griddepcontrol.wait
  int l1 = 0;     // host side only: 1 launches the L1P variant (not instantiated)
};

// The decode step's small kernels folded into the launch (FUSE kernels only; cuda/exl2_gemm.cu exl2_gemm_fused):
// prologue 1 (rms_norm): x is the residual h and the block stages f16(h * rsqrt(mean(h^2) + eps) * norm_w), having
// reduced the fp32 sum of squares of its m rows of h over all of `in` itself (v4_norm_rows); prologue 2 (silu_mul):
// x is gate and the block stages f16(silu(gate) * up) as cuda/silu_mul.cu computes it; add: the epilogue adds the
// fp32 result into y (y = f16(f32(y) + result), one rounding) instead of writing it.
struct V4Fuse {
  const void* norm_w = nullptr;  // rms_norm: [in], w_type
  const __half* up = nullptr;    // silu_mul: [m][in], x's row stride
  float eps = 0.f;
  int prologue = 0;  // 0 none, 1 rms_norm, 2 silu_mul
  int w_type = 0;    // norm_w: 0 f32, 1 f16, 2 bf16
  int vec = 0;       // 1: in % 8 == 0 and x 16-byte aligned (the norm's reduction loads 16 bytes)
  int add = 0;       // 1: the residual-add epilogue
};

#ifdef __CUDACC__
// rinv[n] = rsqrt(mean(x[n]^2) + eps) for the block's rows n < m (fp32 sums of squares over all of `in`, every
// thread a strided part of every row, then warps, then the block; rsqrtf as cuda/rms_norm.cu). Ends with a
// __syncthreads: rinv is visible to the whole block.
template <int M>
__device__ __forceinline__ void v4_norm_rows(const __half* x, int64_t in, int m, const V4Fuse& fz, float* rinv) {
  __shared__ float part[kV4Warps][M];
  float ss[M];
#pragma unroll
  for (int n = 0; n < M; ++n) ss[n] = 0.f;
  if (fz.vec) {
    const int64_t nv = in / 8;
    for (int64_t i = threadIdx.x; i < nv; i += kV4Threads) {
#pragma unroll
      for (int n = 0; n < M; ++n) {
        if (n >= m) break;
        const uint4 v = *reinterpret_cast<const uint4*>(x + int64_t(n) * in + 8 * i);
        const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 f = __half22float2(h[j]);
          ss[n] = fmaf(f.x, f.x, ss[n]);
          ss[n] = fmaf(f.y, f.y, ss[n]);
        }
      }
    }
  } else {
    for (int64_t i = threadIdx.x; i < in; i += kV4Threads) {
#pragma unroll
      for (int n = 0; n < M; ++n) {
        if (n >= m) break;
        const float f = __half2float(x[int64_t(n) * in + i]);
        ss[n] = fmaf(f, f, ss[n]);
      }
    }
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int n = 0; n < M; ++n) {
    float v = ss[n];
#pragma unroll
    for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) part[warp][n] = v;
  }
  __syncthreads();
  if (int(threadIdx.x) < m) {
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < kV4Warps; ++w) s += part[w][threadIdx.x];
    rinv[threadIdx.x] = rsqrtf(s / static_cast<float>(in) + fz.eps);
  }
  __syncthreads();
}

// The f16 bits the FUSE kernel stages for x[n][k] (n < m, k a valid feature): the prologue applied to it.
__device__ __forceinline__ unsigned short v4_fused_x(const __half* xn, int64_t k, int64_t up_off, const V4Fuse& fz,
                                                     float rinv_n) {
  if (fz.prologue == 1) {
    float w;
    if (fz.w_type == 0)
      w = static_cast<const float*>(fz.norm_w)[k];
    else if (fz.w_type == 1)
      w = __half2float(static_cast<const __half*>(fz.norm_w)[k]);
    else
      w = __uint_as_float(uint32_t(static_cast<const unsigned short*>(fz.norm_w)[k]) << 16);  // bf16
    return __half_as_ushort(__float2half_rn(__half2float(xn[k]) * rinv_n * w));
  }
  if (fz.prologue == 2) {
    const float g = __half2float(xn[k]), u = __half2float(fz.up[up_off + k]);
    return __half_as_ushort(__float2half_rn(g / (1.f + expf(-g)) * u));
  }
  return __half_as_ushort(xn[k]);
}
#endif  // __CUDACC__

// y_i = x W_i (+ bias_i) for the layers i of grp (1..kV4MaxGroup, sharing x [m, in]); 1-D grid of grp.blocks (see
// v4_block): block (layer, cb, slice) covers column block cb (kV4Cols columns) and k slice `slice` (cps chunks) of
// its layer. M: rows of x the kernel is built for (m <= M; 16: two mma n-tiles). A block stages x (through its
// layer's xsrc) in shared memory, each warp multiplies its 16-column tile over those chunks, adds its fp32 sums into
// its layer's acc [m, out_pad] (atomics); the last block of the column block writes y = f16(acc + bias) and zeroes
// acc and its counter again (a layer of one slice: every warp writes its y directly).
// KC: the correction variant (raw weights, no HADD2; kcoef [slots * 32] = 2^(10-o) + z of every row, 0 past a
// unit's end; see v4_sub). L1P: the L1 prefetch pipeline variant (not instantiated; v4_run_rpc): each warp asks L1
// for the first kV4L1Ahead chunks of its slice before staging x, then keeps kV4L1Ahead chunks requested ahead.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// The cluster epilogue (grp.cluster > 1; every thread of the block calls it, after the chunk loops): each block
// writes its fp32 partials (a, as the kernel's n-tiles hold them) into its shared memory part [M][kV4Cols] (the
// staged x's space, v4_cluster_smem bytes at least), the cluster syncs, then block `rank` of the cluster sums the
// elements e = rank, rank + S, ... of [m][kV4Cols] over the S blocks in rank order through distributed shared
// memory and writes y = f16(sum + bias) (add: y = f16(f32(y) + sum + bias), the FUSE residual add, one rounding);
// a second sync keeps every block's partials alive until all are read.
template <int M, int NT>
__device__ __forceinline__ void v4_cluster_epilogue(const float (&a)[NT][4], int m, const V4Layer& E, int64_t cb,
                                                    int tx, float* part, bool add) {
  const int w = tx / 32, g = (tx % 32) / 4, t = tx % 4;
  __syncthreads();  // every warp is done with the staged x: its space takes the partials
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int r0 = 8 * j + 2 * t;
    if (r0 < m) {
      part[r0 * kV4Cols + w * 16 + g] = a[j][0];
      part[r0 * kV4Cols + w * 16 + g + 8] = a[j][2];
    }
    if (M > 1 && r0 + 1 < m) {
      part[(r0 + 1) * kV4Cols + w * 16 + g] = a[j][1];
      part[(r0 + 1) * kV4Cols + w * 16 + g + 8] = a[j][3];
    }
  }
  // (the sm_90 cluster intrinsics of crt/sm_90_rt.h: cooperative_groups' this_cluster() wraps the same ones)
  const int rank = int(__clusterRelativeBlockRank()), size = int(__clusterSizeInBlocks());
  __cluster_barrier_arrive();  // release: this block's partials ...
  __cluster_barrier_wait();    // ... and (acquire) every other block's are in shared memory
  for (int e = tx * size + rank; e < m * kV4Cols; e += kV4Threads * size) {
    const int r = e / kV4Cols;
    const int64_t col = cb * kV4Cols + e % kV4Cols;
    float sum = 0.f;
    for (int q = 0; q < size; ++q) sum += static_cast<const float*>(__cluster_map_shared_rank(part, unsigned(q)))[e];
    if (col < E.out) {
      __half* py = E.y + int64_t(r) * E.out + col;
      const float v = sum + (E.bias ? E.bias[col] : 0.f);
      *py = __float2half_rn(add ? __half2float(*py) + v : v);
    }
  }
  __cluster_barrier_arrive();  // the other blocks read this one's partials: keep them until every block is done
  __cluster_barrier_wait();
}
#endif

// Shared memory the cluster epilogue needs (bytes): the partials [M][kV4Cols] in fp32.
constexpr int v4_cluster_smem(int M) { return M * kV4Cols * 4; }

// FUSE: the V4Fuse prologue / epilogue (fz; ignored otherwise, so the FUSE = false kernels are as before).
// M = 32 (four n-tiles; option gemv_m32) asks for one block per SM: its 32 accumulators would spill at two.
template <int M, bool KC, bool L1P = false, bool FUSE = false>
__global__ void __launch_bounds__(kV4Threads, M > 16 ? 1 : (KC || M > 8) ? 2 : 3)
    exl2_gemv_v4_kernel(const __half* __restrict__ x, int64_t in, int m, const __grid_constant__ V4Group grp,
                        V4Knobs knobs, const __grid_constant__ V4Fuse fz) {
  constexpr int NT = v4_ntiles<M>();
  extern __shared__ float4 smem4[];
  __shared__ V4Runs R;
  const V4Block blk = v4_block(grp, int(blockIdx.x));
  const V4Layer& L = grp.l[blk.layer];  // read in place (kernel parameter space)
  const uint32_t* __restrict__ qw = L.qw;
  const int32_t* __restrict__ chunk_woff = L.chunk_woff;
  const int64_t tile_stride = L.tile_stride, out_pad = L.out_pad;
  const int c0 = blk.slice * L.cps, c1 = min(c0 + L.cps, L.n_chunks);
  if (threadIdx.x == 0) R = L.runs;
  const int nu = (c1 - c0) * 4;
  __half* xs = reinterpret_cast<__half*>(smem4);          // [nu][M][32]
  float* ks = reinterpret_cast<float*>(xs + nu * M * 32);  // KC: [nu][M] correction sums
  uint32_t* ms = reinterpret_cast<uint32_t*>(ks + (KC ? nu * M : 0));  // [nu] v4_msc of the slice's units

  // The warp's weights of the slice are one contiguous range of its tile: ask L2 for (up to prefetch_bytes of) it
  // now, so that the DRAM reads overlap the staging below and the loop's loads find them in L2. The cap keeps a
  // wave's prefetches (blocks x 8 warps x cap, ~25 MB on an H200 at 8 KB) inside L2 for layers as large as an
  // lm_head.
  if (knobs.prefetch_bytes > 0 || L1P) {
    const int64_t tile = int64_t(blk.cb) * kV4Warps + threadIdx.x / 32;
    if (tile * 16 < out_pad) {
      const int w0 = __ldg(chunk_woff + c0), w1 = __ldg(chunk_woff + c1);
      const uint32_t* base = qw + tile * tile_stride + w0;
      if constexpr (L1P) {  // the first kV4L1Ahead chunks (by the first run's stride) into L1
        const int wb = min(4 * (w1 - w0), 4 * (__ldg(chunk_woff + min(c0 + kV4L1Ahead, c1)) - w0));
        for (int o = 0; o < wb; o += 4096) v4_prefetch_l1(base + o / 4, threadIdx.x % 32, min(4096, wb - o));
      }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      if (threadIdx.x % 32 == 0 && knobs.prefetch_bytes > 0)
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(base),
                     "r"(min(4 * (w1 - w0), knobs.prefetch_bytes))
                     : "memory");
#else
      for (int i = (threadIdx.x % 32) * 32; i < min(w1 - w0, knobs.prefetch_bytes / 4); i += 32 * 32)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(base + i));
#endif
    }
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Programmatic dependent launch: everything above reads only the layer; x (and acc) may still be being written
  // by the previous kernel until this returns (a no-op when not launched as a dependent).
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  // x in packed-row order per unit (8 rows per thread), 0 for rows past a unit's end and rows >= m.
  const int32_t* __restrict__ xsrc = L.xsrc;
  [[maybe_unused]] const float* __restrict__ kcoef = L.kcoef;
  [[maybe_unused]] __shared__ float rinv[FUSE ? M : 1];
  if constexpr (FUSE) {
    if (fz.prologue == 1) v4_norm_rows<M>(x, in, m, fz, rinv);
  }
  for (int e = threadIdx.x; e < nu; e += kV4Threads) ms[e] = __ldg(L.msc + int64_t(c0) * 4 + e);
  for (int e = threadIdx.x; e < nu * M * 4; e += kV4Threads) {
    const int ul = e / (M * 4), n = (e / 4) % M, q = e % 4;
    const int4* src = reinterpret_cast<const int4*>(xsrc + (int64_t(c0) * 4 + ul) * 32 + 8 * q);
    const int4 i0 = __ldg(src), i1 = __ldg(src + 1);
    const int idx[8] = {i0.x, i0.y, i0.z, i0.w, i1.x, i1.y, i1.z, i1.w};
    const __half* xn = x + int64_t(n) * in;
    uint32_t v[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if constexpr (FUSE) {
        const float ri = fz.prologue == 1 && n < m ? rinv[n] : 0.f;
        const int64_t uo = int64_t(n) * in;
        const unsigned short lo = (n < m && idx[2 * j] >= 0) ? v4_fused_x(xn, idx[2 * j], uo, fz, ri) : 0;
        const unsigned short hi = (n < m && idx[2 * j + 1] >= 0) ? v4_fused_x(xn, idx[2 * j + 1], uo, fz, ri) : 0;
        v[j] = uint32_t(lo) | uint32_t(hi) << 16;
      } else {
        const unsigned short lo = (n < m && idx[2 * j] >= 0) ? __half_as_ushort(xn[idx[2 * j]]) : 0;
        const unsigned short hi = (n < m && idx[2 * j + 1] >= 0) ? __half_as_ushort(xn[idx[2 * j + 1]]) : 0;
        v[j] = uint32_t(lo) | uint32_t(hi) << 16;
      }
    }
    *reinterpret_cast<uint4*>(xs + (ul * M + n) * 32 + 8 * q) = make_uint4(v[0], v[1], v[2], v[3]);
    if constexpr (KC) {
      // sum over the unit's 32 rows of kcoef * x: 8 rows here, then the 4 lanes q = 0..3 (adjacent) add up.
      const float4* kc = reinterpret_cast<const float4*>(kcoef + (int64_t(c0) * 4 + ul) * 32 + 8 * q);
      const float4 k0 = __ldg(kc), k1 = __ldg(kc + 1);
      const float kk[8] = {k0.x, k0.y, k0.z, k0.w, k1.x, k1.y, k1.z, k1.w};
      float part = 0.f;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&v[j]));
        part = fmaf(kk[2 * j], f.x, part);
        part = fmaf(kk[2 * j + 1], f.y, part);
      }
      const unsigned mask = 0xFu << (threadIdx.x & 28);  // the 4 lanes of this unit row (all active together)
      part += __shfl_xor_sync(mask, part, 1);
      part += __shfl_xor_sync(mask, part, 2);
      if (q == 0) ks[ul * M + n] = part;
    }
  }
  __syncthreads();

  float a[NT][4] = {};
  if (int64_t(blk.cb * kV4Warps + int(threadIdx.x / 32)) * 16 < out_pad) {
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const uint32_t* qt = qw + int64_t(blk.cb * kV4Warps + int(threadIdx.x / 32)) * tile_stride;
    const __half* xl = xs + (g % M) * 32 + 8 * t;
    const float* kl = ks + (M == 1 ? 0 : (2 * t) % M);
    for (int r = 0; r < R.n; ++r) {
      const int rs = R.start[r], cs = max(c0, rs), ce = min(c1, R.start[r + 1]);
      if (cs >= ce) continue;
      const int bits = R.bits[r], rpc = R.rpc[r];
      const uint32_t* p = qt + R.woff[r] + (cs - rs) * v4_chunk_words(bits, rpc);
      const __half* xr = xl + (cs - c0) * 4 * M * 32;
      const float* kr = kl + (cs - c0) * 4 * M;
      const uint32_t* mr = ms + (cs - c0) * 4;
      const bool ah = knobs.ahead != 0;
      switch (bits) {
        case 2: v4_run<2, M, KC, L1P>(rpc, p, ce - cs, lane, xr, kr, mr, ah, a); break;
        case 3: v4_run<3, M, KC, L1P>(rpc, p, ce - cs, lane, xr, kr, mr, ah, a); break;
        case 4: v4_run<4, M, KC, L1P>(rpc, p, ce - cs, lane, xr, kr, mr, ah, a); break;
        case 5: v4_run<5, M, KC, L1P>(rpc, p, ce - cs, lane, xr, kr, mr, ah, a); break;
        case 6: v4_run<6, M, KC, L1P>(rpc, p, ce - cs, lane, xr, kr, mr, ah, a); break;
        case 8: v4_run<8, M, KC, L1P>(rpc, p, ce - cs, lane, xr, kr, mr, ah, a); break;
        default: break;
      }
    }
  }

  // The epilogue re-derives its block, layer and lane from the special registers (volatile reads the compiler
  // cannot merge with the prologue's) so that none of them stays live across the chunk loops: with them live the
  // m <= 8 kernels (80 registers) spilled.
  unsigned bx, tx;
  asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(bx));
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tx));
  const V4Block eb = v4_block(grp, int(bx));
  const V4Layer& E = grp.l[eb.layer];
  const int64_t tile = int64_t(eb.cb) * kV4Warps + tx / 32, e_out_pad = E.out_pad;
  const bool direct = E.slices == 1;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (grp.cluster > 1) {  // v4_plan_cluster: the cluster's slices add their partials through shared memory
    if (knobs.pdl) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    v4_cluster_epilogue<M, NT>(a, m, E, int64_t(eb.cb), int(tx), reinterpret_cast<float*>(smem4),
                               FUSE && fz.add != 0);
    return;
  }
#endif
  if (tile * 16 < e_out_pad) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    // A dependent launch of the next kernel (PDL) may begin its prologue now (it waits for this grid's end
    // before reading anything this grid writes).
    if (knobs.pdl) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    // n-tile j: c0/c2: columns g / g + 8 of row 8j + 2t of x; c1/c3: row 8j + 2t + 1.
    const int g = (tx % 32) / 4, t = tx % 4;
    const int64_t cg = tile * 16 + g, out = E.out;
    const float* __restrict__ bias = E.bias;
    __half* __restrict__ y = E.y;
    float* __restrict__ acc = E.acc;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const int r0 = 8 * j + 2 * t;
      if (direct) {  // the only slice: y = f16(sum + bias), no atomics, no counter
        for (int h = 0; h < (M > 1 ? 2 : 1); ++h) {
          if (r0 + h >= m) continue;
          const float s0 = h ? a[j][1] : a[j][0], s1 = h ? a[j][3] : a[j][2];
          if constexpr (FUSE) {  // fz.add: y = f16(f32(y) + result), one rounding
            __half* yr = y + int64_t(r0 + h) * out + cg;
            if (cg < out) {
              const float r = s0 + (bias ? bias[cg] : 0.f);
              yr[0] = __float2half_rn(fz.add ? __half2float(yr[0]) + r : r);
            }
            if (cg + 8 < out) {
              const float r = s1 + (bias ? bias[cg + 8] : 0.f);
              yr[8] = __float2half_rn(fz.add ? __half2float(yr[8]) + r : r);
            }
            continue;
          }
          if (cg < out) y[int64_t(r0 + h) * out + cg] = __float2half_rn(s0 + (bias ? bias[cg] : 0.f));
          if (cg + 8 < out) y[int64_t(r0 + h) * out + cg + 8] = __float2half_rn(s1 + (bias ? bias[cg + 8] : 0.f));
        }
        continue;
      }
      if (r0 < m) {
        atomicAdd(acc + int64_t(r0) * e_out_pad + cg, a[j][0]);
        atomicAdd(acc + int64_t(r0) * e_out_pad + cg + 8, a[j][2]);
      }
      if (M > 1 && r0 + 1 < m) {
        atomicAdd(acc + int64_t(r0 + 1) * e_out_pad + cg, a[j][1]);
        atomicAdd(acc + int64_t(r0 + 1) * e_out_pad + cg + 8, a[j][3]);
      }
    }
  }
  if (direct) return;

  unsigned* counter = E.counters + eb.cb;
  if (!split_k_last_of(counter, unsigned(E.slices))) return;
  split_k_drain_of<kV4Cols, kV4Threads>(E.acc, counter, m, int64_t(eb.cb) * kV4Cols, E.out, e_out_pad, E.bias, E.y,
                                        FUSE && fz.add != 0);
}

// Dequantizes output columns [c0, c0 + width) of the v4 layout into wp [in, width] (T: f16 or f32) in the ORIGINAL
// input order (row = xsrc of the unit row), so the GEMM needs no gather of x. grid (column blocks of kV4Threads /
// 2 columns, chunks); one thread per column of the chunk (v4_dequant_col), c0 % 16 == 0.
template <typename T>
__global__ void __launch_bounds__(128)
    exl2_v4_dequant_kernel(const uint32_t* __restrict__ qw, int64_t tile_stride,
                           const int32_t* __restrict__ chunk_woff, const int32_t* __restrict__ xsrc,
                           const uint32_t* __restrict__ msc, V4Runs runs, int64_t c0, int64_t width,
                           T* __restrict__ wp) {
  __shared__ int32_t feat[128];
  const int chunk = blockIdx.y;
  feat[threadIdx.x] = __ldg(xsrc + int64_t(chunk) * 128 + threadIdx.x);
  __syncthreads();
  const int64_t lc = int64_t(blockIdx.x) * 128 + threadIdx.x;
  if (lc >= width) return;
  const int64_t col = c0 + lc;
  int r = 0;
  while (r + 1 < runs.n && chunk >= runs.start[r + 1]) ++r;
  const uint32_t* p = qw + (col / 16) * tile_stride + __ldg(chunk_woff + chunk);
  struct Store {
    const int32_t* feat;
    T* dst;
    int64_t ld;
    __device__ void operator()(int u, int row, uint32_t bits) {
      const int f = feat[u * 32 + row];
      if (f < 0) return;
      if constexpr (std::is_same<T, float>::value)
        dst[int64_t(f) * ld] = __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
      else
        dst[int64_t(f) * ld] = __ushort_as_half(static_cast<unsigned short>(bits));
    }
  } st{feat, wp + lc, width};
  v4_dequant_col_any(runs.bits[r], p, runs.rpc[r], msc + int64_t(chunk) * 4, int(col % 16), st);
}

#endif  // __CUDACC__

}  // namespace exl2::cuda::exl2k
