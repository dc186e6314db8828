// EXPERIMENT (issue 4, not used by the library; measured no faster than cuda/exl2_gemm.cu, see
// dev/kernels/exl2_gemv_notes.md). The EXL2 kernels' in-memory weight layout ("tiled"), its load-time repack from the disk layout, the per-unit
// decoding and the kernels themselves (fused GEMV, dequantize, repack). Decoding is host-callable as well so
// that dev/kernels/exl2_decode_check.cu can check it against quant::dequantize_into without a GPU, and the
// kernels live here so that dev/kernels/exl2_gemv_bench.cu can time them standalone.
//
// Units. A unit is <= 32 consecutive packed input rows of ONE group (groups are cut into 32-row units; a group
// whose row count is not a multiple of 32 ends in a short unit). Unit u holds packed rows row(u) .. +nvals.
// Table entry (int4): {woff, row, group, bits | nvals << 8 | nwords << 16}; woff = sum of bits of the units
// before u (the unit's first word row inside a tile); nwords = disk words per column (ceil(nvals*bits/32)).
//
// Tiled q_weight: u32 [tiles][tile_words][128], tiles = ceil(out_pad / 128), tile_words = sum of all units'
// bits. Word (t, woff(u) + j, c) is word j (j < bits) of unit u for column 128 t + c. A warp reads one unit of
// one tile as bits * 512 contiguous bytes (one 16-byte load per lane per word row; lane l owns columns
// 4l .. 4l+3), and a block's consecutive units are contiguous as well.
// Per column, the unit's 32 codes (codes past nvals and columns past out_pad hold the zero point, so they
// dequantize to exactly 0) are split into two 16-bit "half streams": values 0..15 form the low stream (value v
// at bit v*bits), values 16..31 the high stream; word j = low stream bits [16j, 16j+16) | high stream bits
// [16j, 16j+16) << 16. Value pair P (0..15) = values (P, P+16) then sits at the same shift in both halves of
// one word (or straddles into word j+1 in both halves), so one shift + mask + OR 0x6400 gives the half2
// (1024 + q_P, 1024 + q_{P+16}) for every bit width.
// Tiled scales: u16 [G][tiles * 32]: entry (g, 32 t + l) = the 4 scale nibbles of columns 128t + 4l .. +3.
// perm_u: i32 [n_units * 32]: input feature of unit u's value v (-1 for v >= nvals): x is gathered through it.
//
// Dequantization is bit-exact with quant::dequantize_into (shared/specs/exl2-format.md 1.6):
//   s = f16((nib+1)^2) * msc  (one f16 rounding),  w = f16((1024 + q) - (1024 + z)) * s  (exact, then one
//   rounding): (q - z) and (nib+1)^2 are exact in f16.
// GEMV precision: for each column and row of x, the 32 products of one unit are summed in f16 by HFMA2 (16 per
// half lane, w and x both f16), and each unit's two half sums are added to an fp32 accumulator; the blocks'
// fp32 partial sums meet in fp32; y is rounded to f16 once. Expected relative error ~1e-3 of the per-unit
// partial sums; a single product must stay inside the f16 range (|w * x| < 65504/16).
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#define EXL2_HD __host__ __device__ __forceinline__

