// Standalone check and benchmark of the CUDA paged attention (cuda/attention.cu and the tile variants of
// cuda/attention_kernels.cuh): correctness as max relative error against a CPU reference (fp64 over the
// f16-rounded inputs) on random inputs with shuffled pages and mixed sequences, then timings of the shapes of
// issue 4 (prefill 2048 x 32 heads x hd 128, decode at context 2048.. with 32 or 8 KV heads) next to the
// device-to-device copy bandwidth. Build + run: dev/kernels/attention_bench.sh [arch] [--quick]
// (--prefill: the prefill checks and timings only, as the EXL2CPP_ATTN_PREFILL=rm2 run of attention_bench.sh).
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "backend/kernels.h"
#include "cuda/attention_kernels.cuh"
#include "cuda/check.h"
#include "cuda/stream.h"

namespace exl2 {
size_t dtype_size(DType d) {  // the core library defines this; the standalone carries its own copy
  switch (d) {
    case DType::F32: case DType::I32: return 4;
    case DType::F16: case DType::BF16: case DType::I16: return 2;
    default: return 1;
  }
}
}  // namespace exl2

using namespace exl2;
using exl2::cuda::current_stream;

static std::mt19937 g_rng(1234);
static int g_fail = 0;
static bool g_quick = false;
static bool g_prefill_only = false;

static float urand(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(g_rng); }
static float r16(float x) { return __half2float(__float2half_rn(x)); }

