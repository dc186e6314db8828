// CPU matmul_nt: y[n, out] = x[n, in] @ w[out, in]^T (+ bias), fp32 accumulation, the CPU hot path.
//
// n > kGemvMaxRows: GotoBLAS-style blocked GEMM. Output columns are cut into blocks of nc (a multiple of kNr)
// whose weight rows are converted to f32 and packed once, for the whole K, as panels [nc/kNr][K][kNr];
// rows of x are packed per (kMc x kKc) block as [kMc/kMr][kc][kMr]; a kMr x kNr register-tile micro-kernel
// (6 x 2 vectors = 12 accumulators: 6x16 with AVX2, 6x32 with AVX-512) accumulates into a per-thread f32 tile, which is then stored with the
// bias added and converted to act. Tasks = (column block, row group), spread over the thread pool.
// n <= kGemvMaxRows (decode): weights are streamed once, each row of w dotted with every row of x; parallel
// over output columns.
#include <algorithm>
#include <vector>

#include "backend/cpu/cpu_common.h"
#include "backend/cpu/thread_pool.h"
#include "backend/cpu/isa.h"
#include "backend/kernels.h"

namespace exl2::cpu {
EXL2_CPU_ISA_BEGIN
namespace {

#ifdef EXL2_CPU_AVX2
constexpr int64_t kNr = 2 * detail::kVecW;  // micro-tile columns (outputs): two vectors (16 floats AVX2, 32 AVX-512)
#else
constexpr int64_t kNr = 16;
#endif
constexpr int64_t kMr = 6;               // micro-tile rows (x rows): kMr x 2 accumulators (12 registers)
constexpr int64_t kKc = 256 * 16 / kNr;  // K block: A tile kMr*kKc and B tile kKc*kNr (16 KiB) stay in L1
constexpr int64_t kMc = 72;                   // rows per A block (multiple of kMr)
constexpr int64_t kPackedBBytes = 384 << 10;  // packed weight block (K x nc f32) kept in L2
constexpr int64_t kGemvMaxRows = 4;

// C[kMr x kNr] (row stride ldc) (+)= A[kc][kMr]^T-panel * B[kc][kNr]-panel.
inline void micro_kernel(int64_t kc, const float* a, const float* b, float* c, int64_t ldc, bool accumulate) {
#ifdef EXL2_CPU_AVX2
  using namespace detail;
  VecF acc[kMr][2];  // kMr x 2 vector accumulators, kept in registers (the loops over them are unrolled)
#pragma GCC unroll 8
  for (int64_t i = 0; i < kMr; ++i) {
    acc[i][0] = accumulate ? vload(c + i * ldc) : vzero();
    acc[i][1] = accumulate ? vload(c + i * ldc + kVecW) : vzero();
  }
  for (int64_t k = 0; k < kc; ++k) {
    const VecF b0 = vload(b), b1 = vload(b + kVecW);
#pragma GCC unroll 8
    for (int64_t i = 0; i < kMr; ++i) {
      const VecF av = vset1(a[i]);
      acc[i][0] = vfma(av, b0, acc[i][0]);
      acc[i][1] = vfma(av, b1, acc[i][1]);
    }
    a += kMr;
    b += kNr;
  }
#pragma GCC unroll 8
  for (int64_t i = 0; i < kMr; ++i) {
    vstore(c + i * ldc, acc[i][0]);
    vstore(c + i * ldc + kVecW, acc[i][1]);
  }
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
// kVecW weights from element i of a row of dtype dt, as f32.
inline detail::VecF load_w(const void* w, DType dt, int64_t i) {
  switch (dt) {
    case DType::F32:
      return detail::vload(static_cast<const float*>(w) + i);
    case DType::F16:
      return detail::vload_f16(static_cast<const uint16_t*>(w) + i);
    default:
      return detail::vload_bf16(static_cast<const uint16_t*>(w) + i);
  }
}
#endif

// Rows of x dotted with one weight row; R = rows of x (1..kGemvMaxRows), templated so accumulators stay in
// registers. The dtype switch is hoisted by instantiating per weight dtype.
template <int R, DType WD>
void gemv_rows(const float* x, const void* w, const float* bias, float* yf, int64_t k_dim, int64_t out, int64_t o_begin,
               int64_t o_end) {
  for (int64_t o = o_begin; o < o_end; ++o) {
    const void* wrow = detail::at(w, WD, o * k_dim);
    float sums[R];
    int64_t k = 0;
#ifdef EXL2_CPU_AVX2
    using namespace detail;
    VecF acc0[R], acc1[R];
    for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = vzero();
    for (; k + 2 * kVecW <= k_dim; k += 2 * kVecW) {
      const VecF w0 = load_w(wrow, WD, k), w1 = load_w(wrow, WD, k + kVecW);
      for (int r = 0; r < R; ++r) {
        acc0[r] = vfma(vload(x + r * k_dim + k), w0, acc0[r]);
        acc1[r] = vfma(vload(x + r * k_dim + k + kVecW), w1, acc1[r]);
      }
    }
    for (int r = 0; r < R; ++r) sums[r] = vhsum(vadd(acc0[r], acc1[r]));
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
void gemv_dispatch(const float* x, const void* w, DType wd, const float* bias, float* yf, int64_t k_dim, int64_t out,
                   int64_t b, int64_t e) {
  switch (wd) {
    case DType::F32:
      gemv_rows<R, DType::F32>(x, w, bias, yf, k_dim, out, b, e);
      break;
    case DType::F16:
      gemv_rows<R, DType::F16>(x, w, bias, yf, k_dim, out, b, e);
      break;
    default:
      gemv_rows<R, DType::BF16>(x, w, bias, yf, k_dim, out, b, e);
      break;
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
      case 1:
        gemv_dispatch<1>(x, w, w_dtype, bias, yf, k_dim, out, b, e);
        break;
      case 2:
        gemv_dispatch<2>(x, w, w_dtype, bias, yf, k_dim, out, b, e);
        break;
      case 3:
        gemv_dispatch<3>(x, w, w_dtype, bias, yf, k_dim, out, b, e);
        break;
      default:
        gemv_dispatch<4>(x, w, w_dtype, bias, yf, k_dim, out, b, e);
        break;
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

EXL2_CPU_ISA_END

#ifdef EXL2_CPU_ISA_DISPATCHER
EXL2_CPU_ISA_DECLARE(EXL2_BACKEND_KERNELS)

void matmul_nt(const void* x, const void* w, DType w_dtype, const void* bias, DType bias_dtype, void* y, int64_t n,
               int64_t in, int64_t out, DType act) {
  EXL2_CPU_DISPATCH(matmul_nt, x, w, w_dtype, bias, bias_dtype, y, n, in, out, act);
}
#endif

}  // namespace exl2::cpu