namespace exl2::cuda::exl2t {

constexpr int kTileCols = 128;  // columns per tile = one warp, 4 per lane
constexpr int kWarps = 8;       // GEMV block: 8 warps share one tile and split its units
constexpr int kGemvThreads = kWarps * 32;
constexpr int kMaxUps = 32;     // GEMV: units per block at most
constexpr int kGemvWordBytes = 64 * 1024;  // GEMV: a block's staged weight words at most

EXL2_HD uint32_t funnel_r(uint32_t lo, uint32_t hi, int sh) {
#ifdef __CUDA_ARCH__
  return __funnelshift_r(lo, hi, sh);
#else
  return static_cast<uint32_t>(((uint64_t(hi) << 32) | lo) >> (sh & 31));
#endif
}

EXL2_HD __half2 as_half2(uint32_t u) {
  __half2 h;
  memcpy(&h, &u, sizeof(h));
  return h;
}

EXL2_HD uint32_t as_u32(__half2 h) {
  uint32_t u;
  memcpy(&u, &h, sizeof(u));
  return u;
}

// f16 FMA per lane (on the host: exact product in fp32, then fp32 add and f16 rounding; only used by checks).
EXL2_HD __half2 hfma2(__half2 a, __half2 b, __half2 c) {
#ifdef __CUDA_ARCH__
  return __hfma2(a, b, c);
#else
  const float2 fa = __half22float2(a), fb = __half22float2(b), fc = __half22float2(c);
  return __floats2half2_rn(fa.x * fb.x + fc.x, fa.y * fb.y + fc.y);
#endif
}

struct UnitInfo {
  int woff, row, group, bits, nvals, nwords;
};

EXL2_HD UnitInfo unpack_unit(int4 e) { return {e.x, e.y, e.z, e.w & 0xff, (e.w >> 8) & 0xff, e.w >> 16}; }

// ---- repack (disk -> tiled) -------------------------------------------------------------------------------

// Tiled words of unit U for one column from its disk words d[0 .. nwords) (d[nwords] must be readable, any
// value). Codes past nvals are the zero point.
EXL2_HD void repack_column(const UnitInfo& U, const uint32_t* d, uint32_t* out) {
  const int b = U.bits;
  const uint32_t mask = (1u << b) - 1u, z = 1u << (b - 1);
  for (int j = 0; j < b; ++j) out[j] = 0u;
  for (int v = 0; v < 32; ++v) {
    uint32_t q = z;
    if (v < U.nvals) {
      const int bit = v * b, i = bit / 32;
      q = funnel_r(d[i], i + 1 < U.nwords ? d[i + 1] : 0u, bit % 32) & mask;
    }
    const int half = v / 16, off = (v % 16) * b, j = off / 16, sh = off % 16;
    out[j] |= ((q << sh) & 0xffffu) << (16 * half);
    if (sh + b > 16) out[j + 1] |= ((q >> (16 - sh)) & 0xffffu) << (16 * half);
  }
}

// ---- decoding -------------------------------------------------------------------------------------------------

// half2 bits (1024 + q_P, 1024 + q_{P+16}) from a column's B tiled words.
template <int B, int P>
EXL2_HD uint32_t pair_bits(const uint32_t (&w)[B]) {
  constexpr int off = P * B, j = off / 16, sh = off % 16;
  constexpr uint32_t m = (1u << B) - 1u;
  if constexpr (B == 8) {
#ifdef __CUDA_ARCH__
    return __byte_perm(w[j], 0x64646464u, sh == 0 ? 0x4240 : 0x4341);
#else
    return ((w[j] >> sh) & 0x00ff00ffu) | 0x64006400u;
#endif
  } else if constexpr (sh + B <= 16) {
    return ((w[j] >> sh) & (m * 0x10001u)) | 0x64006400u;
  } else {
    constexpr int lo = 16 - sh;  // bits that come from word j
    constexpr uint32_t mlo = ((1u << lo) - 1u) * 0x10001u;
    constexpr uint32_t mhi = (m & ~((1u << lo) - 1u)) * 0x10001u;
    return ((w[j] >> sh) & mlo) | ((w[j + 1] << lo) & mhi) | 0x64006400u;
  }
}

template <typename F, int... P>
EXL2_HD void for_pairs(F&& f, std::integer_sequence<int, P...>) {
  (f(std::integral_constant<int, P>{}), ...);
}

// What a lane reads of one unit: word rows j < bits (x..w = its 4 columns; rows >= bits hold 0), the 4 scale
// nibbles of its columns (bits 0..15) and msc of the unit's group.
struct UnitData {
  uint4 w[8];
  uint32_t sw;
  __half msc;
};

EXL2_HD uint4 ld_w(const uint32_t* p) {
#ifdef __CUDA_ARCH__
  return __ldcs(reinterpret_cast<const uint4*>(p));  // streamed once: evict first
#else
  return *reinterpret_cast<const uint4*>(p);
#endif
}

// q_tile = q + tile * tile_words * 128; scales_tile = scales + tile * 32; lane 0..31.
EXL2_HD void load_unit(const UnitInfo& U, const uint32_t* __restrict__ q_tile, const uint16_t* __restrict__ scales_tile,
                       int64_t scale_ld, const __half* __restrict__ msc, int lane, UnitData& d) {
  const uint32_t* p = q_tile + int64_t(U.woff) * kTileCols + lane * 4;
#pragma unroll
  for (int j = 0; j < 8; ++j) d.w[j] = j < U.bits ? ld_w(p + j * kTileCols) : make_uint4(0u, 0u, 0u, 0u);
#ifdef __CUDA_ARCH__
  d.sw = __ldg(scales_tile + int64_t(U.group) * scale_ld + lane);
  d.msc = __ldg(msc + U.group);
#else
  d.sw = scales_tile[int64_t(U.group) * scale_ld + lane];
  d.msc = msc[U.group];
#endif
}

// s = f16((nib+1)^2) * msc, one f16 rounding, for the 4 columns.
EXL2_HD void unit_scales(const UnitData& d, __half2 (&s2)[4]) {
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const int t = int((d.sw >> (4 * c)) & 15u) + 1;
    s2[c] = __half2half2(__hmul_rn(__float2half_rn(float(t * t)), d.msc));
  }
}