struct DevBuf {
  void* p = nullptr;
  size_t bytes = 0;
  explicit DevBuf(size_t b) : bytes(b) { EXL2_CUDA_CHECK(cudaMalloc(&p, b ? b : 16)); }
  ~DevBuf() { cudaFree(p); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
};

static std::vector<__half> to_half(const std::vector<float>& v) {
  std::vector<__half> h(v.size());
  for (size_t i = 0; i < v.size(); ++i) h[i] = __float2half_rn(v[i]);
  return h;
}

// A paged problem: sequences with their K/V, scattered into shuffled pages; a batch of rows (seq, position).
struct Problem {
  int64_t H, KV, D, page;
  std::vector<int> seq_lens;
  std::vector<int32_t> seq, pos;
  int64_t pages_per_seq = 0, n_pages = 0;
  std::vector<std::vector<float>> kseq, vseq;  // per sequence [L][KV][D], f16-rounded
  std::vector<float> q;                        // [n][H][D], f16-rounded
  std::vector<int32_t> table;                  // [n_seqs][pages_per_seq]
  std::vector<__half> kp, vp;                  // pages
  int64_t n() const { return int64_t(seq.size()); }
};

static Problem make_problem(int64_t H, int64_t KV, int64_t D, int64_t page, std::vector<int> seq_lens,
                            std::vector<int32_t> seq, std::vector<int32_t> pos, bool fill_pages = true) {
  Problem p{H, KV, D, page, seq_lens, seq, pos};
  int maxlen = *std::max_element(seq_lens.begin(), seq_lens.end());
  p.pages_per_seq = (maxlen + page - 1) / page + 1;
  p.n_pages = int64_t(seq_lens.size()) * p.pages_per_seq + 2;
  std::vector<int32_t> perm(size_t(p.n_pages));
  for (int64_t i = 0; i < p.n_pages; ++i) perm[size_t(i)] = int32_t(i);
  std::shuffle(perm.begin(), perm.end(), g_rng);
  p.table.assign(perm.begin(), perm.begin() + int64_t(seq_lens.size()) * p.pages_per_seq);
  const size_t pool = size_t(p.n_pages * page * KV * D);
  std::vector<float> kpf(pool), vpf(pool);
  for (size_t i = 0; i < pool; ++i) {  // garbage (large, and a few non-finite) where no sequence lives
    kpf[i] = urand(-50.f, 50.f);
    vpf[i] = (i % 997 == 0) ? NAN : urand(-50.f, 50.f);
  }
  for (size_t s = 0; s < seq_lens.size(); ++s) {
    const int L = seq_lens[s];
    std::vector<float> k(size_t(L * KV * D)), v(size_t(L * KV * D));
    for (auto& x : k) x = r16(urand(-2.f, 2.f));
    for (auto& x : v) x = r16(urand(-1.f, 1.f));
    if (fill_pages) {
      for (int j = 0; j < L; ++j) {
        const int64_t pg = p.table[s * p.pages_per_seq + j / page];
        const size_t dst = size_t(((pg * page + j % page) * KV) * D);
        std::copy(k.begin() + size_t(j) * KV * D, k.begin() + size_t(j + 1) * KV * D, kpf.begin() + dst);
        std::copy(v.begin() + size_t(j) * KV * D, v.begin() + size_t(j + 1) * KV * D, vpf.begin() + dst);
      }
    }
    p.kseq.push_back(std::move(k));
    p.vseq.push_back(std::move(v));
  }
  p.kp = to_half(kpf);
  p.vp = to_half(vpf);
  p.q.resize(size_t(p.n() * H * D));
  for (auto& x : p.q) x = r16(urand(-2.f, 2.f));
  return p;
}

// Device copy of a problem (meta = positions | seq_of_token | page table).
struct DevProblem {
  DevBuf q, k, v, meta, out;
  const Problem& p;
  explicit DevProblem(const Problem& pr)
      : q(pr.q.size() * 2), k(pr.kp.size() * 2), v(pr.vp.size() * 2),
        meta((2 * pr.pos.size() + pr.table.size()) * 4), out(pr.q.size() * 2), p(pr) {
    const auto qh = to_half(pr.q);
    EXL2_CUDA_CHECK(cudaMemcpy(q.p, qh.data(), q.bytes, cudaMemcpyHostToDevice));
    EXL2_CUDA_CHECK(cudaMemcpy(k.p, pr.kp.data(), k.bytes, cudaMemcpyHostToDevice));
    EXL2_CUDA_CHECK(cudaMemcpy(v.p, pr.vp.data(), v.bytes, cudaMemcpyHostToDevice));
    std::vector<int32_t> m(pr.pos);
    m.insert(m.end(), pr.seq.begin(), pr.seq.end());
    m.insert(m.end(), pr.table.begin(), pr.table.end());
    EXL2_CUDA_CHECK(cudaMemcpy(meta.p, m.data(), meta.bytes, cudaMemcpyHostToDevice));
  }
  const int32_t* pos() const { return static_cast<const int32_t*>(meta.p); }
  const int32_t* seq() const { return pos() + p.n(); }
  const int32_t* table() const { return pos() + 2 * p.n(); }
};

// Signature of every variant: (q, k_pages, v_pages, positions, seq_of_token, page_table, pages_per_seq, n,
// n_heads, n_heads_kv, page_size, scale, out).
using Launch = std::function<void(const __half*, const __half*, const __half*, const int32_t*, const int32_t*,
                                  const int32_t*, int64_t, int64_t, int64_t, int64_t, int64_t, float, __half*)>;

static Launch production(int64_t D) {
  return [D](const __half* q, const __half* k, const __half* v, const int32_t* pos, const int32_t* seq,
             const int32_t* table, int64_t pps, int64_t n, int64_t H, int64_t KV, int64_t page, float scale,
             __half* out) {
    cuda::attention_paged(q, k, v, DType::F16, pos, seq, table, pps, n, H, KV, D, page, scale, out, DType::F16);
  };
}

// <D, warps, keys per tile, stages, Q in registers[, m-tiles per warp RM = 1]>. Left out for spilling at sm_90
// (ptxas -v): RM 2 with Q in registers at D 128 (BN 32: 80 bytes), RM 2 at D 64 with BN 128 (200 bytes).
#define PREFILL(...)                                                                                 \
  Launch([](const __half* q, const __half* k, const __half* v, const int32_t* pos, const int32_t* seq,   \
            const int32_t* table, int64_t pps, int64_t n, int64_t H, int64_t KV, int64_t page, float scale, \
            __half* out) {                                                                               \
    cuda::attn::launch_prefill_mma<__VA_ARGS__>(q, k, v, pos, seq, table, pps, n, H, KV, page, scale, out); \
  })

template <int D, int BN, int ST, bool QR>
static Launch decode_variant(int forced_splits) {
  return [forced_splits](const __half* q, const __half* k, const __half* v, const int32_t* pos, const int32_t* seq,
                         const int32_t* table, int64_t pps, int64_t n, int64_t H, int64_t KV, int64_t page,
                         float scale, __half* out) {
    cuda::attn::launch_decode_mma<D, BN, ST, QR>(q, k, v, pos, seq, table, pps, n, H, KV, page, scale, out,
                                                 forced_splits);
  };
}

// Max |out - ref| / max |ref| over the rows in `rows` (all heads), CPU reference in fp64.
static double check(const Problem& p, const DevProblem& dp, const std::vector<int64_t>& rows, float scale) {
  std::vector<__half> outh(p.q.size());
  EXL2_CUDA_CHECK(cudaStreamSynchronize(current_stream()));
  EXL2_CUDA_CHECK(cudaMemcpy(outh.data(), dp.out.p, outh.size() * 2, cudaMemcpyDeviceToHost));
  double max_err = 0, max_ref = 0;
  const int64_t G = p.H / p.KV;
  std::vector<double> sc, acc(size_t(p.D));
  for (int64_t t : rows) {
    const auto& K = p.kseq[size_t(p.seq[size_t(t)])];
    const auto& V = p.vseq[size_t(p.seq[size_t(t)])];
    const int L = p.pos[size_t(t)] + 1;
    sc.resize(size_t(L));
    for (int64_t h = 0; h < p.H; ++h) {
      const int64_t hk = h / G;
      const float* qv = &p.q[size_t((t * p.H + h) * p.D)];
      double mx = -1e300;
      for (int j = 0; j < L; ++j) {
        const float* kv = &K[size_t((j * p.KV + hk) * p.D)];
        double s = 0;
        for (int64_t d = 0; d < p.D; ++d) s += double(qv[d]) * kv[d];
        sc[size_t(j)] = s * scale;
        mx = std::max(mx, sc[size_t(j)]);
      }
      double l = 0;
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int j = 0; j < L; ++j) {
        const double e = std::exp(sc[size_t(j)] - mx);
        l += e;
        const float* vv = &V[size_t((j * p.KV + hk) * p.D)];
        for (int64_t d = 0; d < p.D; ++d) acc[size_t(d)] += e * vv[d];
      }
      for (int64_t d = 0; d < p.D; ++d) {
        const double ref = acc[size_t(d)] / l;
        const double got = __half2float(outh[size_t((t * p.H + h) * p.D + d)]);
        max_ref = std::max(max_ref, std::fabs(ref));
        max_err = std::max(max_err, std::isfinite(got) ? std::fabs(got - ref) : 1e30);
      }
    }
  }
  return max_err / std::max(max_ref, 1e-30);
}

