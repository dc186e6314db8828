// Host-side check (no GPU needed) of the EXL2 CUDA kernels' tiled layout (exl2_tc_tables, exl2_tc_repack_host)
// and decoding (cuda/exl2_decode.cuh, unit_info) against quant::dequantize_into, on random layers of every bit
// width, mixed widths, partial and ragged groups, and padded columns. It runs the kernels' per-lane code
// (unit_info, col_scale, decode_col_any) on the CPU for every (slot, column):
//   - the dequantized weights must equal the CPU reference bit for bit;
//   - the tensor-core GEMV's fragment bookkeeping (x staged through xsrc, A/B fragments per lane as the PTX
//     mma.m16n8k16 layout places them) must match a float64 reference for 1, 5 and 16 rows of x;
//   - the v4 layout: the kernel's group scales (the file's 4-bit codes in the weight stream, v4_code_scale with the
//     per-unit maxima v4_msc) equal the reference's f16 scales bit for bit, and four deliberately wrong code /
//     maximum mappings are each caught; every weight decoded and scaled, and the prefill dequantization
//     (v4_dequant_col), equal the reference; the kernel's bookkeeping (RPC 1, 2, 4 scale rows per chunk) matches a
//     float64 reference;
//   - the grouped v4 launch's grid (v4_plan, v4_block) must cover every (layer, column block, k slice) once.
// Build and run (after scripts/dev_build.sh cuda):
//   dev/kernels/exl2_decode_check.sh
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda/exl2_decode.cuh"
#include "dev/kernels/exl2_gemv_02_main_tc.cuh"
#include "dev/kernels/exl2_gemv_main_layout.h"
#include "cuda/exl2_gemv_v4.cuh"
#include "cuda/exl2_gemm.h"
#include "quant/exl2_format.h"

using namespace exl2;
using namespace exl2::cuda::exl2k;