// Calls f(P, w2[4]) for the 16 value pairs of a loaded B-bit unit: w2[c] = (W[row+P][col+c], W[row+P+16][col+c])
// as exact f16 weights (0 past nvals).
template <int B, typename F>
EXL2_HD void decode_unit(const UnitData& d, F&& f) {
  uint32_t w[4][B];
#pragma unroll
  for (int j = 0; j < B; ++j) {
    w[0][j] = d.w[j].x;
    w[1][j] = d.w[j].y;
    w[2][j] = d.w[j].z;
    w[3][j] = d.w[j].w;
  }
  __half2 s2[4];
  unit_scales(d, s2);
  const __half2 zb = as_half2(0x64006400u + (1u << (B - 1)) * 0x10001u);  // 1024 + z, exact
  for_pairs(
      [&](auto pc) {
        constexpr int P = decltype(pc)::value;
        __half2 w2[4];
#pragma unroll
        for (int c = 0; c < 4; ++c) w2[c] = __hmul2_rn(__hsub2(as_half2(pair_bits<B, P>(w[c])), zb), s2[c]);
        f(P, w2);
      },
      std::make_integer_sequence<int, 16>{});
}

template <typename F>
EXL2_HD void decode_unit_any(int bits, const UnitData& d, F&& f) {
  switch (bits) {
    case 8:
      decode_unit<8>(d, f);
      break;
    case 6:
      decode_unit<6>(d, f);
      break;
    case 5:
      decode_unit<5>(d, f);
      break;
    case 4:
      decode_unit<4>(d, f);
      break;
    case 3:
      decode_unit<3>(d, f);
      break;
    case 2:
      decode_unit<2>(d, f);
      break;
    default:
      break;  // validated on the host
  }
}

// acc[c][i] += sum over the unit of W[v][col+c] * x[i][v]; xu = the unit's staged x, half2 [16][M]
// (pair P, row i) = (x[i][feature of value P], x[i][feature of value P+16]). f16 sums over the unit, then fp32.
template <int B, int M>
EXL2_HD void unit_gemv(const UnitData& d, const __half2* xu, float (&acc)[4][M]) {
  __half2 ah[4][M];
#pragma unroll
  for (int c = 0; c < 4; ++c)
#pragma unroll
    for (int i = 0; i < M; ++i) ah[c][i] = as_half2(0u);
  __half2 x1[16];
  if constexpr (M == 1) {
#pragma unroll
    for (int p = 0; p < 16; p += 4) {
      const uint4 v = *reinterpret_cast<const uint4*>(xu + p);
      x1[p] = as_half2(v.x);
      x1[p + 1] = as_half2(v.y);
      x1[p + 2] = as_half2(v.z);
      x1[p + 3] = as_half2(v.w);
    }
  }
  decode_unit<B>(d, [&](int P, const __half2(&w2)[4]) {
    __half2 xv[M];
    if constexpr (M == 1) {
      xv[0] = x1[P];
    } else if constexpr (M == 2) {
      const uint2 v = *reinterpret_cast<const uint2*>(xu + P * 2);
      xv[0] = as_half2(v.x);
      xv[1] = as_half2(v.y);
    } else {
#pragma unroll
      for (int i = 0; i < M; i += 4) {
        const uint4 v = *reinterpret_cast<const uint4*>(xu + P * M + i);
        xv[i] = as_half2(v.x);
        xv[i + 1] = as_half2(v.y);
        xv[i + 2] = as_half2(v.z);
        xv[i + 3] = as_half2(v.w);
      }
    }
#pragma unroll
    for (int c = 0; c < 4; ++c)
#pragma unroll
      for (int i = 0; i < M; ++i) ah[c][i] = hfma2(w2[c], xv[i], ah[c][i]);
  });
#pragma unroll
  for (int c = 0; c < 4; ++c)
#pragma unroll
    for (int i = 0; i < M; ++i) {
      const float2 f = __half22float2(ah[c][i]);
      acc[c][i] += f.x + f.y;
    }
}