static void run_check(const char* name, const Problem& p, const Launch& f, const std::vector<int64_t>& rows) {
  DevProblem dp(p);
  const float scale = 1.f / std::sqrt(float(p.D));
  EXL2_CUDA_CHECK(cudaMemset(dp.out.p, 0xff, dp.out.bytes));  // NaN: unwritten rows show up
  f(static_cast<const __half*>(dp.q.p), static_cast<const __half*>(dp.k.p), static_cast<const __half*>(dp.v.p),
    dp.pos(), dp.seq(), dp.table(), p.pages_per_seq, p.n(), p.H, p.KV, p.page, scale,
    static_cast<__half*>(dp.out.p));
  const double err = check(p, dp, rows, scale);
  const bool ok = err < 4e-3;
  if (!ok) ++g_fail;
  std::printf("  %-58s max rel err %.2e  %s\n", name, err, ok ? "ok" : "FAIL");
}

static std::vector<int64_t> all_rows(int64_t n) {
  std::vector<int64_t> r(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) r[size_t(i)] = i;
  return r;
}
static std::vector<int64_t> some_rows(int64_t n, int k) {
  std::vector<int64_t> r = {0, 1, 63, 64, n - 1, n - 2, n / 2};
  for (int i = 0; i < k; ++i) r.push_back(std::uniform_int_distribution<int64_t>(0, n - 1)(g_rng));
  std::sort(r.begin(), r.end());
  r.erase(std::unique(r.begin(), r.end()), r.end());
  return r;
}

// One sequence of `ctx` keys, rows = its last n positions (a prefill chunk or n decode rows of one sequence).
static Problem one_seq(int64_t H, int64_t KV, int64_t D, int64_t n, int ctx, int64_t page = 256) {
  std::vector<int32_t> seq(static_cast<size_t>(n), 0), pos(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) pos[size_t(i)] = int32_t(ctx - n + i);
  return make_problem(H, KV, D, page, {ctx}, seq, pos);
}

// Mixed batch: a chunk of seq 0 (positions 100..100+c-1), decode rows of seqs 1..4, all of seq 5 from 0.
static Problem mixed(int64_t H, int64_t KV, int64_t D, int64_t page, int chunk, int full) {
  std::vector<int> lens = {100 + chunk, 17, 300, 1, 2049, full};
  std::vector<int32_t> seq, pos;
  for (int i = 0; i < chunk; ++i) seq.push_back(0), pos.push_back(100 + i);
  seq.push_back(3), pos.push_back(0);
  seq.push_back(1), pos.push_back(16);
  for (int i = 0; i < full; ++i) seq.push_back(5), pos.push_back(i);
  seq.push_back(2), pos.push_back(299);
  seq.push_back(4), pos.push_back(2048);
  return make_problem(H, KV, D, page, lens, seq, pos);
}