namespace {

struct Case {
  int64_t in, out;
  std::vector<int> bits;
  std::vector<int64_t> rows;
};

// Collects the 16 pairs of one column of a unit in call order (pair P = call P).
struct PairCollect {
  uint32_t v[16];
  int a[16], b[16];
  int n = 0;
  void operator()(int ra, int rb, uint32_t bits) {
    a[n] = ra;
    b[n] = rb;
    v[n++] = bits;
  }
};

float lo_f(uint32_t u) { return f16_to_f32(uint16_t(u & 0xffff)); }
float hi_f(uint32_t u) { return f16_to_f32(uint16_t(u >> 16)); }

// One column of slot s through the kernels' code: words from the tiled layout, the column's scale, 16 pairs.
PairCollect decode_slot_col(const cuda::Exl2TcTables& T, const std::vector<uint32_t>& tiled, const quant::Exl2Layout& L,
                            const std::vector<int32_t>& qs, const std::vector<uint16_t>& msc, int s, int64_t col) {
  const UnitInfo U = unit_info(reinterpret_cast<const int4*>(T.slots.data()), s);
  uint32_t w[8] = {};
  const uint32_t* p = tiled.data() + (col / 8) * T.tile_stride + U.woff + (col % 8) * U.bits;
  for (int i = 0; i < U.bits; ++i) w[i] = p[i];
  const __half2 s2 = col_scale(uint32_t(qs[size_t(U.group * (L.out_pad / 8) + col / 8)]), int(col % 8),
                               reinterpret_cast<const __half*>(msc.data())[U.group]);
  PairCollect c;
  decode_col_any(U.bits, w, s2, c);
  return c;
}

// rel L2 of y [M, out_pad] (the emulated kernel) against x [M, in] @ W (f16 bits [in, out]) in double.
double rel_l2_vs_dense(int M, const quant::Exl2Layout& L, const std::vector<float>& x, const std::vector<uint16_t>& W,
                       const std::vector<double>& y) {
  double num = 0, den = 0;
  for (int i = 0; i < M; ++i)
    for (int64_t n = 0; n < L.out; ++n) {
      double ref = 0;
      for (int64_t k = 0; k < L.in; ++k) ref += double(x[size_t(i * L.in + k)]) * f16_to_f32(W[size_t(k * L.out + n)]);
      const double d = y[size_t(i * L.out_pad + n)] - ref;
      num += d * d;
      den += ref * ref;
    }
  return std::sqrt(num / (den > 0 ? den : 1));
}

// The tensor-core GEMV's fragment bookkeeping, emulated: x staged through xsrc in consumption order, and per mma
// step T the 16x16 A / 16x8 B fragments assembled from what each lane (g, j) holds, as the PTX fragment layout
// of mma.m16n8k16 places them; C = A B summed in double. M rows of x (<= 16).
double tc_gemv_check(int M, const quant::Exl2Layout& L, const cuda::Exl2TcTables& T, const std::vector<uint32_t>& tiled,
                     const std::vector<int32_t>& qs, const std::vector<uint16_t>& msc, const std::vector<uint16_t>& W,
                     std::mt19937& rng) {
  std::uniform_real_distribution<float> ux(-3.f, 3.f);
  std::vector<float> x(size_t(M * L.in));
  for (auto& v : x) v = f16_to_f32(f32_to_f16(ux(rng)));
  const int64_t K = T.n_quads * 128;
  std::vector<float> xs(size_t(M * K));
  for (int i = 0; i < M; ++i)
    for (int64_t e = 0; e < K; ++e) xs[size_t(i * K + e)] = T.xsrc[size_t(e)] >= 0 ? x[size_t(i * L.in + T.xsrc[size_t(e)])] : 0.f;
  std::vector<double> y(size_t(M * L.out_pad), 0.0);
  for (int64_t tile = 0; tile < L.out_pad / 8; ++tile) {
    for (int64_t q = 0; q < T.n_quads; ++q) {
      PairCollect pc[8][4];
      for (int g = 0; g < 8; ++g)
        for (int j = 0; j < 4; ++j) pc[g][j] = decode_slot_col(T, tiled, L, qs, msc, int(4 * q + j), tile * 8 + g);
      for (int t = 0; t < 8; ++t) {
        double A[16][16] = {}, B[16][8] = {};
        for (int g = 0; g < 8; ++g) {
          for (int j = 0; j < 4; ++j) {
            const uint32_t b0 = pc[g][j].v[2 * t], b1 = pc[g][j].v[2 * t + 1];
            B[2 * j][g] = lo_f(b0), B[2 * j + 1][g] = hi_f(b0), B[2 * j + 8][g] = lo_f(b1), B[2 * j + 9][g] = hi_f(b1);
            for (int r : {g, g + 8}) {
              if (r >= M) continue;
              const float* xr = &xs[size_t(r * K + q * 128 + t * 16 + j * 4)];
              A[r][2 * j] = xr[0], A[r][2 * j + 1] = xr[1], A[r][2 * j + 8] = xr[2], A[r][2 * j + 9] = xr[3];
            }
          }
        }
        for (int r = 0; r < M; ++r)
          for (int n = 0; n < 8; ++n)
            for (int k = 0; k < 16; ++k) y[size_t(r * L.out_pad + tile * 8 + n)] += A[r][k] * B[k][n];
      }
    }
  }
  return rel_l2_vs_dense(M, L, x, W, y);
}

// ---- the v4 GEMV (cuda/exl2_gemv_v4.cuh) --------------------------------------------------------------------------

// Words of lane (c16, t) of chunk `chunk` of tile `tile` in the v4 layout.
void v4_lane_words(const cuda::Exl2V4Tables& T, const std::vector<uint32_t>& lay, int64_t tile, int chunk, int c16,
                   int t, uint32_t (&w)[8], int& bits) {
  size_t r = 0;
  while (r + 1 < T.run_bits.size() && chunk >= T.run_start[r + 1]) ++r;
  bits = T.run_bits[r];
  const int64_t base =
      tile * T.tile_stride + T.run_woff[r] + int64_t(chunk - T.run_start[r]) * v4_chunk_words(bits, T.run_rpc[r]);
  for (int i = 0; i < 8; ++i) w[i] = i < bits ? lay[size_t(base + v4_word_offset(bits, c16, t, i))] : 0u;
}

// The code word lane row g (0..7) of chunk `chunk` of tile `tile` loads, in the kernel's form (v4_load: RPC 4 one
// word, RPC 1, 2 16 bits spread by v4_code_spread), and the chunk's scale rows.
uint32_t v4_lane_codes(const cuda::Exl2V4Tables& T, const std::vector<uint32_t>& lay, int64_t tile, int chunk, int g,
                       int& rpc) {
  size_t r = 0;
  while (r + 1 < T.run_bits.size() && chunk >= T.run_start[r + 1]) ++r;
  rpc = T.run_rpc[r];
  const size_t base = size_t(tile * T.tile_stride + T.chunk_woff[size_t(chunk)] + 64 * T.run_bits[r]);
  if (rpc == 4) return lay[base + size_t(g)];
  return v4_code_spread((lay[base + size_t(g / 2)] >> (16 * (g % 2))) & 0xffffu);
}

// Scale of column c16 of the tile for unit u of chunk `chunk`, f16 bits, as the kernel computes it: the lane's codes,
// the unit's scale row j = u * rpc / 4, the staged v4_msc of the row's first unit, v4_code_scale.
uint16_t v4_kernel_scale(const cuda::Exl2V4Tables& T, const std::vector<uint32_t>& lay,
                         const std::vector<int32_t>& umsc, int64_t tile, int chunk, int u, int c16) {
  int rpc = 0;
  const uint32_t cw = v4_lane_codes(T, lay, tile, chunk, c16 % 8, rpc);
  const int j = u * rpc / 4;
  const uint32_t s = h2_bits(v4_code_scale_rt(cw, j, uint32_t(umsc[size_t(4 * chunk + 4 * j / rpc)])));
  return uint16_t(c16 < 8 ? s & 0xffffu : s >> 16);
}

// The reference's scale f16((nib + 1)^2 * msc) of (group, column) (quant/exl2_format.cpp's arithmetic: the f32
// product is exact, one rounding).
uint16_t ref_scale(const std::vector<int32_t>& qs, const std::vector<uint16_t>& msc, int64_t out_pad, int grp,
                   int64_t col) {
  const uint32_t nib = (uint32_t(qs[size_t(grp * (out_pad / 8) + col / 8)]) >> (4 * (col % 8))) & 15u;
  return f32_to_f16(float((nib + 1) * (nib + 1)) * f16_to_f32(msc[size_t(grp)]));
}

// Every (tile, chunk, non-empty unit, column < out): the kernel's scale (v4_kernel_scale) against ref_scale, bit
// for bit. Returns the mismatches (printing the first few unless quiet).
int64_t v4_scale_mismatches(const quant::Exl2Layout& L, const cuda::Exl2V4Tables& T, const std::vector<uint32_t>& lay,
                            const std::vector<int32_t>& umsc, const std::vector<int32_t>& qs,
                            const std::vector<uint16_t>& msc, bool quiet) {
  int64_t bad = 0;
  for (int64_t tile = 0; tile < L.out_pad / 16; ++tile)
    for (int c = 0; c < int(T.n_chunks); ++c)
      for (int u = 0; u < 4; ++u) {
        const int grp = T.ugroup[size_t(4 * c + u)];
        if (grp < 0) continue;
        for (int c16 = 0; c16 < 16; ++c16) {
          const int64_t col = tile * 16 + c16;
          if (col >= L.out) continue;
          const uint16_t got = v4_kernel_scale(T, lay, umsc, tile, c, u, c16);
          const uint16_t want = ref_scale(qs, msc, L.out_pad, grp, col);
          if (got != want) {
            if (!quiet && bad < 5)
              std::printf("  v4 scale mismatch chunk=%d unit=%d col=%lld: got %04x want %04x\n", c, u, (long long)col,
                          got, want);
            ++bad;
          }
        }
      }
  return bad;
}

// Deliberately wrong scale mappings must fail v4_scale_mismatches: codes of columns g and g + 8 swapped, scale rows
// rotated (RPC 2, 4), the maxima of the next chunk, codes off by one. mutant_hits[i] counts mismatches of mutant i.
int64_t mutant_hits[4] = {};
void v4_mutants(const quant::Exl2Layout& L, const cuda::Exl2V4Tables& T, const std::vector<uint32_t>& lay,
                const std::vector<int32_t>& umsc, const std::vector<int32_t>& qs, const std::vector<uint16_t>& msc) {
  for (int mut = 0; mut < 4; ++mut) {
    std::vector<uint32_t> bad_lay = lay;
    std::vector<int32_t> bad_msc = umsc;
    for (int64_t tile = 0; tile < L.out_pad / 16; ++tile)
      for (int c = 0; c < int(T.n_chunks); ++c) {
        size_t r = 0;
        while (r + 1 < T.run_bits.size() && c >= T.run_start[r + 1]) ++r;
        const int rpc = T.run_rpc[r];
        uint32_t* cw = bad_lay.data() + tile * T.tile_stride + T.chunk_woff[size_t(c)] + 64 * T.run_bits[r];
        for (int i = 0; i < v4_code_words(rpc); ++i) {
          uint32_t& w = cw[i];
          if (mut == 0) w = rpc == 4 ? (w >> 16 | w << 16) : ((w & 0x00ff00ffu) << 8 | (w >> 8 & 0x00ff00ffu));
          if (mut == 1 && rpc == 4) w = ((w & 0x0fff0fffu) << 4) | ((w >> 12) & 0x000f000fu);
          if (mut == 1 && rpc == 2) w = ((w & 0x0f0f0f0fu) << 4) | ((w >> 4) & 0x0f0f0f0fu);
          if (mut == 3) w ^= rpc == 1 ? 0x01010101u : 0x11111111u;
        }
      }
    if (mut == 2)
      for (size_t e = 0; e < umsc.size(); ++e) bad_msc[e] = umsc[(e + 4) % umsc.size()];
    mutant_hits[mut] += v4_scale_mismatches(L, T, bad_lay, bad_msc, qs, msc, true);
  }
}

// (a) Every weight decoded from the v4 layout, times its scale from the kernel's table (stab), rounded to f16, equals
// the reference bit for bit. (b) The kernel's bookkeeping emulated for M rows of x and slices of `cps` chunks: x and
// scale rows staged as the kernel stages them, per lane the A/B registers as the kernel passes them to
// mma.m16n8k16 (placed by the PTX fragment layout), C per unit/chunk times the staged scale, the epilogue's
// (row, column) of each accumulator; kc: the correction variant (raw weights, C starts at minus the staged
// sum kcoef * x of its unit(s)). Returns rel err vs float64 (or -1 on a weight mismatch).
double v4_check(int m, int cps, bool kc, const quant::Exl2Layout& L, const std::vector<uint32_t>& qw, int64_t qrows,
                const std::vector<int32_t>& qs, const std::vector<uint16_t>& msc, const std::vector<uint16_t>& W,
                std::mt19937& rng) {
  const cuda::Exl2V4Tables T = cuda::exl2_v4_tables(L);
  const std::vector<uint32_t> lay =
      cuda::exl2_v4_repack_host(T, qw.data(), qrows, L.out_pad, reinterpret_cast<const uint32_t*>(qs.data()));
  const std::vector<int32_t> umsc = cuda::exl2_v4_unit_msc(T, msc);
  const std::vector<float> kcoef = cuda::exl2_v4k_kcoef(T);
  // (a0) the kernel's scales from the 4-bit codes and the staged maxima, bit for bit; the first call of a layer
  // also runs the deliberately wrong mappings.
  if (const int64_t sb = v4_scale_mismatches(L, T, lay, umsc, qs, msc, false)) {
    std::printf("  v4: %lld scale mismatches\n", (long long)sb);
    return -1;
  }
  if (m == 1 && !kc) v4_mutants(L, T, lay, umsc, qs, msc);
  // (a)
  int64_t bad = 0, seen = 0;
  for (int64_t tile = 0; tile < L.out_pad / 16; ++tile)
    for (int c = 0; c < int(T.n_chunks); ++c)
      for (int c16 = 0; c16 < 16; ++c16)
        for (int t = 0; t < 4; ++t) {
          uint32_t w[8];
          int bits = 0;
          v4_lane_words(T, lay, tile, c, c16, t, w, bits);
          uint32_t h[16];
          v4_decode_any(bits, w, h);
          const int64_t col = tile * 16 + c16;
          for (int q = 0; q < 16; ++q)
            for (int hh = 0; hh < 2; ++hh) {
              const int slot = 4 * c + q / 4, row = 8 * t + 2 * (q % 4) + hh;
              const int feat = T.xsrc[size_t(slot * 32 + row)];
              if (feat < 0 || col >= L.out) continue;
              const float qz = hh ? hi_f(h[q]) : lo_f(h[q]);
              const uint16_t got = f32_to_f16(qz * f16_to_f32(v4_kernel_scale(T, lay, umsc, tile, c, q / 4, c16)));
              ++seen;
              if (got != W[size_t(feat * L.out + col)]) {
                if (bad < 5)
                  std::printf("  v4 mismatch feat=%d col=%lld bits=%d: got %04x want %04x\n", feat, (long long)col, bits,
                              got, W[size_t(feat * L.out + col)]);
                ++bad;
              }
            }
        }
  if (bad || seen != L.in * L.out) {
    std::printf("  v4: %lld bad of %lld (expected %lld weights)\n", (long long)bad, (long long)seen,
                (long long)(L.in * L.out));
    return -1;
  }
  // (a2) The prefill path's dequantization (exl2_v4_dequant_kernel: v4_dequant_col per (tile, chunk, column), rows
  // through xsrc in the original input order) writes every weight exactly once, bit-exact.
  {
    std::vector<uint16_t> Wd(size_t(L.in * L.out_pad), 0);
    std::vector<uint8_t> hits(size_t(L.in * L.out_pad), 0);
    for (int64_t tile = 0; tile < L.out_pad / 16; ++tile)
      for (int c = 0; c < int(T.n_chunks); ++c) {
        size_t r = 0;
        while (r + 1 < T.run_bits.size() && c >= T.run_start[r + 1]) ++r;
        const uint32_t* p = lay.data() + tile * T.tile_stride + T.chunk_woff[size_t(c)];
        for (int c16 = 0; c16 < 16; ++c16) {
          const int64_t col = tile * 16 + c16;
          auto st = [&](int u, int row, uint32_t bits) {
            const int f = T.xsrc[size_t((4 * c + u) * 32 + row)];
            if (f < 0) return;
            Wd[size_t(f * L.out_pad + col)] = uint16_t(bits);
            ++hits[size_t(f * L.out_pad + col)];
          };
          v4_dequant_col_any(T.run_bits[r], p, T.run_rpc[r], reinterpret_cast<const uint32_t*>(umsc.data()) + 4 * c,
                             c16, st);
        }
      }
    int64_t dbad = 0;
    for (int64_t k = 0; k < L.in; ++k)
      for (int64_t n = 0; n < L.out_pad; ++n) {
        const size_t e = size_t(k * L.out_pad + n);
        if (hits[e] != 1 || (n < L.out && Wd[e] != W[size_t(k * L.out + n)])) {
          if (dbad < 5)
            std::printf("  v4 dequant mismatch k=%lld n=%lld: got %04x (%d writes) want %04x\n", (long long)k,
                        (long long)n, Wd[e], hits[e], n < L.out ? W[size_t(k * L.out + n)] : 0);
          ++dbad;
        }
      }
    if (dbad) {
      std::printf("  v4 dequant: %lld bad\n", (long long)dbad);
      return -1;
    }
  }
  // (b) the launcher's kernel M for m rows (launch_gemv_v4_m): rows m..M-1 of the staged x are zero; M 16 / 32:
  // two / four mma n-tiles (rows 8j + g of x; v4_ntiles).
  const int M = m == 1 ? 1 : m == 2 ? 2 : m <= 4 ? 4 : m <= 8 ? 8 : m <= 16 ? 16 : 32, NT = M > 8 ? M / 8 : 1;
  std::uniform_real_distribution<float> ux(-3.f, 3.f);
  std::vector<float> x(size_t(M * L.in), 0.f);
  for (int64_t e = 0; e < m * L.in; ++e) x[size_t(e)] = f16_to_f32(f32_to_f16(ux(rng)));
  std::vector<double> y(size_t(M * L.out_pad), 0.0);
  const int n_chunks = int(T.n_chunks);
  for (int c0 = 0; c0 < n_chunks; c0 += cps) {
    const int c1 = std::min(c0 + cps, n_chunks), nu = (c1 - c0) * 4;
    std::vector<float> xs(size_t(nu * M * 32));
    for (int ul = 0; ul < nu; ++ul)
      for (int n = 0; n < M; ++n)
        for (int r = 0; r < 32; ++r) {
          const int f = T.xsrc[size_t((c0 * 4 + ul) * 32 + r)];
          xs[size_t((ul * M + n) * 32 + r)] = f >= 0 ? x[size_t(n * L.in + f)] : 0.f;
        }
    for (int64_t cb = 0; cb < (L.out_pad + kV4Cols - 1) / kV4Cols; ++cb) {
      for (int warp = 0; warp < kV4Warps; ++warp) {
        const int64_t tile = cb * kV4Warps + warp;
        if (tile * 16 >= L.out_pad) continue;
        double acc[32][4][4] = {};
        for (size_t r = 0; r < T.run_bits.size(); ++r) {
          const int rs = T.run_start[r], cs = std::max(c0, rs), ce = std::min(c1, T.run_start[r + 1]);
          const int rpc = T.run_rpc[r];
          for (int c = cs; c < ce; ++c) {
            uint32_t hl[32][16];
            uint32_t hh8[32][16];
            for (int lane = 0; lane < 32; ++lane) {
              uint32_t w[8];
              int bits = 0;
              v4_lane_words(T, lay, tile, c, lane / 4, lane % 4, w, bits);
              v4_decode_any(bits, w, hl[lane], !kc);
              v4_lane_words(T, lay, tile, c, lane / 4 + 8, lane % 4, w, bits);
              v4_decode_any(bits, w, hh8[lane], !kc);
            }
            // the lanes' scale codes (v4_load), the chunk's staged maxima ms[4] (kernel: ms[ul], staged with x)
            uint32_t cws[8];
            for (int g = 0; g < 8; ++g) {
              int rr = 0;
              cws[g] = v4_lane_codes(T, lay, tile, c, g, rr);
            }
            const int32_t* ms = umsc.data() + 4 * c;
            double C[4][16][8] = {};
            // the correction sums of the chunk's units per row n of x (kernel: ks[ul][n], staged with x)
            double K[4][32] = {};
            for (int u = 0; u < 4 && kc; ++u)
              for (int n = 0; n < M; ++n)
                for (int r = 0; r < 32; ++r)
                  K[u][n] += double(kcoef[size_t((4 * c + u) * 32 + r)]) *
                             xs[size_t((((c - c0) * 4 + u) * M + n) * 32 + r)];
            // n-tile j, column n of C: row 8j + n of x (M <= 8: n % M, the duplicated rows)
            auto cinit = [&](int u0, int nu1) {
              for (int j = 0; j < NT; ++j)
                for (int i = 0; i < 16; ++i)
                  for (int n = 0; n < 8; ++n) {
                    C[j][i][n] = 0;
                    for (int u = u0; u < u0 + nu1; ++u) C[j][i][n] -= K[u][M > 8 ? 8 * j + n : n % M];
                  }
            };
            if (rpc == 1) cinit(0, 4);
            for (int u = 0; u < 4; ++u) {
              if (rpc == 4) cinit(u, 1);
              if (rpc == 2 && u % 2 == 0) cinit(u, 2);
              for (int st = 0; st < 2; ++st)
              for (int j = 0; j < NT; ++j) {
                double A[16][16] = {}, B[16][8] = {};
                for (int lane = 0; lane < 32; ++lane) {
                  const int g = lane / 4, t = lane % 4;
                  const uint32_t a[4] = {hl[lane][4 * u + 2 * st], hh8[lane][4 * u + 2 * st], hl[lane][4 * u + 2 * st + 1],
                                         hh8[lane][4 * u + 2 * st + 1]};
                  A[g][2 * t] = lo_f(a[0]), A[g][2 * t + 1] = hi_f(a[0]);
                  A[g + 8][2 * t] = lo_f(a[1]), A[g + 8][2 * t + 1] = hi_f(a[1]);
                  A[g][2 * t + 8] = lo_f(a[2]), A[g][2 * t + 9] = hi_f(a[2]);
                  A[g + 8][2 * t + 8] = lo_f(a[3]), A[g + 8][2 * t + 9] = hi_f(a[3]);
                  const float* xl = &xs[size_t((((c - c0) * 4 + u) * M + g % M + 8 * j) * 32 + 8 * t + 4 * st)];
                  B[2 * t][g] = xl[0], B[2 * t + 1][g] = xl[1], B[2 * t + 8][g] = xl[2], B[2 * t + 9][g] = xl[3];
                }
                for (int i = 0; i < 16; ++i)
                  for (int n = 0; n < 8; ++n)
                    for (int k = 0; k < 16; ++k) C[j][i][n] += A[i][k] * B[k][n];
              }
              if (rpc == 4 || u == 3 || (rpc == 2 && u == 1)) {  // v4_unit / v4_chunk: the row's v4_scale
                const int row = u * rpc / 4;
                for (int lane = 0; lane < 32; ++lane) {
                  const int g = lane / 4, t = lane % 4;
                  const uint32_t sw = h2_bits(v4_code_scale_rt(cws[g], row, uint32_t(ms[4 * row / rpc])));
                  const float sp[2] = {lo_f(sw), hi_f(sw)};
                  for (int j = 0; j < NT; ++j) {
                    acc[lane][j][0] += C[j][g][2 * t] * sp[0];
                    acc[lane][j][2] += C[j][g + 8][2 * t] * sp[1];
                    acc[lane][j][1] += C[j][g][2 * t + 1] * sp[0];
                    acc[lane][j][3] += C[j][g + 8][2 * t + 1] * sp[1];
                  }
                }
              }
            }
          }
        }
        for (int lane = 0; lane < 32; ++lane) {
          const int g = lane / 4, t = lane % 4;
          const int64_t cg = tile * 16 + g;
          for (int j = 0; j < NT; ++j) {
            const int r0 = 8 * j + 2 * t;
            if (r0 < m) y[size_t(r0 * L.out_pad + cg)] += acc[lane][j][0], y[size_t(r0 * L.out_pad + cg + 8)] += acc[lane][j][2];
            if (M > 1 && r0 + 1 < m)
              y[size_t((r0 + 1) * L.out_pad + cg)] += acc[lane][j][1],
                  y[size_t((r0 + 1) * L.out_pad + cg + 8)] += acc[lane][j][3];
          }
        }
      }
    }
  }
  return rel_l2_vs_dense(m, L, x, W, y);
}

bool run_case(const Case& cs, std::mt19937& rng) {
  const int G = int(cs.bits.size());
  std::vector<uint8_t> codes(size_t(cs.in * cs.out));
  int64_t row = 0;
  for (int g = 0; g < G; ++g) {
    std::uniform_int_distribution<int> uc(0, (1 << cs.bits[g]) - 1);
    for (int64_t r = 0; r < cs.rows[g]; ++r, ++row)
      for (int64_t n = 0; n < cs.out; ++n) codes[size_t(row * cs.out + n)] = uint8_t(uc(rng));
  }
  std::uniform_int_distribution<int> un(0, 15);
  std::vector<uint8_t> nib(static_cast<size_t>(G * cs.out));
  for (auto& v : nib) v = uint8_t(un(rng));
  std::uniform_real_distribution<float> ue(-16.f, 1.f);  // includes fp16-subnormal msc (< 2^-14 after /256)
  std::vector<uint16_t> qsm(static_cast<size_t>(G));
  for (auto& v : qsm) v = f32_to_f16(std::exp2(ue(rng)));
  std::vector<int32_t> perm(size_t(cs.in));
  for (int64_t i = 0; i < cs.in; ++i) perm[size_t(i)] = int32_t(i);
  std::shuffle(perm.begin(), perm.end(), rng);

  quant::Exl2PackInput p;
  p.codes = codes.data();
  p.group_bits = cs.bits;
  p.group_rows = cs.rows;
  p.scale_nibbles = nib.data();
  p.q_scale_max = qsm.data();
  p.perm = perm.data();
  p.in = cs.in;
  p.out = cs.out;
  const quant::Exl2Packed pk = quant::pack(p);

  auto arr = [](const void* data, DType dt, Shape shape) {
    quant::Exl2Array a;
    a.data = data;
    a.dtype = dt;
    a.shape = std::move(shape);
    a.present = true;
    return a;
  };
  quant::Exl2Tensors t;
  t.q_weight = arr(pk.q_weight.data(), DType::I32, {pk.qrows, pk.out_pad});
  t.q_scale = arr(pk.q_scale.data(), DType::I32, {pk.n_groups, pk.out_pad / 8});
  t.q_scale_max = arr(pk.q_scale_max.data(), DType::F16, {pk.n_groups});
  t.q_groups = arr(pk.q_groups.data(), DType::I16, {2 * pk.n_groups});
  t.q_invperm = arr(pk.q_invperm.data(), DType::I32, {pk.in});
  const quant::Exl2Layout L = quant::validate(t, "case", cs.in, cs.out);
  std::vector<uint16_t> W(size_t(L.in * L.out));
  quant::dequantize_into(t, L, 1.0, W.data(), false);  // [in, out], original order

  std::vector<uint16_t> msc(static_cast<size_t>(G));
  for (int g = 0; g < G; ++g) msc[size_t(g)] = f32_to_f16(f16_to_f32(pk.q_scale_max[size_t(g)]) * (1.0f / 256.0f));
  const cuda::Exl2TcTables T = cuda::exl2_tc_tables(L);
  const std::vector<uint32_t> tiled =
      cuda::exl2_tc_repack_host(T, reinterpret_cast<const uint32_t*>(pk.q_weight.data()), pk.qrows, L.out_pad);

  // Dequantize through the kernel code (one column of one slot per thread) into Wp [in, out_pad], packed order.
  std::vector<uint16_t> Wp(size_t(L.in * L.out_pad), 0xFFFF);
  for (int s = 0; s < int(T.n_quads * 4); ++s) {
    const UnitInfo U = unit_info(reinterpret_cast<const int4*>(T.slots.data()), s);
    for (int64_t col = 0; col < L.out_pad; ++col) {
      const PairCollect c = decode_slot_col(T, tiled, L, pk.q_scale, msc, s, col);
      for (int P = 0; P < 16; ++P) {
        if (c.a[P] < U.nvals) Wp[size_t((U.row + c.a[P]) * L.out_pad + col)] = uint16_t(c.v[P] & 0xffff);
        if (c.b[P] < U.nvals) Wp[size_t((U.row + c.b[P]) * L.out_pad + col)] = uint16_t(c.v[P] >> 16);
      }
    }
  }
  int64_t bad = 0;
  for (int64_t k = 0; k < L.in; ++k)
    for (int64_t n = 0; n < L.out; ++n)
      if (Wp[size_t(k * L.out_pad + n)] != W[size_t(L.perm[size_t(k)] * L.out + n)]) {
        if (bad < 5)
          std::printf("  mismatch k=%lld n=%lld: got %04x want %04x\n", (long long)k, (long long)n,
                      Wp[size_t(k * L.out_pad + n)], W[size_t(L.perm[size_t(k)] * L.out + n)]);
        ++bad;
      }
  const double e1 = tc_gemv_check(1, L, T, tiled, pk.q_scale, msc, W, rng);
  const double e4 = tc_gemv_check(5, L, T, tiled, pk.q_scale, msc, W, rng);
  const double e16 = tc_gemv_check(16, L, T, tiled, pk.q_scale, msc, W, rng);
  const std::vector<uint32_t> qw(reinterpret_cast<const uint32_t*>(pk.q_weight.data()),
                                 reinterpret_cast<const uint32_t*>(pk.q_weight.data()) + pk.qrows * L.out_pad);
  // v4: weights within f16 rounding of the reference (unrounded (q - z) * s in the dot product): rel err ~1e-4.
  const double v1 = v4_check(1, 1, false, L, qw, pk.qrows, pk.q_scale, msc, W, rng);
  const double v3 = v4_check(3, 2, false, L, qw, pk.qrows, pk.q_scale, msc, W, rng);
  const double v8 = v4_check(8, 3, false, L, qw, pk.qrows, pk.q_scale, msc, W, rng);
  const double k1 = v4_check(1, 2, true, L, qw, pk.qrows, pk.q_scale, msc, W, rng);
  const double k5 = v4_check(5, 1, true, L, qw, pk.qrows, pk.q_scale, msc, W, rng);
  const double v12 = v4_check(12, 2, false, L, qw, pk.qrows, pk.q_scale, msc, W, rng);
  const double v16 = v4_check(16, 1, false, L, qw, pk.qrows, pk.q_scale, msc, W, rng);
  const double k16 = v4_check(16, 3, true, L, qw, pk.qrows, pk.q_scale, msc, W, rng);
  const double v20 = v4_check(20, 2, false, L, qw, pk.qrows, pk.q_scale, msc, W, rng);  // M 32 (EXL2CPP_GEMV_M32)
  const double v32 = v4_check(32, 1, false, L, qw, pk.qrows, pk.q_scale, msc, W, rng);
  const bool v4ok = std::min({v1, v3, v8, k1, k5, v12, v16, k16, v20, v32}) >= 0 &&
                    std::max({v1, v3, v8, k1, k5, v12, v16, k16, v20, v32}) < 1e-3;
  const bool ok = bad == 0 && e1 < 1e-5 && e4 < 1e-5 && e16 < 1e-5 && v4ok;
  std::string runs;  // the v4 width runs: bits x chunks / scale rows per chunk
  const cuda::Exl2V4Tables VT = cuda::exl2_v4_tables(L);
  for (size_t r = 0; r < VT.run_bits.size(); ++r)
    runs += " " + std::to_string(VT.run_bits[r]) + "x" + std::to_string(VT.run_start[r + 1] - VT.run_start[r]) + "/" +
            std::to_string(VT.run_rpc[r]);
  std::printf("%s in=%lld out=%lld groups=%d quads=%lld v4 runs%s: %lld weight mismatches, tc gemv rel err M1 %.2e M5 "
              "%.2e M16 %.2e; v4 m1 %.2e m3 %.2e m8 %.2e m12 %.2e m16 %.2e m20 %.2e m32 %.2e, v4k m1 %.2e m5 %.2e "
              "m16 %.2e\n",
              ok ? "ok  " : "FAIL", (long long)cs.in, (long long)cs.out, G, (long long)T.n_quads, runs.c_str(),
              (long long)bad, e1, e4, e16, v1, v3, v8, v12, v16, v20, v32, k1, k5, k16);
  return ok;
}

// The grouped launch's grid (v4_plan + v4_block, as launch_gemv_v4 and the kernel use them): every (layer, column
// block, k slice) is exactly one block, every slice holds chunks, the group stays within one wave where the slicing
// allows, and a group of one gets the single-layer grid of before (the formula main's launch_gemv_v4 had).
bool group_grid_check() {
  struct Shape {
    int col_blocks, n_chunks;
  };
  // (sms, blocks per SM, chunks per slice, max chunks per slice, forced slices); H200: 132 SMs, 3 (m <= 8) or 2
  const int params[][5] = {{132, 3, 8, 160, 0}, {132, 2, 8, 10, 0}, {132, 3, 8, 160, 1},
                           {132, 3, 8, 160, 5}, {8, 1, 2, 3, 0},    {1, 1, 1, 1, 0}};
  // q/k/v and gate/up of Llama-2-7B (4096 -> 4096 x3; 4096 -> 11008 x2), GQA k/v, awkward and tiny layers
  const std::vector<std::vector<Shape>> groups = {{{32, 32}, {32, 32}, {32, 32}},
                                                  {{86, 32}, {86, 33}},
                                                  {{32, 32}, {8, 33}, {8, 31}},
                                                  {{1, 1}, {3, 7}},
                                                  {{2, 400}, {1, 1}, {70, 5}},
                                                  {{32, 32}},
                                                  {{86, 88}},
                                                  {{1, 1}},
                                                  {{5, 0}, {1, 2}}};
  int bad = 0;
  for (const auto& pr : params)
    for (const auto& shapes : groups) {
      V4Group g;
      g.n = int(shapes.size());
      int64_t cols = 0;
      for (int i = 0; i < g.n; ++i) {
        g.l[i].col_blocks = shapes[size_t(i)].col_blocks;
        g.l[i].n_chunks = shapes[size_t(i)].n_chunks;
        cols += g.l[i].col_blocks;
      }
      const int64_t sms = pr[0], wave = int64_t(pr[0]) * pr[1];
      if (!v4_plan(g, sms, wave, pr[2], pr[3], pr[4])) {
        std::printf("  group grid: v4_plan refused a small grid\n");
        ++bad;
        continue;
      }
      std::vector<std::vector<int>> hits(size_t(g.n));
      for (int i = 0; i < g.n; ++i) {
        const V4Layer& L = g.l[i];
        const int nc = std::max(L.n_chunks, 1);
        if (L.slices < 1 || L.cps < 1 || L.cps > pr[3] || int64_t(L.slices) * L.cps < nc ||
            int64_t(L.slices - 1) * L.cps >= nc) {
          std::printf("  group grid: layer %d of %d chunks: %d slices of %d chunks\n", i, L.n_chunks, L.slices, L.cps);
          ++bad;
        }
        hits[size_t(i)].assign(size_t(L.col_blocks) * L.slices, 0);
      }
      // one wave (or one block per column block, where there are more), unless slices were forced or the staged
      // x's cap on chunks per slice needs more
      const int64_t most = std::max<int64_t>(1, wave / cols);
      bool capped = pr[4] != 0;
      for (int i = 0; i < g.n; ++i) capped |= (std::max(g.l[i].n_chunks, 1) + most - 1) / most > pr[3];
      if (!capped && g.blocks > std::max(wave, cols)) {
        std::printf("  group grid: %d blocks for %lld column blocks, wave %lld\n", g.blocks, (long long)cols,
                    (long long)wave);
        ++bad;
      }
      for (int b = 0; b < g.blocks; ++b) {
        const V4Block k = v4_block(g, b);
        if (k.layer < 0 || k.layer >= g.n || k.cb < 0 || k.cb >= g.l[k.layer].col_blocks || k.slice < 0 ||
            k.slice >= g.l[k.layer].slices) {
          std::printf("  group grid: block %d -> layer %d cb %d slice %d out of range\n", b, k.layer, k.cb, k.slice);
          ++bad;
          continue;
        }
        ++hits[size_t(k.layer)][size_t(k.slice) * g.l[k.layer].col_blocks + k.cb];
      }
      for (const auto& h : hits)
        for (int c : h)
          if (c != 1) {
            std::printf("  group grid: a (layer, cb, slice) covered %d times\n", c);
            ++bad;
            break;
          }
      {  // the cluster plan (EXL2CPP_GEMV_CLUSTER=1): S slices for every layer, a cluster = one column block
        V4Group c = g;
        int max_slices = 1;
        for (int i = 0; i < g.n; ++i) max_slices = std::max(max_slices, g.l[i].slices);
        if (v4_plan_cluster(c, 8, pr[3])) {
          const int S = c.cluster;
          if (S < 2 || S > 8 || S > max_slices || c.blocks % S != 0) {
            std::printf("  cluster grid: S %d for max slices %d, %d blocks\n", S, max_slices, c.blocks);
            ++bad;
          }
          std::vector<std::vector<int>> ch(size_t(c.n));
          for (int i = 0; i < c.n; ++i) {
            const V4Layer& L = c.l[i];
            const int nc = std::max(L.n_chunks, 1);
            if (L.slices != S || L.cps < 1 || L.cps > pr[3] || int64_t(S) * L.cps < nc ||
                int64_t(S - 1) * L.cps >= nc || L.block0 % S != 0) {  // all S slices hold chunks
              std::printf("  cluster grid: layer %d of %d chunks: %d slices of %d chunks\n", i, nc, L.slices, L.cps);
              ++bad;
            }
            ch[size_t(i)].assign(size_t(L.col_blocks) * S, 0);
          }
          for (int b = 0; b < c.blocks; ++b) {
            const V4Block k = v4_block(c, b), k0 = v4_block(c, b - b % S);
            if (k.layer < 0 || k.layer >= c.n || k.cb < 0 || k.cb >= c.l[k.layer].col_blocks || k.slice != b % S ||
                k0.layer != k.layer || k0.cb != k.cb) {
              std::printf("  cluster grid: block %d -> layer %d cb %d slice %d\n", b, k.layer, k.cb, k.slice);
              ++bad;
              continue;
            }
            ++ch[size_t(k.layer)][size_t(k.slice) * c.l[k.layer].col_blocks + k.cb];
          }
          for (const auto& h : ch)
            for (int x : h)
              if (x != 1) {
                std::printf("  cluster grid: a (layer, cb, slice) covered %d times\n", x);
                ++bad;
                break;
              }
        } else if (c.cluster != 0 || c.blocks != g.blocks) {
          std::printf("  cluster grid: a refused plan changed the group\n");
          ++bad;
        } else {  // refused only when no S in 2..min(max_slices, 8) fills every layer's slices within the cap
          for (int S = 2; S <= std::min(max_slices, 8); ++S) {
            bool fits = true;
            for (int i = 0; i < g.n; ++i) {
              const int nc = std::max(g.l[i].n_chunks, 1), cps = (nc + S - 1) / S;
              fits &= cps <= pr[3] && (nc + cps - 1) / cps == S;
            }
            if (fits) {
              std::printf("  cluster grid: refused although %d slices fit\n", S);
              ++bad;
              break;
            }
          }
        }
      }
      if (g.n == 1 && g.l[0].n_chunks > 0) {  // main's single-layer formula
        const int64_t cb = g.l[0].col_blocks, nc = g.l[0].n_chunks;
        const int64_t most = std::max<int64_t>(1, wave / cb), fill = (sms + cb - 1) / cb;
        int64_t slices = std::max(fill, (nc + pr[2] - 1) / pr[2]);
        slices = std::max<int64_t>(1, std::min({slices, most, nc}));
        if (pr[4]) slices = std::min<int64_t>(pr[4], nc);
        int64_t cps = (nc + slices - 1) / slices;
        cps = std::max<int64_t>(1, std::min<int64_t>(cps, pr[3]));
        slices = (nc + cps - 1) / cps;
        if (slices != g.l[0].slices || cps != g.l[0].cps) {
          std::printf("  group grid: a group of one gets %d x %d, the single launch had %lld x %lld\n", g.l[0].slices,
                      g.l[0].cps, (long long)slices, (long long)cps);
          ++bad;
        }
      }
    }
  // The expected Llama-2-7B grids on the H200 at m = 1 (3 blocks per SM: wave 396).
  for (const auto& shapes : {groups[0], groups[1]}) {
    V4Group g;
    g.n = int(shapes.size());
    for (int i = 0; i < g.n; ++i)
      g.l[i].col_blocks = shapes[size_t(i)].col_blocks, g.l[i].n_chunks = shapes[size_t(i)].n_chunks;
    v4_plan(g, 132, 396, 8, 160, 0);
    std::printf("group of %d (%d column blocks, %d chunks): %d blocks, layer 0: %d slices of %d chunks\n", g.n,
                g.l[0].col_blocks, g.l[0].n_chunks, g.blocks, g.l[0].slices, g.l[0].cps);
  }
  std::printf("%s: grouped launch grid, %d problems\n", bad ? "FAIL" : "ok  ", bad);
  return bad == 0;
}

}  // namespace