template <int M>
EXL2_HD void unit_gemv_any(int bits, const UnitData& d, const __half2* xu, float (&acc)[4][M]) {
  switch (bits) {
    case 8:
      unit_gemv<8, M>(d, xu, acc);
      break;
    case 6:
      unit_gemv<6, M>(d, xu, acc);
      break;
    case 5:
      unit_gemv<5, M>(d, xu, acc);
      break;
    case 4:
      unit_gemv<4, M>(d, xu, acc);
      break;
    case 3:
      unit_gemv<3, M>(d, xu, acc);
      break;
    case 2:
      unit_gemv<2, M>(d, xu, acc);
      break;
    default:
      break;
  }
}

// ---- host-side tables ------------------------------------------------------------------------------------------

struct TileGroup {
  int bits;
  int64_t qrow_start, row_start, rows;  // first disk q_weight row, first packed input row, packed rows
};

struct TileTables {
  std::vector<int32_t> units;   // [n_units][4] (see the top of this file)
  std::vector<int32_t> qrow;    // [n_units] first disk q_weight row (repack only)
  std::vector<int32_t> perm_u;  // [n_units * 32]
  int64_t n_units = 0, tile_words = 0;
};

// perm: [in] perm[k] = input feature of packed row k. Returns false if an index does not fit int32.
inline bool make_tile_tables(const std::vector<TileGroup>& groups, const int32_t* perm, TileTables& t) {
  t = TileTables();
  for (size_t g = 0; g < groups.size(); ++g) {
    const TileGroup& gr = groups[g];
    for (int64_t r = 0; r < gr.rows; r += 32) {
      const int64_t nvals = gr.rows - r < 32 ? gr.rows - r : 32;
      const int64_t nwords = (nvals * gr.bits + 31) / 32;
      const int64_t qrow = gr.qrow_start + (r / 32) * gr.bits;
      if (t.tile_words + gr.bits > INT32_MAX || qrow > INT32_MAX || gr.row_start + r > INT32_MAX) return false;
      t.units.insert(t.units.end(), {int32_t(t.tile_words), int32_t(gr.row_start + r), int32_t(g),
                                     int32_t(gr.bits | (nvals << 8) | (nwords << 16))});
      t.qrow.push_back(int32_t(qrow));
      for (int v = 0; v < 32; ++v) t.perm_u.push_back(v < nvals ? perm[gr.row_start + r + v] : -1);
      t.tile_words += gr.bits;
    }
  }
  t.n_units = int64_t(t.qrow.size());
  return true;
}

// Tiled scales u16 [G][tiles*32] from the disk q_scale i32 [G][out_pad/8]; columns past out_pad get nibble 0.
inline std::vector<uint16_t> make_tile_scales(const uint32_t* q_scale, int64_t G, int64_t out_pad, int64_t tiles) {
  std::vector<uint16_t> s(size_t(G * tiles * 32), 0);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c4 = 0; c4 < out_pad / 4; ++c4)
      s[size_t(g * tiles * 32 + c4)] = uint16_t(q_scale[g * (out_pad / 8) + c4 / 2] >> (16 * (c4 % 2)));
  return s;
}

// GEMV launch plan. A block stages its units' words (contiguous in a tile), scales and x in shared memory.
struct GemvPlan {
  int ups = 1;         // units per block
  int64_t splits = 1;  // blocks along k
  size_t smem = 0;     // dynamic shared memory bytes
};

