// CPU matmul_nt: y[n, out] = x[n, in] @ w[out, in]^T (+ bias), fp32 accumulation, the CPU hot path.
//
// n > kGemvMaxRows: GotoBLAS-style blocked GEMM. Output columns are cut into blocks of nc (a multiple of kNr)
// whose weight rows are converted to f32 and packed once, for the whole K, as panels [nc/kNr][K][kNr];
// rows of x are packed per (kMc x kKc) block as [kMc/kMr][kc][kMr]; a kMr x kNr register-tile micro-kernel
// (AVX2/FMA: 6x16 = 12 ymm accumulators) accumulates into a per-thread f32 tile, which is then stored with the
// bias added and converted to act. Tasks = (column block, row group), spread over the thread pool.
// n <= kGemvMaxRows (decode): weights are streamed once, each row of w dotted with every row of x; parallel
// over output columns.
#include <algorithm>
#include <vector>

#include "backend/cpu/cpu_common.h"
#include "backend/cpu/thread_pool.h"
#include "backend/kernels.h"

namespace exl2::cpu {
namespace {

constexpr int64_t kMr = 6;   // micro-tile rows (x rows)
constexpr int64_t kNr = 16;  // micro-tile columns (outputs): two 8-float vectors
constexpr int64_t kKc = 256;               // K block: A tile kMr*kKc and B tile kKc*kNr stay in L1 (6 KiB + 16 KiB)
constexpr int64_t kMc = 72;                // rows per A block (multiple of kMr)
constexpr int64_t kPackedBBytes = 384 << 10;  // packed weight block (K x nc f32) kept in L2
constexpr int64_t kGemvMaxRows = 4;

// C[kMr x kNr] (row stride ldc) (+)= A[kc][kMr]^T-panel * B[kc][kNr]-panel.
inline void micro_kernel(int64_t kc, const float* a, const float* b, float* c, int64_t ldc, bool accumulate) {
#ifdef EXL2_CPU_AVX2
  __m256 c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51;
  if (accumulate) {
    c00 = _mm256_loadu_ps(c + 0 * ldc), c01 = _mm256_loadu_ps(c + 0 * ldc + 8);
    c10 = _mm256_loadu_ps(c + 1 * ldc), c11 = _mm256_loadu_ps(c + 1 * ldc + 8);
    c20 = _mm256_loadu_ps(c + 2 * ldc), c21 = _mm256_loadu_ps(c + 2 * ldc + 8);
    c30 = _mm256_loadu_ps(c + 3 * ldc), c31 = _mm256_loadu_ps(c + 3 * ldc + 8);
    c40 = _mm256_loadu_ps(c + 4 * ldc), c41 = _mm256_loadu_ps(c + 4 * ldc + 8);
    c50 = _mm256_loadu_ps(c + 5 * ldc), c51 = _mm256_loadu_ps(c + 5 * ldc + 8);
  } else {
    c00 = c01 = c10 = c11 = c20 = c21 = c30 = c31 = c40 = c41 = c50 = c51 = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 b0 = _mm256_loadu_ps(b);
    const __m256 b1 = _mm256_loadu_ps(b + 8);
    __m256 av;
    av = _mm256_broadcast_ss(a + 0), c00 = _mm256_fmadd_ps(av, b0, c00), c01 = _mm256_fmadd_ps(av, b1, c01);
    av = _mm256_broadcast_ss(a + 1), c10 = _mm256_fmadd_ps(av, b0, c10), c11 = _mm256_fmadd_ps(av, b1, c11);
    av = _mm256_broadcast_ss(a + 2), c20 = _mm256_fmadd_ps(av, b0, c20), c21 = _mm256_fmadd_ps(av, b1, c21);
    av = _mm256_broadcast_ss(a + 3), c30 = _mm256_fmadd_ps(av, b0, c30), c31 = _mm256_fmadd_ps(av, b1, c31);
    av = _mm256_broadcast_ss(a + 4), c40 = _mm256_fmadd_ps(av, b0, c40), c41 = _mm256_fmadd_ps(av, b1, c41);
    av = _mm256_broadcast_ss(a + 5), c50 = _mm256_fmadd_ps(av, b0, c50), c51 = _mm256_fmadd_ps(av, b1, c51);
    a += kMr;
    b += kNr;
  }
  _mm256_storeu_ps(c + 0 * ldc, c00), _mm256_storeu_ps(c + 0 * ldc + 8, c01);
  _mm256_storeu_ps(c + 1 * ldc, c10), _mm256_storeu_ps(c + 1 * ldc + 8, c11);
  _mm256_storeu_ps(c + 2 * ldc, c20), _mm256_storeu_ps(c + 2 * ldc + 8, c21);
  _mm256_storeu_ps(c + 3 * ldc, c30), _mm256_storeu_ps(c + 3 * ldc + 8, c31);
  _mm256_storeu_ps(c + 4 * ldc, c40), _mm256_storeu_ps(c + 4 * ldc + 8, c41);
  _mm256_storeu_ps(c + 5 * ldc, c50), _mm256_storeu_ps(c + 5 * ldc + 8, c51);
#else
  float acc[kMr][kNr];
  for (int64_t i = 0; i < kMr; ++i)
    for (int64_t j = 0; j < kNr; ++j) acc[i][j] = accumulate ? c[i * ldc + j] : 0.0f;
  for (int64_t k = 0; k < kc; ++k) {
    for (int64_t i = 0; i < kMr; ++i) {
      const float av = a[i];
      for (int64_t j = 0; j < kNr; ++j) acc[i][j] += av * b[j];
    }
    a += kMr;
    b += kNr;
  }
  for (int64_t i = 0; i < kMr; ++i)
    for (int64_t j = 0; j < kNr; ++j) c[i * ldc + j] = acc[i][j];
#endif
}

// Packs weight rows [j0, j0+nc) (zero rows past `out`) as panels bp[nc/kNr][k_dim][kNr] of f32.
void pack_b(const void* w, DType w_dtype, int64_t k_dim, int64_t out, int64_t j0, int64_t nc, float* bp,
            std::vector<float>& row) {
  row.resize(static_cast<size_t>(k_dim));
  for (int64_t jj = 0; jj < nc; ++jj) {
    float* panel = bp + (jj / kNr) * k_dim * kNr + (jj % kNr);
    const int64_t j = j0 + jj;
    if (j >= out) {
      for (int64_t k = 0; k < k_dim; ++k) panel[k * kNr] = 0.0f;
      continue;
    }
    detail::row_to_f32(detail::at(w, w_dtype, j * k_dim), w_dtype, k_dim, row.data());
    for (int64_t k = 0; k < k_dim; ++k) panel[k * kNr] = row[k];
  }
}

// Packs x rows [i0, i0+mc) (f32, row stride k_dim), columns [p0, p0+kc), as ap[ceil(mc/kMr)][kc][kMr].
void pack_a(const float* x, int64_t k_dim, int64_t i0, int64_t mc, int64_t p0, int64_t kc, float* ap) {
  for (int64_t ib = 0; ib < mc; ib += kMr) {
    float* dst = ap + (ib / kMr) * kc * kMr;
    for (int64_t r = 0; r < kMr; ++r) {
      if (ib + r < mc) {
        const float* src = x + (i0 + ib + r) * k_dim + p0;
        for (int64_t k = 0; k < kc; ++k) dst[k * kMr + r] = src[k];
      } else {
        for (int64_t k = 0; k < kc; ++k) dst[k * kMr + r] = 0.0f;
      }
    }
  }
}

void gemm(const float* x, const void* w, DType w_dtype, const float* bias, void* y, int64_t n, int64_t k_dim,
          int64_t out, DType act) {
  const int64_t threads = num_threads();
  // Column block: fits kPackedBBytes as f32 over the whole K, and leaves >= 2 blocks per thread when possible.
  int64_t nc = std::max<int64_t>(kNr, (kPackedBBytes / (k_dim * 4)) / kNr * kNr);
  nc = std::min<int64_t>(nc, 256);
  const int64_t nc_balanced = ((out + 2 * threads - 1) / (2 * threads) + kNr - 1) / kNr * kNr;
  nc = std::max<int64_t>(kNr, std::min(nc, nc_balanced));
  const int64_t n_col_blocks = (out + nc - 1) / nc;
  const int64_t n_row_blocks = (n + kMc - 1) / kMc;
  // Split rows only when column blocks alone cannot occupy the threads (weight packing is then repeated).
  const int64_t n_row_groups =
      std::max<int64_t>(1, std::min(n_row_blocks, (2 * threads + n_col_blocks - 1) / n_col_blocks));
  const int64_t blocks_per_group = (n_row_blocks + n_row_groups - 1) / n_row_groups;

  parallel_for(n_col_blocks * n_row_groups, [&](int64_t t0, int64_t t1) {
    thread_local std::vector<float> bp, ap, cbuf, row;
    bp.resize(static_cast<size_t>(nc * k_dim));
    ap.resize(static_cast<size_t>(kMc * kKc));
    cbuf.resize(static_cast<size_t>(kMc * nc));
    int64_t packed_block = -1;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t cb = t / n_row_groups, rg = t % n_row_groups;
      const int64_t j0 = cb * nc, ncols = std::min(nc, out - j0);
      const int64_t ncp = (ncols + kNr - 1) / kNr * kNr;  // padded to panels
      if (packed_block != cb) {
        pack_b(w, w_dtype, k_dim, out, j0, ncp, bp.data(), row);
        packed_block = cb;
      }
      const int64_t r_begin = rg * blocks_per_group * kMc, r_end = std::min(n, (rg + 1) * blocks_per_group * kMc);
      for (int64_t i0 = r_begin; i0 < r_end; i0 += kMc) {
        const int64_t mc = std::min(kMc, r_end - i0);
        for (int64_t p0 = 0; p0 < k_dim; p0 += kKc) {
          const int64_t kc = std::min(kKc, k_dim - p0);
          pack_a(x, k_dim, i0, mc, p0, kc, ap.data());
          for (int64_t jr = 0; jr < ncp; jr += kNr) {
            const float* bpanel = bp.data() + (jr / kNr) * k_dim * kNr + p0 * kNr;
            for (int64_t ir = 0; ir < mc; ir += kMr)
              micro_kernel(kc, ap.data() + (ir / kMr) * kc * kMr, bpanel, cbuf.data() + ir * nc + jr, nc, p0 > 0);
          }
        }
        for (int64_t r = 0; r < mc; ++r) {
          float* crow = cbuf.data() + r * nc;
          if (bias)
            for (int64_t j = 0; j < ncols; ++j) crow[j] += bias[j0 + j];
          detail::row_from_f32(crow, ncols, detail::at(y, act, (i0 + r) * out + j0), act);
        }
      }
    }
  });
}

#ifdef EXL2_CPU_AVX2
inline __m256 load8_w(const void* w, DType dt, int64_t i) {
  switch (dt) {
    case DType::F32: return _mm256_loadu_ps(static_cast<const float*>(w) + i);
    case DType::F16:
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(w) + i)));
    default: {
      const __m256i v =
          _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(w) + i)));
      return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    }
  }
}
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// Rows of x dotted with one weight row; R = rows of x (1..kGemvMaxRows), templated so accumulators stay in
// registers. The dtype switch is hoisted by instantiating per weight dtype.
template <int R, DType WD>
void gemv_rows(const float* x, const void* w, const float* bias, float* yf, int64_t k_dim, int64_t out,
               int64_t o_begin, int64_t o_end) {
  for (int64_t o = o_begin; o < o_end; ++o) {
    const void* wrow = detail::at(w, WD, o * k_dim);
    float sums[R];
    int64_t k = 0;
#ifdef EXL2_CPU_AVX2
    __m256 acc0[R], acc1[R];
    for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
    for (; k + 16 <= k_dim; k += 16) {
      const __m256 w0 = load8_w(wrow, WD, k), w1 = load8_w(wrow, WD, k + 8);
      for (int r = 0; r < R; ++r) {
        acc0[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * k_dim + k), w0, acc0[r]);
        acc1[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * k_dim + k + 8), w1, acc1[r]);
      }
    }
    for (int r = 0; r < R; ++r) sums[r] = hsum(_mm256_add_ps(acc0[r], acc1[r]));