int main() {
  std::mt19937 rng(1234);
  std::vector<Case> cases;
  for (int b : {2, 3, 4, 5, 6, 8}) cases.push_back({96, 33, {b, b, b}, {32, 32, 32}});
  for (int b : {2, 3, 4, 5, 6, 8}) cases.push_back({160, 100, {b}, {160}});
  cases.push_back({224, 7, {8, 6, 5, 4, 3, 2}, {32, 32, 32, 32, 64, 32}});
  cases.push_back({160, 64, {8, 8, 4, 4, 4}, {32, 32, 32, 32, 32}});
  cases.push_back({96, 257, {6, 3, 2}, {32, 32, 32}});
  cases.push_back({64, 1, {5, 2}, {32, 32}});
  cases.push_back({48, 40, {4, 2}, {32, 16}});                // 16-row 2-bit group
  cases.push_back({100, 31, {4, 4, 4, 4}, {32, 32, 32, 4}});  // ragged last group
  cases.push_back({70, 50, {3, 3}, {64, 6}});                 // ragged 3-bit tail
  cases.push_back({44, 64, {8, 6, 2}, {4, 16, 24}});          // tiny groups: 8-bit x4, 6-bit x16
  cases.push_back({608, 96, {8, 6, 5, 4, 3, 2}, {32, 64, 128, 128, 128, 128}});
  cases.push_back({1024, 160, {8, 4, 4, 4, 4, 3, 3}, {96, 128, 128, 128, 128, 256, 160}});  // several chunks, 1 row each
  cases.push_back({512, 48, {6, 6, 6, 6, 5, 5}, {64, 64, 64, 64, 128, 128}});  // 64-row groups: 2 rows/chunk
  // Every width x group size 32 / 64 / 128 (scale rows per chunk 4 / 2 / 1), whole and with a ragged last group.
  for (int b : {2, 3, 4, 5, 6, 8})
    for (int64_t gs : {32, 64, 128}) {
      cases.push_back({4 * gs, 48, {b, b, b, b}, {gs, gs, gs, gs}});
      cases.push_back({2 * gs + 20, 33, {b, b, b}, {gs, gs, 20}});
    }
  cases.push_back({224, 40, {4, 4, 4}, {64, 96, 64}});          // 2-3-2 units: pairs misaligned, 4 rows/chunk
  cases.push_back({448, 40, {5, 5, 3, 3}, {128, 64, 192, 64}});  // rows/chunk 1 (5-bit: 4+2 units), 2 (3-bit: 6+2)
  int fails = 0;
  for (const Case& c : cases) fails += run_case(c, rng) ? 0 : 1;
  // The deliberately wrong scale mappings (v4_mutants) must each have been caught.
  const char* mut_name[4] = {"columns g / g + 8 swapped", "scale rows rotated", "maxima of the next chunk",
                             "codes off by one"};
  for (int i = 0; i < 4; ++i) {
    std::printf("%s: wrong scale mapping '%s' gives %lld scale mismatches\n", mutant_hits[i] > 0 ? "ok  " : "FAIL",
                mut_name[i], (long long)mutant_hits[i]);
    fails += mutant_hits[i] > 0 ? 0 : 1;
  }
  fails += group_grid_check() ? 0 : 1;
  std::printf("%s: %d of %zu cases failed\n", fails ? "FAIL" : "PASS", fails, cases.size());
  return fails ? 1 : 0;
}