// Units per block: about blocks_per_sm blocks per multiprocessor over the grid, at most kMaxUps and at most
// kGemvWordBytes of weight words (max_bits = the layer's widest unit).
inline GemvPlan gemv_plan(int64_t n_units, int64_t tiles, int max_bits, int m_pad, int sms, int blocks_per_sm) {
  GemvPlan p;
  const int64_t target = int64_t(sms) * blocks_per_sm;
  int64_t splits = (target + tiles - 1) / tiles;
  if (splits < 1) splits = 1;
  if (splits > n_units) splits = n_units;
  int64_t ups = (n_units + splits - 1) / splits;
  const int64_t cap = kGemvWordBytes / (int64_t(max_bits) * 512);
  if (ups > cap) ups = cap;
  if (ups > kMaxUps) ups = kMaxUps;
  if (ups < 1) ups = 1;
  p.ups = int(ups);
  p.splits = (n_units + ups - 1) / ups;
  const size_t words = size_t(ups) * max_bits * 512, scales = size_t(ups) * 64, msc = (size_t(ups) * 2 + 15) / 16 * 16,
               xs = size_t(ups) * 16 * m_pad * 4, red = size_t(kWarps) * m_pad * kTileCols * 4;
  p.smem = (words > red ? words : red) + scales + msc + xs;
  return p;
}

// ---- kernels -------------------------------------------------------------------------------------------------
#ifdef __CUDACC__

// grid (n_units, ceil(tiles*128 / 128)), block 128: thread (u, column) repacks one column of one unit.
// qrow: [n_units] first disk q_weight row of each unit.
__global__ void __launch_bounds__(128)
    exl2_repack_kernel(const uint32_t* __restrict__ qdisk, int64_t out_pad, const int4* __restrict__ units,
                       const int32_t* __restrict__ qrow, int64_t tile_words, uint32_t* __restrict__ qt) {
  const int u = blockIdx.x;
  const int64_t col = int64_t(blockIdx.y) * 128 + threadIdx.x;
  const UnitInfo U = unpack_unit(units[u]);
  uint32_t d[9], o[8];
  const int64_t q0 = qrow[u];
  for (int i = 0; i < 9; ++i) d[i] = (col < out_pad && i < U.nwords) ? qdisk[(q0 + i) * out_pad + col] : 0u;
  if (col < out_pad) {
    repack_column(U, d, o);
  } else {
    const uint32_t zero[9] = {};
    UnitInfo Z = U;
    Z.nvals = 0;  // all zero points
    repack_column(Z, zero, o);
  }
  const int64_t t = col / kTileCols, c = col % kTileCols;
  for (int j = 0; j < U.bits; ++j) qt[(t * tile_words + U.woff + j) * kTileCols + c] = o[j];
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned sa = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(sa), "l"(gmem));
}

