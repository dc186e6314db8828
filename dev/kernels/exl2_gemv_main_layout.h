// The main tiled EXL2 layout's host tables and repack (variants 01 and 02: exl2_gemv_01_main_cuda_core.cuh,
// exl2_gemv_02_main_tc.cuh), out of the product since the v4 layout won its measurement (exl2_gemv_notes.md,
// session 4: main 286 tok/s against v4 328 on the H200). Kept for dev/kernels/exl2_decode_check.cu.
//
// Layout: units (32 packed rows of one group, cuda::exl2_unit_table) are ordered by bit width (first appearance),
// each width's units in file order, and cut into QUADS of 4 units of that width (the last quad of a width padded
// with empty slots). Slot s = 4 * quad + j. q_weight becomes [out_pad / 8 tiles][tile_stride words]: inside a tile,
// unit slot s occupies 8 * bits words from woff(s) on (the sum of 8 * bits over the slots before it): column c
// (0..7) of the tile has the unit's `bits` words (ExLlamaV2's word i = q_weight row qrow + i) at
// woff + c * bits + i, zero past the unit's nwords. Empty slots store nothing.
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>
#include <vector>

#include "cuda/exl2_decode.cuh"
#include "cuda/exl2_gemm.h"
#include "cuda/exl2_gemv_v4.cuh"

namespace exl2::cuda {

struct Exl2TcTables {
  std::vector<int32_t> slots;  // [n_quads * 4][4]: unit_info entries (nwords 0); nvals 0: empty slot
  std::vector<int32_t> xsrc;   // [n_quads * 128]: input feature feeding each mma k slot (-1: none)
  std::vector<int32_t> units;  // [n_units][4]: exl2_unit_table with qrow replaced by woff (CUDA-core kernel)
  std::vector<int32_t> qmap;   // [qrows][2]: ExLlamaV2 q_weight row r -> {woff of its unit + word index, bits}
  int64_t tile_stride = 0;     // words per tile of 8 columns
  int64_t n_quads = 0;
  int max_bits = 0;
};

namespace main_layout {
// Bit widths of a unit table (exl2_unit_table) in order of first appearance.
inline std::vector<int> unit_widths(const std::vector<int32_t>& units) {
  std::vector<int> widths;
  for (size_t u = 0; u + 3 < units.size(); u += 4) {
    const int b = units[u + 3] & 0xff;
    if (std::find(widths.begin(), widths.end(), b) == widths.end()) widths.push_back(b);
  }
  return widths;
}
}  // namespace main_layout

inline Exl2TcTables exl2_tc_tables(const quant::Exl2Layout& layout) {
  const std::vector<int32_t> units = exl2_unit_table(layout);
  const int64_t n_units = static_cast<int64_t>(units.size() / 4);
  const std::vector<int> widths = main_layout::unit_widths(units);
  Exl2TcTables t;
  int64_t qrows = 0;
  for (const quant::Exl2Group& gr : layout.groups) qrows = std::max<int64_t>(qrows, gr.qrow_start + gr.qrows);
  t.qmap.assign(size_t(2 * qrows), 0);
  int64_t woff = 0;
  for (int b : widths) {
    t.max_bits = std::max(t.max_bits, b);
    int64_t n = 0;
    for (int64_t u = 0; u < n_units; ++u) {
      const int32_t* e = &units[size_t(4 * u)];
      if ((e[3] & 0xff) != b) continue;
      const int nvals = (e[3] >> 8) & 0xff, nwords = e[3] >> 16;
      EXL2_CHECK(woff + 8 * b <= INT_MAX, "EXL2 tiled layout: tile of ", woff + 8 * b, " words exceeds int range");
      t.slots.insert(t.slots.end(), {static_cast<int32_t>(woff), e[1], e[2], b | (nvals << 8)});
      for (int i = 0; i < nwords; ++i) {
        t.qmap[size_t(2 * (e[0] + i))] = static_cast<int32_t>(woff + i);
        t.qmap[size_t(2 * (e[0] + i) + 1)] = b;
      }
      woff += 8 * b;
      ++n;
    }
    for (; n % 4 != 0; ++n) t.slots.insert(t.slots.end(), {0, 0, 0, b});  // empty slots of this width
  }
  t.tile_stride = woff;
  // The CUDA-core kernel's table: the units in file order, qrow replaced by woff.
  t.units = units;
  for (int64_t u = 0; u < n_units; ++u) t.units[size_t(4 * u)] = t.qmap[size_t(2 * units[size_t(4 * u)])];
  t.n_quads = static_cast<int64_t>(t.slots.size() / 16);
  t.xsrc.assign(size_t(t.n_quads * 128), -1);
  for (int64_t q = 0; q < t.n_quads; ++q) {
    for (int j = 0; j < 4; ++j) {
      const int32_t* e = &t.slots[size_t(4 * (4 * q + j))];
      const int bits = e[3] & 0xff, nvals = (e[3] >> 8) & 0xff;
      for (int P = 0; P < 16; ++P) {
        int ra = 0, rb = 0;
        exl2k::pair_rows(bits, P, ra, rb);
        const int64_t base = q * 128 + (P / 2) * 16 + j * 4 + (P % 2) * 2;
        if (ra < nvals) t.xsrc[size_t(base)] = layout.perm[size_t(e[1] + ra)];
        if (rb < nvals) t.xsrc[size_t(base + 1)] = layout.perm[size_t(e[1] + rb)];
      }
    }
  }
  return t;
}

inline std::vector<uint32_t> exl2_tc_repack_host(const Exl2TcTables& t, const uint32_t* q_weight, int64_t qrows,
                                          int64_t out_pad) {
  EXL2_CHECK(out_pad % 8 == 0 && int64_t(t.qmap.size()) == 2 * qrows, "exl2_tc_repack_host: tables do not match");
  std::vector<uint32_t> dst(size_t(out_pad / 8 * t.tile_stride), 0u);
  for (int64_t r = 0; r < qrows; ++r)
    for (int64_t col = 0; col < out_pad; ++col)
      dst[size_t((col / 8) * t.tile_stride + t.qmap[size_t(2 * r)] + (col % 8) * t.qmap[size_t(2 * r + 1)])] =
          q_weight[size_t(r * out_pad + col)];
  return dst;
}

// The v4k variant's correction coefficients (2^(10-o) + z of each row, [n_chunks * 4 * 32], 0: none): the raw
// decode of zero words gives 2^(10-o) per output. v4k lost to v4 (session 4: 326.9 against 328.4 tok/s).
inline std::vector<float> exl2_v4k_kcoef(const Exl2V4Tables& t) {
  std::vector<float> kcoef;
  kcoef.assign(t.xsrc.size(), 0.f);
  for (size_t r = 0; r < t.run_bits.size(); ++r) {
    const int b = t.run_bits[r];
    uint32_t zero[8] = {};
    uint32_t h[16];
    exl2k::v4_decode_any(b, zero, h, false);
    for (int32_t s = 4 * t.run_start[r]; s < 4 * t.run_start[r + 1]; ++s)
      for (int row = 0; row < 32; ++row) {
        if (t.xsrc[size_t(s * 32 + row)] < 0) continue;
        const int q = 4 * (s % 4) + (row % 8) / 2;
        const __half2 v = exl2k::as_half2(h[q]);
        kcoef[size_t(s * 32 + row)] = __half2float(row % 2 ? __high2half(v) : __low2half(v)) + float(1 << (b - 1));
      }
  }
  return kcoef;
}

}  // namespace exl2::cuda
