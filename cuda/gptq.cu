// cuda::gptq_quantize and cuda::gptq_hessian (contracts and the exact arithmetic in cpp/quant/gptq.h): per group a
// column-max kernel, the scale search (grid points x column chunks, fp64 partial sums in the CPU's order, then a
// one-thread select; hmse: row weights first, a per-column code search after), the row loop (8 threads per output column over the group in shared memory; one thread per
// column for groups over 256 rows or with option gptq_rowloop_smem off) and the trailing update (a tiled fp32 kernel
// that keeps the CPU's summation order, so codes match the CPU bit for bit). No host sync until the end.
#include <algorithm>
#include <cfloat>
#include <climits>
#include <cstdlib>
#include <string>

#include "cuda/common.cuh"
#include "exl2/options.h"
#include "quant/gptq.h"

namespace exl2::cuda {

namespace {

struct GptqState {
  unsigned int smax_bits;  // max base_j as float bits (positive floats order like their bits)
  int best_coarse;
  float msc;               // fp16(float(q_scale_max) / 256) of the current group
  int bad_group;           // first group whose q_scale_max overflowed, else INT_MAX
  float bad_value;
};

__device__ __forceinline__ float f16_round(float v) { return __half2float(__float2half_rn(v)); }
__device__ __forceinline__ float grid_p(int i) { return static_cast<float>(0.70 + 0.50 * double(i) / kGptqGrid); }

__device__ __forceinline__ float qs_of(float base, float smax) {
  const float q = rintf(__fmul_rn(16.0f, __fsqrt_rn(__fdiv_rn(base, smax))));
  return fminf(16.0f, fmaxf(1.0f, q));
}

__global__ void colbase_kernel(const float* __restrict__ w, int64_t rows, int64_t out, float den,
                               float* __restrict__ base, GptqState* st) {
  const int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (j >= out) return;
  float m = 0.f;
  for (int64_t r = 0; r < rows; ++r) m = fmaxf(m, fabsf(w[r * out + j]));
  const float b = __fdiv_rn(__fadd_rn(m, 1e-12f), den);
  base[j] = b;
  atomicMax(&st->smax_bits, __float_as_uint(b));
}

// grid (n_chunks, n_points): partial[point][chunk] = the chunk's tree sum of err terms for grid point
// i = 4 * point (coarse) or best_coarse - 3 + point (fine; out of range -> +inf).
__global__ void search_kernel(const float* __restrict__ w, int64_t rows, int64_t out, int bits,
                              const float* __restrict__ base, const GptqState* st, bool fine,
                              const float* __restrict__ h, bool hmse, double* __restrict__ partial) {
  __shared__ double slot[kGptqChunk];
  const int t = threadIdx.x;
  const int64_t n_chunks = gridDim.x;
  int i = fine ? st->best_coarse - 3 + int(blockIdx.y) : 4 * int(blockIdx.y);
  if (i < 0 || i > kGptqGrid) {
    if (t == 0) partial[blockIdx.y * n_chunks + blockIdx.x] = DBL_MAX;
    return;
  }
  const int maxq = (1 << bits) - 1;
  const float lo = -float(1 << (bits - 1)), hi = float(maxq - (1 << (bits - 1)));
  const float smax = __uint_as_float(st->smax_bits);
  const float p = grid_p(i);
  const int64_t j = int64_t(blockIdx.x) * kGptqChunk + t;
  double acc = 0.0;
  if (j < out) {
    const float qs16 = __fdiv_rn(qs_of(base[j], smax), 16.0f);
    const float sp = __fmul_rn(__fmul_rn(__fmul_rn(qs16, qs16), smax), p);
    for (int64_t r = 0; r < rows; ++r) {
      const float x = w[r * out + j];
      const float q = fminf(hi, fmaxf(lo, rintf(__fdiv_rn(x, sp))));
      const float d = fabsf(__fsub_rn(__fmul_rn(q, sp), x));
      const float d2 = __fmul_rn(d, d);
      const float f = hmse ? h[r] : __fmul_rn(__fsqrt_rn(d), d);
      acc = __dadd_rn(acc, __dmul_rn(double(d2), double(f)));
    }
  }
  slot[t] = acc;
  __syncthreads();
  for (int s = kGptqChunk / 2; s > 0; s >>= 1) {
    if (t < s) slot[t] = __dadd_rn(slot[t], slot[t + s]);
    __syncthreads();
  }
  if (t == 0) partial[blockIdx.y * n_chunks + blockIdx.x] = slot[0];
}

__device__ double point_err(const double* partial, int point, int64_t n_chunks) {
  double e = 0.0;
  for (int64_t c = 0; c < n_chunks; ++c) e = __dadd_rn(e, partial[point * n_chunks + c]);
  return e;
}

// One thread. Coarse: best_coarse. Fine (given the coarse partials too): q_scale_max and msc of group g.
__global__ void select_kernel(const double* __restrict__ coarse, const double* __restrict__ finep, int64_t n_chunks,
                              bool fine, int g, uint16_t* __restrict__ q_scale_max, GptqState* st) {
  if (!fine) {
    int best = 0;
    double be = point_err(coarse, 0, n_chunks);
    for (int k = 1; k * 4 <= kGptqGrid; ++k) {
      const double e = point_err(coarse, k, n_chunks);
      if (e < be) be = e, best = 4 * k;
    }
    st->best_coarse = best;
    return;
  }
  const int c = st->best_coarse;
  const int lo = max(0, c - 3), hi = min(kGptqGrid, c + 3);
  int best = lo;
  double be = point_err(finep, lo - (c - 3), n_chunks);
  for (int i = lo + 1; i <= hi; ++i) {
    const double e = point_err(finep, i - (c - 3), n_chunks);
    if (e < be) be = e, best = i;
  }
  const float qsm = __fmul_rn(__uint_as_float(st->smax_bits), grid_p(best));
  if (!(qsm <= 65504.f)) {  // also NaN
    if (g < st->bad_group) st->bad_group = g, st->bad_value = qsm;
  }
  const __half h = __float2half_rn(qsm);
  q_scale_max[g] = __half_as_ushort(h);
  st->msc = f16_round(__fmul_rn(__half2float(h), 1.0f / 256.0f));
}

// h[r] = 1 / U[a+r, a+r]^2 for the group's rows (the hmse search's row weights).
__global__ void rowweight_kernel(const float* __restrict__ u, int64_t in, int64_t a, int64_t rows,
                                 float* __restrict__ h) {
  const int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (r >= rows) return;
  const float ucc = u[(a + r) * in + (a + r)];
  h[r] = __fdiv_rn(1.0f, __fmul_rn(ucc, ucc));
}

// One thread per column: hmse's per-column code (header), written to qsel[j].
__global__ void refine_kernel(const float* __restrict__ w, int64_t rows, int64_t out, int bits,
                              const float* __restrict__ h, const GptqState* st, float* __restrict__ qsel) {
  const int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (j >= out) return;
  const int maxq = (1 << bits) - 1;
  const float z = float(1 << (bits - 1)), fmaxq = float(maxq);
  const float msc = st->msc;
  double best_e = 0.0;
  float best_n = 0.f;
  for (int n = 1; n <= 16; ++n) {
    const float fn = float(n);
    const float scale = f16_round(__fmul_rn(__fmul_rn(fn, fn), msc));
    double e = 0.0;
    for (int64_t r = 0; r < rows; ++r) {
      const float x = w[r * out + j];
      float dq = 0.f;
      if (scale > 0.f) {
        const float q = fminf(fmaxq, fmaxf(0.f, __fadd_rn(rintf(__fdiv_rn(x, scale)), z)));
        dq = f16_round(__fmul_rn(__fsub_rn(q, z), scale));
      }
      const float d = __fsub_rn(x, dq);
      e = __dadd_rn(e, __dmul_rn(double(__fmul_rn(d, d)), double(h[r])));
    }
    if (n == 1 || e < best_e) best_e = e, best_n = fn;
  }
  qsel[j] = best_n;
}

// One thread per output column: the group's row loop (header: "row loop"). qsel: the columns' codes (hmse), or
// nullptr to take them from the column maxima.
__global__ void rowloop_kernel(float* __restrict__ w, const float* __restrict__ u, int64_t in, int64_t out, int64_t a,
                               int64_t b, int bits, const float* __restrict__ base, const GptqState* st,
                               const float* __restrict__ qsel, uint8_t* __restrict__ codes, float* __restrict__ deq,
                               float* __restrict__ err, uint8_t* __restrict__ nibbles) {
  const int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (j >= out) return;
  const int maxq = (1 << bits) - 1;
  const float z = float(1 << (bits - 1)), fmaxq = float(maxq);
  const float qs = qsel ? qsel[j] : qs_of(base[j], __uint_as_float(st->smax_bits));
  nibbles[j] = static_cast<uint8_t>(qs - 1.0f);
  const float scale = f16_round(__fmul_rn(__fmul_rn(qs, qs), st->msc));
  for (int64_t c = a; c < b; ++c) {
    const float x = w[c * out + j];
    float q = z, dq = 0.f;
    if (scale > 0.f) {
      q = fminf(fmaxq, fmaxf(0.f, __fadd_rn(rintf(__fdiv_rn(x, scale)), z)));
      dq = f16_round(__fmul_rn(__fsub_rn(q, z), scale));
    }
    const float e = __fdiv_rn(__fsub_rn(x, dq), u[c * in + c]);
    codes[c * out + j] = static_cast<uint8_t>(q);
    deq[c * out + j] = dq;
    err[(c - a) * out + j] = e;
    for (int64_t r = c + 1; r < b; ++r) w[r * out + j] = __fsub_rn(w[r * out + j], __fmul_rn(u[c * in + r], e));
  }
}

// The same row loop with 8 threads per column (kRlLanes lanes x kRlCols columns per block): the group's rows of
// w live in shared memory, row r belongs to lane r % kRlLanes; per row c the owner quantizes it and publishes e,
// then every lane applies w[r] -= U[c, r] * e to its rows r > c. Each w[r, j] sees the same ops in the same order
// (c increasing) as in rowloop_kernel, so the results are identical; the serial chain per column shrinks from
// rows^2/2 global read-modify-writes to rows steps of one barrier + rows/8 shared-memory updates.
constexpr int kRlCols = 32, kRlLanes = 8, kRlMaxRows = 256;

__global__ void rowloop_smem_kernel(const float* __restrict__ w, const float* __restrict__ u, int64_t in, int64_t out,
                                    int64_t a, int64_t b, int bits, const float* __restrict__ base,
                                    const GptqState* st, const float* __restrict__ qsel,
                                    uint8_t* __restrict__ codes, float* __restrict__ deq, float* __restrict__ err,
                                    uint8_t* __restrict__ nibbles) {
  extern __shared__ float sm[];
  const int rows = int(b - a);
  float* ws = sm;                     // [rows][kRlCols]
  float* es = sm + rows * kRlCols;    // [2][kRlCols]
  const int tx = threadIdx.x % kRlCols, ty = threadIdx.x / kRlCols;
  const int64_t j = int64_t(blockIdx.x) * kRlCols + tx;
  const bool ok = j < out;
  for (int r = ty; r < rows; r += kRlLanes) ws[r * kRlCols + tx] = ok ? w[(a + r) * out + j] : 0.f;
  const int maxq = (1 << bits) - 1;
  const float z = float(1 << (bits - 1)), fmaxq = float(maxq);
  float scale = 0.f;
  if (ok) {
    const float qs = qsel ? qsel[j] : qs_of(base[j], __uint_as_float(st->smax_bits));
    if (ty == 0) nibbles[j] = static_cast<uint8_t>(qs - 1.0f);
    scale = f16_round(__fmul_rn(__fmul_rn(qs, qs), st->msc));
  }
  __syncthreads();
  for (int c = 0; c < rows; ++c) {
    if (c % kRlLanes == ty) {
      const float x = ws[c * kRlCols + tx];
      float q = z, dq = 0.f;
      if (scale > 0.f) {
        q = fminf(fmaxq, fmaxf(0.f, __fadd_rn(rintf(__fdiv_rn(x, scale)), z)));
        dq = f16_round(__fmul_rn(__fsub_rn(q, z), scale));
      }
      const float e = __fdiv_rn(__fsub_rn(x, dq), u[(a + c) * in + (a + c)]);
      if (ok) {
        codes[(a + c) * out + j] = static_cast<uint8_t>(q);
        deq[(a + c) * out + j] = dq;
        err[int64_t(c) * out + j] = e;
      }
      es[(c & 1) * kRlCols + tx] = e;
    }
    __syncthreads();
    const float e = es[(c & 1) * kRlCols + tx];
    const float* uc = u + (a + c) * in + a;
    const int first = c + 1 + ((ty - (c + 1)) % kRlLanes + kRlLanes) % kRlLanes;
    for (int r = first; r < rows; r += kRlLanes)
      ws[r * kRlCols + tx] = __fsub_rn(ws[r * kRlCols + tx], __fmul_rn(uc[r], e));
  }
}

// Option gptq_rowloop_smem false selects rowloop_kernel for every group (default: rowloop_smem_kernel for groups of
// at most kRlMaxRows rows).
bool legacy_rowloop() { return !runtime_options().gptq_rowloop_smem; }

constexpr int kTm = 64, kTn = 64, kTk = 16;  // trailing-update tile; 256 threads, 4x4 outputs each

// w[r, j] -= sum_{k in [a, b)} U[k, r] * E[k - a, j] for r in [b, in), summed in increasing k (header).
__global__ void trailing_kernel(float* __restrict__ w, const float* __restrict__ u, const float* __restrict__ err,
                                int64_t in, int64_t out, int64_t a, int64_t b) {
  __shared__ float us[kTk][kTm];
  __shared__ float es[kTk][kTn];
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int64_t r0 = b + int64_t(blockIdx.y) * kTm, j0 = int64_t(blockIdx.x) * kTn;
  float acc[4][4] = {};
  for (int64_t k0 = a; k0 < b; k0 += kTk) {
    for (int idx = threadIdx.x; idx < kTk * kTm; idx += 256) {
      const int kk = idx / kTm, rr = idx % kTm;
      const int64_t k = k0 + kk, r = r0 + rr;
      us[kk][rr] = (k < b && r < in) ? u[k * in + r] : 0.f;
      const int64_t jj = j0 + rr;  // kTn == kTm
      es[kk][rr] = (k < b && jj < out) ? err[(k - a) * out + jj] : 0.f;
    }
    __syncthreads();
    const int kn = b - k0 < kTk ? int(b - k0) : kTk;
    for (int kk = 0; kk < kn; ++kk) {
      float uv[4], ev[4];
#pragma unroll
      for (int m = 0; m < 4; ++m) uv[m] = us[kk][ty * 4 + m], ev[m] = es[kk][tx * 4 + m];
#pragma unroll
      for (int m = 0; m < 4; ++m)
#pragma unroll
        for (int n = 0; n < 4; ++n) acc[m][n] = __fadd_rn(acc[m][n], __fmul_rn(uv[m], ev[n]));
    }
    __syncthreads();
  }
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    const int64_t r = r0 + ty * 4 + m;
    if (r >= in) continue;
#pragma unroll
    for (int n = 0; n < 4; ++n) {
      const int64_t j = j0 + tx * 4 + n;
      if (j < out) w[r * out + j] = __fsub_rn(w[r * out + j], acc[m][n]);
    }
  }
}

int device_of(const void* p) {
  cudaPointerAttributes attr{};
  EXL2_CUDA_CHECK(cudaPointerGetAttributes(&attr, p));
  return attr.device;
}

}  // namespace