// Mixed decode batch (n rows of different sequences and lengths).
static Problem decode_batch(int64_t H, int64_t KV, int64_t D, int64_t page, std::vector<int> lens) {
  std::vector<int32_t> seq, pos;
  for (size_t i = 0; i < lens.size(); ++i) seq.push_back(int32_t(i)), pos.push_back(lens[i] - 1);
  return make_problem(H, KV, D, page, lens, seq, pos);
}

// ---- timing ------------------------------------------------------------------------------------------------

template <typename F>
static double time_it(int iters, F&& f) {
  cudaStream_t s = current_stream();
  for (int i = 0; i < 3; ++i) f(i);
  cudaEvent_t a, b;
  EXL2_CUDA_CHECK(cudaEventCreate(&a));
  EXL2_CUDA_CHECK(cudaEventCreate(&b));
  EXL2_CUDA_CHECK(cudaEventRecord(a, s));
  for (int i = 0; i < iters; ++i) f(i);
  EXL2_CUDA_CHECK(cudaEventRecord(b, s));
  EXL2_CUDA_CHECK(cudaEventSynchronize(b));
  float ms = 0.f;
  EXL2_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms * 1e-3 / iters;
}

static double g_copy_gbs = 0;

static void bench_copy() {
  const size_t nbytes = size_t(1) << 30;
  DevBuf a(nbytes), b(nbytes);
  EXL2_CUDA_CHECK(cudaMemset(a.p, 1, nbytes));
  const double s = time_it(20, [&](int) {
    EXL2_CUDA_CHECK(cudaMemcpyAsync(b.p, a.p, nbytes, cudaMemcpyDeviceToDevice, current_stream()));
  });
  g_copy_gbs = 2.0 * nbytes / s / 1e9;
  std::printf("copy bandwidth (cudaMemcpyAsync D2D 1 GiB, read + write): %.0f GB/s\n", g_copy_gbs);
}

__global__ void fill_random_kernel(__half* p, int64_t n, uint32_t seed) {  // hash -> uniform [-1, 1)
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t x = static_cast<uint32_t>(i) * 2654435761u ^ (seed * 0x9e3779b9u);
    x ^= x >> 15;
    x *= 2246822519u;
    x ^= x >> 13;
    p[i] = __float2half_rn((x & 0xffff) / 32768.f - 1.f);
  }
}

// Paged K/V for timing: `copies` independent pools (rotated per call so that, with enough of them, every call
// reads K/V that is not in L2: "cold"), one sequence of ctx keys, contiguous pages, random f16 values.
struct TimingSetup {
  int64_t n, ctx, H, KV, D, page = 256, pages, copies;
  std::vector<DevBuf*> k, v;
  DevBuf *q, *out, *meta;
  TimingSetup(int64_t n_, int64_t ctx_, int64_t H_, int64_t KV_, int64_t D_, int64_t copies_)
      : n(n_), ctx(ctx_), H(H_), KV(KV_), D(D_), copies(copies_) {
    pages = (ctx + page - 1) / page;
    const size_t kv_elems = size_t(pages * page * KV * D);
    for (int64_t c = 0; c < copies; ++c) {
      k.push_back(new DevBuf(kv_elems * 2));
      v.push_back(new DevBuf(kv_elems * 2));
      fill_random_kernel<<<1024, 256>>>(static_cast<__half*>(k.back()->p), int64_t(kv_elems), 2 * uint32_t(c) + 1);
      fill_random_kernel<<<1024, 256>>>(static_cast<__half*>(v.back()->p), int64_t(kv_elems), 2 * uint32_t(c) + 2);
      EXL2_CUDA_CHECK(cudaDeviceSynchronize());
    }
    std::vector<__half> qh(size_t(n * H * D));
    for (auto& x : qh) x = __float2half_rn(urand(-1.f, 1.f));
    q = new DevBuf(qh.size() * 2);
    out = new DevBuf(qh.size() * 2);
    EXL2_CUDA_CHECK(cudaMemcpy(q->p, qh.data(), q->bytes, cudaMemcpyHostToDevice));
    std::vector<int32_t> m(size_t(2 * n + pages));
    for (int64_t i = 0; i < n; ++i) m[size_t(i)] = int32_t(ctx - n + i), m[size_t(n + i)] = 0;
    for (int64_t p = 0; p < pages; ++p) m[size_t(2 * n + p)] = int32_t(p);
    meta = new DevBuf(m.size() * 4);
    EXL2_CUDA_CHECK(cudaMemcpy(meta->p, m.data(), meta->bytes, cudaMemcpyHostToDevice));
  }
  ~TimingSetup() {
    for (auto* b : k) delete b;
    for (auto* b : v) delete b;
    delete q;
    delete out;
    delete meta;
  }
  double time(const Launch& f, int iters) {
    const int32_t* pos = static_cast<const int32_t*>(meta->p);
    const float scale = 1.f / std::sqrt(float(D));
    return time_it(iters, [&](int i) {
      const int64_t c = i % copies;
      f(static_cast<const __half*>(q->p), static_cast<const __half*>(k[size_t(c)]->p),
        static_cast<const __half*>(v[size_t(c)]->p), pos, pos + n, pos + 2 * n, pages, n, H, KV, page, scale,
        static_cast<__half*>(out->p));
    });
  }
  double kv_bytes() const { return 2.0 * double(ctx) * KV * D * 2; }
};