// grid (column tiles, k splits), kGemvThreads threads, GemvPlan::smem bytes. Block (tile, split) multiplies units
// [split*ups, +ups) for the tile's 128 columns. It first copies the units' words (one contiguous run of the
// tile) and their groups' scales into shared memory with cp.async (all of it in flight at once), stages x
// (gathered through perm_u, as f16 pairs) and msc meanwhile, then warp w decodes units w, w+8, ... The 8
// warps' sums meet in shared memory; with one split the block writes y (+ bias), else it adds them into acc
// [kMaxM, acc_ld] by fp32 atomics and the last block of the tile (counters[tile]) writes y and clears its part
// of acc and its counter for the next launch.
template <int M>
__global__ void __launch_bounds__(kGemvThreads, M == 1 ? 3 : M <= 4 ? 2 : 1)
    exl2_gemv_kernel(const __half* __restrict__ x, int64_t in, int m, const uint32_t* __restrict__ q,
                     int64_t tile_words, const uint16_t* __restrict__ scales, int64_t scale_ld,
                     const __half* __restrict__ msc, const int32_t* __restrict__ perm_u, const int4* __restrict__ units,
                     int n_units, int ups, int max_bits, const float* __restrict__ bias, __half* __restrict__ y,
                     int64_t out, float* __restrict__ acc, int64_t acc_ld, unsigned* __restrict__ counters) {
  extern __shared__ uint4 smem[];
  __shared__ bool is_last;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, tile = blockIdx.x;
  const int u0 = blockIdx.y * ups;
  const int nu = min(ups, n_units - u0);
  // Shared memory: words [ups*max_bits][128] u32 (later the reduction), scales [ups][32] u16, msc [ups] f16,
  // x [ups][16][M] half2.
  const size_t words_bytes = size_t(ups) * max_bits * 512, red_bytes = size_t(kWarps) * M * kTileCols * 4;
  char* base = reinterpret_cast<char*>(smem);
  uint32_t* sw = reinterpret_cast<uint32_t*>(base);
  uint16_t* ss = reinterpret_cast<uint16_t*>(base + (words_bytes > red_bytes ? words_bytes : red_bytes));
  __half* sm = reinterpret_cast<__half*>(ss + ups * 32);
  __half2* xs = reinterpret_cast<__half2*>(reinterpret_cast<char*>(sm) + (size_t(ups) * 2 + 15) / 16 * 16);

  const UnitInfo A = unpack_unit(__ldg(units + u0)), Z = unpack_unit(__ldg(units + u0 + nu - 1));
  const int wbeg = A.woff, nw = Z.woff + Z.bits - A.woff, g0 = A.group, ng = Z.group - A.group + 1;
  {
    const uint32_t* src = q + (int64_t(tile) * tile_words + wbeg) * kTileCols;
    for (int c = tid; c < nw * 32; c += kGemvThreads) cp_async16(sw + c * 4, src + c * 4);
    for (int c = tid; c < ng * 4; c += kGemvThreads)
      cp_async16(ss + c * 8, scales + int64_t(g0 + c / 4) * scale_ld + int64_t(tile) * 32 + (c % 4) * 8);
    asm volatile("cp.async.commit_group;\n" ::);
  }
  for (int g = tid; g < ng; g += kGemvThreads) sm[g] = msc[g0 + g];
  const int n_stage = nu * 16 * M;
  for (int e = tid; e < n_stage; e += kGemvThreads) {
    const int lu = e / (16 * M), r = e % (16 * M), P = r / M, i = r % M;
    const int32_t* pu = perm_u + int64_t(u0 + lu) * 32;
    const int ka = __ldg(pu + P), kb = __ldg(pu + P + 16);
    __half a = __float2half_rn(0.f), b = a;
    if (i < m) {
      if (ka >= 0) a = x[int64_t(i) * in + ka];
      if (kb >= 0) b = x[int64_t(i) * in + kb];
    }
    xs[e] = __halves2half2(a, b);
  }
  // Lane j holds the table entry of this warp's j-th unit.
  const int n_my = warp < nu ? (nu - warp + kWarps - 1) / kWarps : 0;
  const int4 mine = lane < n_my ? __ldg(units + u0 + warp + kWarps * lane) : make_int4(0, 0, 0, 0);
  asm volatile("cp.async.wait_all;\n" ::: "memory");
  __syncthreads();

  float accf[4][M];
#pragma unroll
  for (int c = 0; c < 4; ++c)
#pragma unroll
    for (int i = 0; i < M; ++i) accf[c][i] = 0.f;
  for (int k = 0; k < n_my; ++k) {
    int4 e;
    e.x = __shfl_sync(0xffffffffu, mine.x, k);
    e.z = __shfl_sync(0xffffffffu, mine.z, k);
    e.w = __shfl_sync(0xffffffffu, mine.w, k);
    const UnitInfo U = unpack_unit(e);
    UnitData d;
    const uint32_t* p = sw + (U.woff - wbeg) * kTileCols + lane * 4;
#pragma unroll
    for (int j = 0; j < 8; ++j) d.w[j] = j < U.bits ? *reinterpret_cast<const uint4*>(p + j * kTileCols) : make_uint4(0u, 0u, 0u, 0u);
    d.sw = ss[(U.group - g0) * 32 + lane];
    d.msc = sm[U.group - g0];
    unit_gemv_any<M>(U.bits, d, xs + (warp + kWarps * k) * 16 * M, accf);
  }

  // Sum the 8 warps.
  __syncthreads();  // the staged words are dead
  float* red = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int i = 0; i < M; ++i)
    *reinterpret_cast<float4*>(red + (warp * M + i) * kTileCols + lane * 4) =
        make_float4(accf[0][i], accf[1][i], accf[2][i], accf[3][i]);
  __syncthreads();
  const bool single = gridDim.y == 1;
  for (int e = tid; e < M * 32; e += kGemvThreads) {
    const int i = e / 32, l = e % 32;
    if (i >= m) continue;
    float4 s = *reinterpret_cast<const float4*>(red + i * kTileCols + l * 4);
#pragma unroll
    for (int w = 1; w < kWarps; ++w) {
      const float4 t = *reinterpret_cast<const float4*>(red + (w * M + i) * kTileCols + l * 4);
      s.x += t.x;
      s.y += t.y;
      s.z += t.z;
      s.w += t.w;
    }
    const int64_t col = int64_t(tile) * kTileCols + l * 4;
    if (single) {
      const float v[4] = {s.x, s.y, s.z, s.w};
#pragma unroll
      for (int c = 0; c < 4; ++c)
        if (col + c < out) y[int64_t(i) * out + col + c] = __float2half_rn(v[c] + (bias ? bias[col + c] : 0.f));
    } else {
      float* dst = acc + int64_t(i) * acc_ld + col;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      atomicAdd(reinterpret_cast<float4*>(dst), s);
#else
      atomicAdd(dst, s.x);
      atomicAdd(dst + 1, s.y);
      atomicAdd(dst + 2, s.z);
      atomicAdd(dst + 3, s.w);
#endif
    }
  }
  if (single) return;

  __threadfence();
  __syncthreads();
  if (tid == 0) is_last = atomicAdd(&counters[tile], 1u) == gridDim.y - 1;
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  for (int e = tid; e < m * 32; e += kGemvThreads) {
    const int i = e / 32, l = e % 32;
    const int64_t col = int64_t(tile) * kTileCols + l * 4;
    float4* src = reinterpret_cast<float4*>(acc + int64_t(i) * acc_ld + col);
    const float4 s = __ldcg(src);
    __stcg(src, make_float4(0.f, 0.f, 0.f, 0.f));
    const float v[4] = {s.x, s.y, s.z, s.w};
#pragma unroll
    for (int c = 0; c < 4; ++c)
      if (col + c < out) y[int64_t(i) * out + col + c] = __float2half_rn(v[c] + (bias ? bias[col + c] : 0.f));
  }
  if (tid == 0) counters[tile] = 0u;
}