void gptq_quantize(float* w, const float* u, const int* group_bits, const int64_t* group_rows, int64_t n_groups,
                   int64_t in, int64_t out, uint8_t* codes, uint8_t* nibbles, uint16_t* q_scale_max, float* deq,
                   GptqSearch search) {
  DeviceGuard guard(device_of(w));
  const Device dev = Device::cuda(device_of(w));
  cudaStream_t stream = current_stream();
  int64_t max_rows = 0;
  for (int64_t g = 0; g < n_groups; ++g) max_rows = std::max(max_rows, group_rows[g]);
  const int64_t n_chunks = ceil_div(out, int64_t(kGptqChunk));
  const int n_coarse = kGptqGrid / 4 + 1, n_fine = 7;
  Tensor err = Tensor::empty({max_rows, out}, DType::F32, dev);
  Tensor base = Tensor::empty({out}, DType::F32, dev);
  const bool hmse = search == GptqSearch::kHessianMse;
  Tensor hrow = Tensor::empty({hmse ? max_rows : 1}, DType::F32, dev);
  Tensor qsel = Tensor::empty({hmse ? out : 1}, DType::F32, dev);
  const float* qsel_p = hmse ? qsel.data_as<float>() : nullptr;
  // fp64 partials: allocated as f32 pairs (Tensor has no f64)
  Tensor partial = Tensor::empty({2 * (n_coarse + n_fine) * n_chunks}, DType::F32, dev);
  double* pc = static_cast<double*>(partial.data());
  double* pf = pc + n_coarse * n_chunks;
  Tensor state = Tensor::empty({int64_t(sizeof(GptqState))}, DType::U8, dev);
  auto* st = static_cast<GptqState*>(state.data());
  GptqState init{0u, 0, 0.f, INT_MAX, 0.f};
  EXL2_CUDA_CHECK(cudaMemcpyAsync(st, &init, sizeof(init), cudaMemcpyHostToDevice, stream));
  constexpr int kThreads = 128;
  const unsigned col_blocks = static_cast<unsigned>(ceil_div(out, int64_t(kThreads)));
  int64_t a = 0;
  for (int64_t g = 0; g < n_groups; ++g) {
    const int bits = group_bits[g];
    const int64_t rows = group_rows[g], b = a + rows;
    const float den = static_cast<float>(static_cast<double>((1 << bits) - 1) / 2.0);
    float* wg = w + a * out;
    EXL2_CUDA_CHECK(cudaMemsetAsync(&st->smax_bits, 0, sizeof(unsigned int), stream));
    colbase_kernel<<<col_blocks, kThreads, 0, stream>>>(wg, rows, out, den, base.data_as<float>(), st);
    EXL2_CUDA_LAUNCH_CHECK("gptq colbase_kernel");
    if (hmse) {
      rowweight_kernel<<<unsigned(ceil_div(rows, int64_t(kThreads))), kThreads, 0, stream>>>(u, in, a, rows,
                                                                                             hrow.data_as<float>());
      EXL2_CUDA_LAUNCH_CHECK("gptq rowweight_kernel");
    }
    search_kernel<<<dim3(unsigned(n_chunks), n_coarse), kGptqChunk, 0, stream>>>(
        wg, rows, out, bits, base.data_as<float>(), st, false, hrow.data_as<float>(), hmse, pc);
    EXL2_CUDA_LAUNCH_CHECK("gptq search_kernel (coarse)");
    select_kernel<<<1, 1, 0, stream>>>(pc, pf, n_chunks, false, int(g), q_scale_max, st);
    EXL2_CUDA_LAUNCH_CHECK("gptq select_kernel (coarse)");
    search_kernel<<<dim3(unsigned(n_chunks), n_fine), kGptqChunk, 0, stream>>>(
        wg, rows, out, bits, base.data_as<float>(), st, true, hrow.data_as<float>(), hmse, pf);
    EXL2_CUDA_LAUNCH_CHECK("gptq search_kernel (fine)");
    select_kernel<<<1, 1, 0, stream>>>(pc, pf, n_chunks, true, int(g), q_scale_max, st);
    EXL2_CUDA_LAUNCH_CHECK("gptq select_kernel (fine)");
    if (hmse) {
      refine_kernel<<<col_blocks, kThreads, 0, stream>>>(wg, rows, out, bits, hrow.data_as<float>(), st,
                                                         qsel.data_as<float>());
      EXL2_CUDA_LAUNCH_CHECK("gptq refine_kernel");
    }
    if (rows <= kRlMaxRows && !legacy_rowloop()) {
      const size_t smem = sizeof(float) * size_t(rows + 2) * kRlCols;
      rowloop_smem_kernel<<<unsigned(ceil_div(out, int64_t(kRlCols))), kRlCols * kRlLanes, smem, stream>>>(
          w, u, in, out, a, b, bits, base.data_as<float>(), st, qsel_p, codes, deq, err.data_as<float>(),
          nibbles + g * out);
      EXL2_CUDA_LAUNCH_CHECK("gptq rowloop_smem_kernel");
    } else {
      rowloop_kernel<<<col_blocks, kThreads, 0, stream>>>(w, u, in, out, a, b, bits, base.data_as<float>(), st,
                                                          qsel_p, codes, deq, err.data_as<float>(), nibbles + g * out);
      EXL2_CUDA_LAUNCH_CHECK("gptq rowloop_kernel");
    }
    if (b < in) {
      dim3 grid(unsigned(ceil_div(out, int64_t(kTn))), unsigned(ceil_div(in - b, int64_t(kTm))));
      trailing_kernel<<<grid, 256, 0, stream>>>(w, u, err.data_as<float>(), in, out, a, b);
      EXL2_CUDA_LAUNCH_CHECK("gptq trailing_kernel");
    }
    a = b;
  }
  GptqState fin{};
  EXL2_CUDA_CHECK(cudaMemcpyAsync(&fin, st, sizeof(fin), cudaMemcpyDeviceToHost, stream));
  EXL2_CUDA_CHECK(cudaStreamSynchronize(stream));
  EXL2_CHECK(fin.bad_group == INT_MAX, "GPTQ: group ", fin.bad_group, " needs scale ", fin.bad_value,
             ", beyond fp16; the weights are too large for EXL2's fp16 scales");
}