static void time_prefill(const char* name, int64_t n, int64_t H, int64_t KV, int64_t D, const Launch& f) {
  TimingSetup ts(n, n, H, KV, D, 1);
  const double s = ts.time(f, g_quick ? 5 : 20);
  const double flops = 4.0 * H * D * double(n) * double(n) / 2;  // causal: half of QK^T and PV
  std::printf("  %-62s %9.3f ms  %6.1f TFLOP/s\n", name, s * 1e3, flops / s / 1e12);
}

static void time_decode(const char* name, int64_t n, int64_t ctx, int64_t H, int64_t KV, int64_t D,
                        const Launch& f) {
  const double bytes = 2.0 * ctx * KV * D * 2;
  const int64_t copies = std::max<int64_t>(1, std::min<int64_t>(16, int64_t(std::ceil(256e6 / bytes))));
  const int iters = g_quick ? 20 : 200;
  double h1, cold;
  {
    TimingSetup hot(n, ctx, H, KV, D, 1);
    h1 = hot.time(f, iters);
  }
  {
    TimingSetup ts(n, ctx, H, KV, D, copies);
    cold = ts.time(f, iters);
  }
  std::printf("  %-50s hot %7.1f us %5.0f GB/s %5.1f%% | cold %7.1f us %5.0f GB/s %5.1f%% of copy\n", name,
              h1 * 1e6, bytes / h1 / 1e9, 100 * bytes / h1 / 1e9 / g_copy_gbs, cold * 1e6, bytes / cold / 1e9,
              100 * bytes / cold / 1e9 / g_copy_gbs);
}

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i)
    if (!std::strcmp(argv[i], "--quick")) g_quick = true;
    else if (!std::strcmp(argv[i], "--prefill")) g_prefill_only = true;
  cudaDeviceProp prop{};
  EXL2_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const char* rm_env = std::getenv("EXL2CPP_ATTN_PREFILL");
  std::printf("attention_bench: %s, %d SMs, sm_%d%d, L2 %d MiB, EXL2CPP_CUDA_REF=%s, EXL2CPP_ATTN_PREFILL=%s\n",
              prop.name, prop.multiProcessorCount, prop.major, prop.minor, prop.l2CacheSize >> 20,
              cuda::ref_kernels_enabled() ? "1" : "0", rm_env && *rm_env ? rm_env : "(unset: rm1)");

  std::printf("\n== correctness (max |out - ref| / max |ref|, CPU fp64 reference, tolerance 4e-3)\n");
  {
    const Problem p = one_seq(32, 32, 128, 2048, 2048);
    run_check("prefill 2048 H32 KV32 D128 (production)", p, production(128), some_rows(2048, 24));
    run_check("prefill 2048 H32 KV32 D128 <128,8,64,2,Q>", p, PREFILL(128, 8, 64, 2, true), some_rows(2048, 8));
    run_check("prefill 2048 H32 KV32 D128 <128,4,64,3,Q>", p, PREFILL(128, 4, 64, 3, true), some_rows(2048, 8));
    run_check("prefill 2048 H32 KV32 D128 <128,4,32,2,smemQ>", p, PREFILL(128, 4, 32, 2, false), some_rows(2048, 8));
  }
  run_check("prefill 1000 H32 KV8 D128 (GQA, page 16)", one_seq(32, 8, 128, 1000, 1000, 16), production(128),
            some_rows(1000, 16));
  run_check("prefill chunk 300 at 700 H16 KV4 D64", one_seq(16, 4, 64, 300, 1000, 64), production(64),
            all_rows(300));
  run_check("prefill chunk 300 at 700 H16 KV2 D256", one_seq(16, 2, 256, 300, 1000, 32), production(256),
            all_rows(300));
  {
    const Problem p = mixed(8, 2, 128, 16, 150, 77);
    run_check("mixed batch (chunk+decodes+full seq) H8 KV2 D128 page 16", p, production(128), all_rows(p.n()));
    const Problem p2 = mixed(12, 3, 64, 5, 40, 33);
    run_check("mixed batch H12 KV3 D64 page 5", p2, production(64), all_rows(p2.n()));
    const Problem p3 = mixed(8, 1, 256, 48, 70, 20);
    run_check("mixed batch H8 KV1 D256 page 48", p3, production(256), all_rows(p3.n()));
    run_check("mixed batch H8 KV1 D256 page 48 <256,4,16,2,smemQ>", p3, PREFILL(256, 4, 16, 2, false),
              all_rows(p3.n()));
  }
  // RM = 2 (two 16-row m-tiles per warp, 128-row blocks; EXL2CPP_ATTN_PREFILL=rm2): the aligned long prefill,
  // chunks at unaligned offsets (an m-tile of a warp fully past the diagonal of a key tile), GQA, mixed batches
  // (several sequences in one 128-row block), short n (one partial block).
  {
    const Problem p = one_seq(32, 32, 128, 2048, 2048);
    run_check("prefill 2048 H32 KV32 D128 <128,4,64,2,smemQ,RM2>", p, PREFILL(128, 4, 64, 2, false, 2), some_rows(2048, 24));
    run_check("prefill 2048 H32 KV32 D128 <128,4,32,2,smemQ,RM2>", p, PREFILL(128, 4, 32, 2, false, 2), some_rows(2048, 8));
    run_check("prefill 2048 H32 KV32 D128 <128,4,32,3,smemQ,RM2>", p, PREFILL(128, 4, 32, 3, false, 2), some_rows(2048, 8));
    run_check("prefill 2048 H32 KV32 D128 <128,4,64,3,smemQ,RM2>", p, PREFILL(128, 4, 64, 3, false, 2), some_rows(2048, 8));
    run_check("prefill 2048 H32 KV32 D128 <128,8,64,2,smemQ,RM2>", p, PREFILL(128, 8, 64, 2, false, 2), some_rows(2048, 8));
  }
  {
    const Problem p = one_seq(32, 8, 128, 1000, 1000, 16);
    run_check("prefill 1000 H32 KV8 D128 page 16 <128,4,64,2,smemQ,RM2>", p, PREFILL(128, 4, 64, 2, false, 2), some_rows(1000, 16));
    run_check("prefill 1000 H32 KV8 D128 page 16 <128,4,32,2,smemQ,RM2>", p, PREFILL(128, 4, 32, 2, false, 2), some_rows(1000, 16));
    const Problem c = one_seq(16, 4, 128, 333, 1040, 64);  // chunk at 707: m-tiles straddle key tiles
    run_check("prefill chunk 333 at 707 H16 KV4 D128 <128,4,64,2,smemQ,RM2>", c, PREFILL(128, 4, 64, 2, false, 2), all_rows(333));
    run_check("prefill chunk 333 at 707 H16 KV4 D128 <128,4,32,2,smemQ,RM2>", c, PREFILL(128, 4, 32, 2, false, 2), all_rows(333));
    const Problem c64 = one_seq(16, 4, 64, 300, 1000, 64);
    run_check("prefill chunk 300 at 700 H16 KV4 D64 <64,4,64,2,Q,RM2>", c64, PREFILL(64, 4, 64, 2, true, 2), all_rows(300));
    const Problem s = one_seq(8, 1, 128, 37, 37, 16);  // one partial block, G 8
    run_check("prefill 37 H8 KV1 D128 <128,4,64,2,smemQ,RM2>", s, PREFILL(128, 4, 64, 2, false, 2), all_rows(37));
  }
  {
    const Problem p = mixed(8, 2, 128, 16, 150, 77);
    run_check("mixed batch H8 KV2 D128 page 16 <128,4,64,2,smemQ,RM2>", p, PREFILL(128, 4, 64, 2, false, 2), all_rows(p.n()));
    run_check("mixed batch H8 KV2 D128 page 16 <128,4,32,2,smemQ,RM2>", p, PREFILL(128, 4, 32, 2, false, 2), all_rows(p.n()));
    const Problem p2 = mixed(12, 3, 64, 5, 40, 33);
    run_check("mixed batch H12 KV3 D64 page 5 <64,4,64,2,Q,RM2>", p2, PREFILL(64, 4, 64, 2, true, 2), all_rows(p2.n()));
  }
  if (!g_prefill_only) {
  run_check("decode 1 row ctx 2048 H32 KV32 D128", one_seq(32, 32, 128, 1, 2048), production(128), {0});
  run_check("decode 1 row ctx 2048 H32 KV8 D128", one_seq(32, 8, 128, 1, 2048), production(128), {0});
  run_check("decode 1 row ctx 5000 H32 KV2 D128 (G 16)", one_seq(32, 2, 128, 1, 5000, 16), production(128), {0});
  run_check("decode 1 row ctx 3000 H40 KV1 D128 (G 40: 3 groups)", one_seq(40, 1, 128, 1, 3000, 64),
            production(128), {0});
  run_check("decode 16 rows of one seq ctx 1000 H28 KV4 D128 (G 7)", one_seq(28, 4, 128, 16, 1000, 16),
            production(128), all_rows(16));
  {
    const Problem p = decode_batch(32, 8, 128, 16, {1, 2, 17, 64, 65, 300, 2048, 4097, 33, 9});
    run_check("decode batch of 10 lengths 1..4097 H32 KV8 D128 page 16", p, production(128), all_rows(p.n()));
    run_check("  same, <128,32,3,Q>", p, decode_variant<128, 32, 3, true>(0), all_rows(p.n()));
    run_check("  same, <128,128,2,Q>", p, decode_variant<128, 128, 2, true>(0), all_rows(p.n()));
    run_check("  same, 3 forced splits", p, decode_variant<128, 64, 2, true>(3), all_rows(p.n()));
    run_check("  same, 128 forced splits", p, decode_variant<128, 64, 2, true>(128), all_rows(p.n()));
    const Problem p64 = decode_batch(16, 16, 64, 7, {1, 30, 1000, 3});
    run_check("decode batch H16 KV16 D64 page 7", p64, production(64), all_rows(p64.n()));
    const Problem p256 = decode_batch(16, 2, 256, 32, {5, 700, 2000});
    run_check("decode batch H16 KV2 D256 page 32", p256, production(256), all_rows(p256.n()));
  }
  }  // !g_prefill_only

  std::printf("\n== timings\n");
  bench_copy();
  std::printf("prefill (one sequence, causal, page 256; TFLOP/s counts the causal half):\n");
  time_prefill("2048 H32 KV32 D128 production (rm1 <128,4,64,2,Q>, rm2 <..,smemQ,RM2>)", 2048, 32, 32, 128, production(128));
  time_prefill("2048 H32 KV8  D128 production", 2048, 32, 8, 128, production(128));
  time_prefill("2048 H32 KV32 D128 <128,8,64,2,Q>", 2048, 32, 32, 128, PREFILL(128, 8, 64, 2, true));
  time_prefill("2048 H32 KV32 D128 <128,4,64,3,Q>", 2048, 32, 32, 128, PREFILL(128, 4, 64, 3, true));
  time_prefill("2048 H32 KV32 D128 <128,4,32,2,Q>", 2048, 32, 32, 128, PREFILL(128, 4, 32, 2, true));
  time_prefill("2048 H32 KV32 D128 <128,4,64,2,smemQ>", 2048, 32, 32, 128, PREFILL(128, 4, 64, 2, false));
  time_prefill("2048 H32 KV32 D128 <128,8,32,3,Q>", 2048, 32, 32, 128, PREFILL(128, 8, 32, 3, true));
  time_prefill("2048 H32 KV32 D128 <128,4,64,2,smemQ,RM2> (rm2 H100/H200)", 2048, 32, 32, 128, PREFILL(128, 4, 64, 2, false, 2));
  time_prefill("2048 H32 KV32 D128 <128,4,32,2,smemQ,RM2> (rm2 99 KiB cards)", 2048, 32, 32, 128, PREFILL(128, 4, 32, 2, false, 2));
  time_prefill("2048 H32 KV32 D128 <128,4,32,3,smemQ,RM2>", 2048, 32, 32, 128, PREFILL(128, 4, 32, 3, false, 2));
  time_prefill("2048 H32 KV32 D128 <128,4,64,3,smemQ,RM2> (1 block/SM)", 2048, 32, 32, 128, PREFILL(128, 4, 64, 3, false, 2));
  time_prefill("2048 H32 KV32 D128 <128,8,64,2,smemQ,RM2> (BM 256)", 2048, 32, 32, 128, PREFILL(128, 8, 64, 2, false, 2));
  time_prefill("2048 H32 KV8  D128 <128,4,64,2,smemQ,RM2>", 2048, 32, 8, 128, PREFILL(128, 4, 64, 2, false, 2));
  time_prefill("8192 H32 KV8  D128 production", 8192, 32, 8, 128, production(128));
  time_prefill("8192 H32 KV8  D128 <128,4,64,2,smemQ,RM2>", 8192, 32, 8, 128, PREFILL(128, 4, 64, 2, false, 2));
  time_prefill("2048 H32 KV8  D64  production", 2048, 32, 8, 64, production(64));
  time_prefill("2048 H32 KV8  D64  <64,4,64,2,Q,RM2>", 2048, 32, 8, 64, PREFILL(64, 4, 64, 2, true, 2));
  time_prefill("2048 H32 KV8  D64  <64,4,64,3,Q,RM2>", 2048, 32, 8, 64, PREFILL(64, 4, 64, 3, true, 2));
  time_prefill("2048 H16 KV4  D256 production", 2048, 16, 4, 256, production(256));
  time_prefill("2048 H16 KV4  D256 <256,4,64,2,smemQ>", 2048, 16, 4, 256, PREFILL(256, 4, 64, 2, false));
  time_prefill("2048 H16 KV4  D256 <256,4,16,2,smemQ> (consumer cards)", 2048, 16, 4, 256, PREFILL(256, 4, 16, 2, false));
  if (g_prefill_only) {
    std::printf("\nattention_bench: %s (%d failed checks)\n", g_fail ? "FAIL" : "ok", g_fail);
    return g_fail ? 1 : 0;
  }
  std::printf("decode (one sequence; hot: same K/V every call, as bench_decode.py; cold: K/V rotated over "
              ">= 256 MB):\n");
  for (int64_t ctx : {2048, 8192, 32768}) {
    for (int64_t kv : {32, 8}) {
      char name[128];
      std::snprintf(name, sizeof name, "n1 ctx %5lld H32 KV%-2lld D128 production", (long long)ctx, (long long)kv);
      time_decode(name, 1, ctx, 32, kv, 128, production(128));
    }
  }
  time_decode("n1 ctx  2048 H32 KV32 <128,32,3,Q>", 1, 2048, 32, 32, 128, decode_variant<128, 32, 3, true>(0));
  time_decode("n1 ctx  2048 H32 KV32 <128,64,3,Q>", 1, 2048, 32, 32, 128, decode_variant<128, 64, 3, true>(0));
  time_decode("n1 ctx  2048 H32 KV32 <128,128,2,Q>", 1, 2048, 32, 32, 128, decode_variant<128, 128, 2, true>(0));
  time_decode("n1 ctx  2048 H32 KV8  <128,32,3,Q>", 1, 2048, 32, 8, 128, decode_variant<128, 32, 3, true>(0));
  time_decode("n1 ctx  2048 H32 KV8  <128,64,3,Q>", 1, 2048, 32, 8, 128, decode_variant<128, 64, 3, true>(0));
  for (int splits : {4, 8, 16, 32}) {
    char name[128];
    std::snprintf(name, sizeof name, "n1 ctx  2048 H32 KV32 <128,64,2,Q> %d splits", splits);
    time_decode(name, 1, 2048, 32, 32, 128, decode_variant<128, 64, 2, true>(splits));
    std::snprintf(name, sizeof name, "n1 ctx  2048 H32 KV8  <128,64,2,Q> %d splits", splits);
    time_decode(name, 1, 2048, 32, 8, 128, decode_variant<128, 64, 2, true>(splits));
  }
  time_decode("n4 ctx  2048 H32 KV8  D128 production", 4, 2048, 32, 8, 128, production(128));
  time_decode("n16 ctx 2048 H32 KV8  D128 production", 16, 2048, 32, 8, 128, production(128));
  time_decode("n1 ctx  2048 H32 KV8  D64  production", 1, 2048, 32, 8, 64, production(64));
  time_decode("n1 ctx  2048 H16 KV4  D256 production", 1, 2048, 16, 4, 256, production(256));
  time_decode("n1 ctx  2048 H16 KV4  <256,64,2,smemQ>", 1, 2048, 16, 4, 256, decode_variant<256, 64, 2, false>(0));

  std::printf("\nattention_bench: %s (%d failed checks)\n", g_fail ? "FAIL" : "ok", g_fail);
  return g_fail ? 1 : 0;
}