#else
    for (int r = 0; r < R; ++r) sums[r] = 0.0f;
#endif
    for (; k < k_dim; ++k) {
      const float wv = detail::load_one(wrow, WD, k);
      for (int r = 0; r < R; ++r) sums[r] += x[r * k_dim + k] * wv;
    }
    for (int r = 0; r < R; ++r) yf[r * out + o] = sums[r] + (bias ? bias[o] : 0.0f);
  }
}

template <int R>
void gemv_dispatch(const float* x, const void* w, DType wd, const float* bias, float* yf, int64_t k_dim,
                   int64_t out, int64_t b, int64_t e) {
  switch (wd) {
    case DType::F32: gemv_rows<R, DType::F32>(x, w, bias, yf, k_dim, out, b, e); break;
    case DType::F16: gemv_rows<R, DType::F16>(x, w, bias, yf, k_dim, out, b, e); break;
    default: gemv_rows<R, DType::BF16>(x, w, bias, yf, k_dim, out, b, e); break;
  }
}

void gemv(const float* x, const void* w, DType w_dtype, const float* bias, void* y, int64_t n, int64_t k_dim,
          int64_t out, DType act) {
  std::vector<float> yf_buf;
  float* yf = static_cast<float*>(y);
  if (act != DType::F32) {
    yf_buf.resize(static_cast<size_t>(n * out));
    yf = yf_buf.data();
  }
  // ~64 KiB of weights per range keeps scheduling overhead small next to the memory traffic.
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(1, k_dim * 2));
  parallel_for(out, grain, [&](int64_t b, int64_t e) {
    switch (n) {
      case 1: gemv_dispatch<1>(x, w, w_dtype, bias, yf, k_dim, out, b, e); break;
      case 2: gemv_dispatch<2>(x, w, w_dtype, bias, yf, k_dim, out, b, e); break;
      case 3: gemv_dispatch<3>(x, w, w_dtype, bias, yf, k_dim, out, b, e); break;
      default: gemv_dispatch<4>(x, w, w_dtype, bias, yf, k_dim, out, b, e); break;
    }
  });
  if (act != DType::F32) detail::row_from_f32(yf, n * out, y, act);
}

}  // namespace