void gptq_hessian(const float* x, int64_t n, int64_t in, float* h, bool accumulate) {
  DeviceGuard guard(device_of(x));
  EXL2_CHECK(n <= INT_MAX && in <= INT_MAX, "gptq_hessian: sizes beyond int range (", n, " x ", in, ")");
  const float one = 1.f, beta = accumulate ? 1.f : 0.f;
  // row-major x [n, in] is column-major X [in, n]; H = X X^T (symmetric, so its layout does not matter)
  EXL2_CUBLAS_CHECK(cublasSgemm(cublas_handle(), CUBLAS_OP_N, CUBLAS_OP_T, int(in), int(in), int(n), &one, x, int(in),
                                x, int(in), &beta, h, int(in)));
}

namespace {

// grid (parts, rows), 256 threads: one part of one row, fp64 terms, block tree sum.
__global__ void sqdiff_kernel(const float* __restrict__ a, const float* __restrict__ b, int64_t cols, int64_t per,
                              double* __restrict__ partial) {
  __shared__ double slot[256];
  const int64_t r = blockIdx.y, p = blockIdx.x;
  const int64_t c0 = min(cols, p * per), c1 = min(cols, c0 + per);
  const float* ar = a + r * cols;
  const float* br = b ? b + r * cols : nullptr;
  double s = 0.0;
  for (int64_t c = c0 + threadIdx.x; c < c1; c += blockDim.x) {
    const double d = br ? double(ar[c]) - double(br[c]) : double(ar[c]);
    s += d * d;
  }
  slot[threadIdx.x] = s;
  __syncthreads();
  for (int k = 128; k > 0; k >>= 1) {
    if (int(threadIdx.x) < k) slot[threadIdx.x] += slot[threadIdx.x + k];
    __syncthreads();
  }
  if (threadIdx.x == 0) partial[r * gridDim.x + p] = slot[0];
}

}  // namespace

void gptq_sqdiff(const float* a, const float* b, int64_t rows, int64_t cols, int64_t parts, double* partial) {
  if (rows == 0 || parts == 0) return;
  DeviceGuard guard(device_of(a));
  EXL2_CHECK(rows <= 65535 && parts <= INT_MAX, "gptq_sqdiff: ", rows, " rows (at most 65535)");
  const int64_t per = ceil_div(cols, parts);
  sqdiff_kernel<<<dim3(unsigned(parts), unsigned(rows)), 256, 0, current_stream()>>>(a, b, cols, per, partial);
  EXL2_CUDA_LAUNCH_CHECK("gptq sqdiff_kernel");
}

}  // namespace exl2::cuda