// grid (tiles of the chunk, ceil(n_units / 4)), 128 threads: warp w dequantizes unit 4*blockIdx.y + w for the
// 128 columns of tile t0 + blockIdx.x into wp [n_units*32, width] (TW), columns c0 = 128*t0 .. +width,
// unit-padded packed row order (row 32u + v; rows past a unit's nvals are 0).
template <typename TW>
__global__ void __launch_bounds__(128)
    exl2_dequant_kernel(const uint32_t* __restrict__ q, int64_t tile_words, const uint16_t* __restrict__ scales,
                        int64_t scale_ld, const __half* __restrict__ msc, const int4* __restrict__ units, int n_units,
                        int64_t t0, int64_t width, TW* __restrict__ wp) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int u = blockIdx.y * 4 + warp;
  if (u >= n_units) return;
  const int64_t tile = t0 + blockIdx.x;
  const UnitInfo U = unpack_unit(__ldg(units + u));
  UnitData d;
  load_unit(U, q + tile * tile_words * kTileCols, scales + tile * 32, scale_ld, msc, lane, d);
  TW* dst = wp + int64_t(u) * 32 * width + int64_t(blockIdx.x) * kTileCols + lane * 4;
  decode_unit_any(U.bits, d, [&](int P, const __half2(&w2)[4]) {
    if constexpr (sizeof(TW) == 2) {
      uint2 lo, hi;
      lo.x = as_u32(__halves2half2(__low2half(w2[0]), __low2half(w2[1])));
      lo.y = as_u32(__halves2half2(__low2half(w2[2]), __low2half(w2[3])));
      hi.x = as_u32(__halves2half2(__high2half(w2[0]), __high2half(w2[1])));
      hi.y = as_u32(__halves2half2(__high2half(w2[2]), __high2half(w2[3])));
      *reinterpret_cast<uint2*>(dst + P * width) = lo;
      *reinterpret_cast<uint2*>(dst + (P + 16) * width) = hi;
    } else {
      float2 f[4];
#pragma unroll
      for (int c = 0; c < 4; ++c) f[c] = __half22float2(w2[c]);
      *reinterpret_cast<float4*>(dst + P * width) = make_float4(f[0].x, f[1].x, f[2].x, f[3].x);
      *reinterpret_cast<float4*>(dst + (P + 16) * width) = make_float4(f[0].y, f[1].y, f[2].y, f[3].y);
    }
  });
}

#endif  // __CUDACC__

}  // namespace exl2::cuda::exl2t