void matmul_nt(const void* x, const void* w, DType w_dtype, const void* bias, DType bias_dtype, void* y, int64_t n,
               int64_t in, int64_t out, DType act) {
  if (n <= 0 || out <= 0) return;
  std::vector<float> xf_buf, bias_buf;
  const float* xf = static_cast<const float*>(x);
  if (act != DType::F32) {
    xf_buf.resize(static_cast<size_t>(n * in));
    detail::row_to_f32(x, act, n * in, xf_buf.data());
    xf = xf_buf.data();
  }
  const float* bf = nullptr;
  if (bias) {
    bias_buf.resize(static_cast<size_t>(out));
    detail::row_to_f32(bias, bias_dtype, out, bias_buf.data());
    bf = bias_buf.data();
  }
  if (in == 0) {  // empty reduction: y = bias (or 0)
    std::vector<float> row(static_cast<size_t>(out), 0.0f);
    if (bf) row.assign(bf, bf + out);
    for (int64_t i = 0; i < n; ++i) detail::row_from_f32(row.data(), out, detail::at(y, act, i * out), act);
    return;
  }
  if (n <= kGemvMaxRows)
    gemv(xf, w, w_dtype, bf, y, n, in, out, act);
  else
    gemm(xf, w, w_dtype, bf, y, n, in, out, act);
}

}  // namespace exl2::cpu
