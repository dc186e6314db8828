// Standalone GPU self-check of every cuda:: kernel against a host reference on random inputs (awkward shapes,
// mixed sequences in one batch, shuffled pages). Independent of the Python bindings, so the kernels can be
// validated on the GPU machine before the op layer lands. Run it twice: as is (fast paths) and with --reference
// (option cuda_reference: the reference kernels). Build + run: dev/kernels/check_kernels.sh
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backend/kernels.h"
#include "cuda/check.h"
#include "cuda/embedding.h"
#include "cuda/sampling.h"
#include "cuda/stream.h"
#include "exl2/options.h"

namespace exl2 {
// The core library defines this; the standalone check carries its own copy.
size_t dtype_size(DType d) {
  switch (d) {
    case DType::F32: case DType::I32: return 4;
    case DType::F16: case DType::BF16: case DType::I16: return 2;
    default: return 1;
  }
}
}  // namespace exl2

using namespace exl2;

static int g_fail = 0, g_pass = 0;
static std::mt19937 g_rng(1234);

static float urand(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(g_rng); }
static std::vector<float> rand_vec(size_t n, float lo = -1.f, float hi = 1.f) {
  std::vector<float> v(n);
  for (auto& x : v) x = urand(lo, hi);
  return v;
}
static const char* dtype_name_local(DType d) {
  return d == DType::F32 ? "f32" : d == DType::F16 ? "f16" : d == DType::BF16 ? "bf16" : "?";
}
static float r16(float x) { return __half2float(__float2half_rn(x)); }
static std::vector<float> round16(std::vector<float> v) {
  for (auto& x : v) x = r16(x);
  return v;
}

// Device buffer holding a host vector converted to dtype.
struct Dev {
  void* p = nullptr;
  size_t n = 0;
  DType dt = DType::F32;
  Dev(const std::vector<float>& v, DType d) : n(v.size()), dt(d) {
    std::vector<unsigned char> host(n * dtype_size(d) + 16);
    for (size_t i = 0; i < n; ++i) {
      if (d == DType::F32) reinterpret_cast<float*>(host.data())[i] = v[i];
      else if (d == DType::F16) reinterpret_cast<__half*>(host.data())[i] = __float2half_rn(v[i]);
      else reinterpret_cast<__nv_bfloat16*>(host.data())[i] = __float2bfloat16_rn(v[i]);
    }
    EXL2_CUDA_CHECK(cudaMalloc(&p, n * dtype_size(d) + 16));
    EXL2_CUDA_CHECK(cudaMemcpy(p, host.data(), n * dtype_size(d), cudaMemcpyHostToDevice));
  }
  Dev(const std::vector<int32_t>& v) : n(v.size()), dt(DType::I32) {
    EXL2_CUDA_CHECK(cudaMalloc(&p, n * 4 + 16));
    EXL2_CUDA_CHECK(cudaMemcpy(p, v.data(), n * 4, cudaMemcpyHostToDevice));
  }
  ~Dev() { cudaFree(p); }
  std::vector<float> get() const {
    EXL2_CUDA_CHECK(cudaStreamSynchronize(cuda::current_stream()));
    std::vector<unsigned char> host(n * dtype_size(dt));
    EXL2_CUDA_CHECK(cudaMemcpy(host.data(), p, host.size(), cudaMemcpyDeviceToHost));
    std::vector<float> v(n);
    for (size_t i = 0; i < n; ++i) {
      if (dt == DType::F32) v[i] = reinterpret_cast<float*>(host.data())[i];
      else if (dt == DType::F16) v[i] = __half2float(reinterpret_cast<__half*>(host.data())[i]);
      else if (dt == DType::BF16) v[i] = __bfloat162float(reinterpret_cast<__nv_bfloat16*>(host.data())[i]);
      else v[i] = static_cast<float>(reinterpret_cast<int32_t*>(host.data())[i]);
    }
    return v;
  }
};

// max |a - b| / (atol + rtol * |b|) <= 1
static void expect_close(const std::string& name, const std::vector<float>& got, const std::vector<float>& want,
                         float atol, float rtol) {
  double worst = 0;
  size_t wi = 0;
  bool bad_size = got.size() != want.size();
  for (size_t i = 0; !bad_size && i < got.size(); ++i) {
    double e = got[i] == want[i] ? 0.0 : std::fabs(double(got[i]) - want[i]) / (atol + rtol * std::fabs(want[i]));
    if (!(e <= worst)) worst = e, wi = i;  // NaN counts as worst
  }
  const bool ok = !bad_size && worst <= 1.0;
  (ok ? g_pass : g_fail)++;
  if (bad_size) std::printf("FAIL %-48s size %zu vs %zu\n", name.c_str(), got.size(), want.size());
  else std::printf("%s %-48s worst err/tol %.3f at %zu (got %.6g want %.6g)\n", ok ? "ok  " : "FAIL", name.c_str(),
                   worst, wi, got.empty() ? 0.0 : got[wi], want.empty() ? 0.0 : want[wi]);
}

// ---- attention ------------------------------------------------------------------------------------------

struct AttnCase {
  const char* name;
  int n_heads, n_kv, head_dim, page_size;
  std::vector<std::pair<int, int>> rows;  // (seq, position)
  DType act = DType::F16, cache = DType::F16;
};

static void check_attention(const AttnCase& c) {
  const int n = static_cast<int>(c.rows.size());
  int n_seqs = 0, max_len = 0;
  for (auto& r : c.rows) n_seqs = std::max(n_seqs, r.first + 1), max_len = std::max(max_len, r.second + 1);
  const int pages_per_seq = (max_len + c.page_size - 1) / c.page_size + 1;  // one spare page
  const int n_pages = n_seqs * pages_per_seq;
  std::vector<int32_t> perm(n_pages);
  for (int i = 0; i < n_pages; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), g_rng);
  const int64_t row = int64_t(c.n_kv) * c.head_dim;
  auto rnd = [&](std::vector<float> v) { return c.cache == DType::F16 ? round16(v) : v; };
  std::vector<float> kp = rnd(rand_vec(size_t(n_pages) * c.page_size * row, -2, 2));
  std::vector<float> vp = rnd(rand_vec(size_t(n_pages) * c.page_size * row));
  std::vector<float> q = rand_vec(size_t(n) * c.n_heads * c.head_dim, -2, 2);
  if (c.act == DType::F16) q = round16(q);
  std::vector<int32_t> pos(n), seq(n);
  for (int i = 0; i < n; ++i) seq[i] = c.rows[i].first, pos[i] = c.rows[i].second;
  const float scale = 1.f / std::sqrt(float(c.head_dim));
  // host reference
  std::vector<float> want(q.size());
  const int G = c.n_heads / c.n_kv;
  for (int t = 0; t < n; ++t)
    for (int h = 0; h < c.n_heads; ++h) {
      const int hk = h / G;
      std::vector<double> s(pos[t] + 1);
      double mx = -1e300;
      for (int j = 0; j <= pos[t]; ++j) {
        const int64_t page = perm[seq[t] * pages_per_seq + j / c.page_size];
        const int64_t off = ((page * c.page_size + j % c.page_size) * c.n_kv + hk) * c.head_dim;
        double d = 0;
        for (int e = 0; e < c.head_dim; ++e) d += double(q[(size_t(t) * c.n_heads + h) * c.head_dim + e]) * kp[off + e];
        s[j] = d * scale;
        mx = std::max(mx, s[j]);
      }
      double l = 0;
      for (auto& x : s) x = std::exp(x - mx), l += x;
      for (int e = 0; e < c.head_dim; ++e) {
        double a = 0;
        for (int j = 0; j <= pos[t]; ++j) {
          const int64_t page = perm[seq[t] * pages_per_seq + j / c.page_size];
          a += s[j] * vp[((page * c.page_size + j % c.page_size) * c.n_kv + hk) * c.head_dim + e];
        }
        want[(size_t(t) * c.n_heads + h) * c.head_dim + e] = float(a / l);
      }
    }
  Dev dq(q, c.act), dk(kp, c.cache), dv(vp, c.cache), dpos(pos), dseq(seq), dpt(perm),
      dout(std::vector<float>(q.size(), NAN), c.act);
  cuda::attention_paged(dq.p, dk.p, dv.p, c.cache, (int32_t*)dpos.p, (int32_t*)dseq.p, (int32_t*)dpt.p, pages_per_seq,
                        n, c.n_heads, c.n_kv, c.head_dim, c.page_size, scale, dout.p, c.act);
  const float tol = c.act == DType::F16 ? 2e-3f : 2e-5f;
  expect_close(std::string("attention ") + c.name, dout.get(), want, tol, tol);
}

static std::vector<std::pair<int, int>> prefill_rows(int seq, int first, int count) {
  std::vector<std::pair<int, int>> r;
  for (int i = 0; i < count; ++i) r.push_back({seq, first + i});
  return r;
}

static void attention_cases() {
  std::vector<AttnCase> cases;
  cases.push_back({"decode n1 H32 KV8 D128 pos2047 pg256", 32, 8, 128, 256, {{0, 2047}}});
  cases.push_back({"decode n1 H32 KV32 D128 pos0", 32, 32, 128, 256, {{0, 0}}});
  cases.push_back({"decode mixed H9 KV3 D64 pg16", 9, 3, 64, 16, {{0, 0}, {1, 17}, {2, 300}, {1, 1000}, {0, 63}}});
  cases.push_back({"decode H32 KV2 (G16) D128 pg32", 32, 2, 128, 32, {{0, 5}, {1, 700}, {2, 64}}});
  cases.push_back({"decode H8 KV8 D256 pg64", 8, 8, 256, 64, {{0, 129}, {1, 4000}}});
  cases.push_back({"decode H6 KV1 (G6) D64 pg8", 6, 1, 64, 8, {{0, 7}, {0, 8}, {0, 9}}});
  {
    std::vector<std::pair<int, int>> r;
    for (int i = 0; i < 16; ++i) r.push_back({i % 4, int(g_rng() % 900)});
    cases.push_back({"decode n16 H16 KV4 D128 pg16 random", 16, 4, 128, 16, r});
  }
  {
    auto r = prefill_rows(0, 10, 50);
    auto r2 = prefill_rows(1, 0, 27);
    r.insert(r.end(), r2.begin(), r2.end());
    cases.push_back({"prefill 2 seqs n77 H8 KV2 D128 pg32", 8, 2, 128, 32, r});
  }
  cases.push_back({"prefill n40 H4 KV4 D256 pg64", 4, 4, 256, 64, prefill_rows(0, 0, 40)});
  cases.push_back({"prefill n100 H9 KV3 D64 pg16 at 500", 9, 3, 64, 16, prefill_rows(0, 500, 100)});
  cases.push_back({"prefill n300 H2 KV1 D128 pg256", 2, 1, 128, 256, prefill_rows(0, 0, 300)});
  {
    std::vector<std::pair<int, int>> r;  // interleaved sequences, decode + chunk mix
    for (int i = 0; i < 45; ++i) r.push_back({i % 3, i % 3 == 0 ? 200 + i : i});
    cases.push_back({"prefill interleaved 3 seqs n45 H4 KV2 D64", 4, 2, 64, 16, r});
  }
  AttnCase f32case{"f32 act f32 cache (ref path) n20 D80", 4, 2, 80, 16, prefill_rows(0, 3, 20), DType::F32, DType::F32};
  cases.push_back(f32case);
  AttnCase bf{"f16 act bf16 cache (ref path) n3 D128", 4, 1, 128, 16, {{0, 40}, {1, 2}, {0, 41}}, DType::F16, DType::BF16};
  cases.push_back(bf);
  for (auto& c : cases) check_attention(c);
}

// ---- the other ops ---------------------------------------------------------------------------------------

static void other_cases() {
  // rms_norm: vector path (hidden % 8 == 0) and generic, large activations
  for (int hidden : {4096, 1000, 576}) {
    for (DType act : {DType::F16, DType::F32}) {
      const int rows = 7;
      auto x = rand_vec(size_t(rows) * hidden, -3000, 3000);
      if (act == DType::F16) x = round16(x);
      auto w = round16(rand_vec(hidden, 0.5f, 1.5f));
      std::vector<float> want(x.size());
      for (int r = 0; r < rows; ++r) {
        double ss = 0;
        for (int i = 0; i < hidden; ++i) ss += double(x[r * hidden + i]) * x[r * hidden + i];
        const double inv = 1.0 / std::sqrt(ss / hidden + 1e-5);
        for (int i = 0; i < hidden; ++i) want[r * hidden + i] = float(x[r * hidden + i] * inv * w[i]);
      }
      Dev dx(x, act), dw(w, DType::F16);
      cuda::rms_norm(dx.p, dw.p, DType::F16, rows, hidden, 1e-5f, dx.p, act);  // in place
      expect_close("rms_norm hidden " + std::to_string(hidden) + (act == DType::F16 ? " f16" : " f32"), dx.get(), want,
                   act == DType::F16 ? 2e-3f : 1e-5f, act == DType::F16 ? 2e-3f : 1e-5f);
    }
  }
  // rope
  {
    const int n = 5, H = 3, D = 64, max_pos = 100;
    std::vector<float> cs(size_t(max_pos) * D);
    for (int p = 0; p < max_pos; ++p)
      for (int i = 0; i < D / 2; ++i) {
        const double f = p * std::pow(10000.0, -2.0 * i / D);
        cs[p * D + i] = float(std::cos(f));
        cs[p * D + D / 2 + i] = float(std::sin(f));
      }
    auto x = round16(rand_vec(size_t(n) * H * D, -4, 4));
    std::vector<int32_t> pos = {0, 1, 99, 50, 7};
    std::vector<float> want(x);
    for (int t = 0; t < n; ++t)
      for (int h = 0; h < H; ++h)
        for (int i = 0; i < D / 2; ++i) {
          const size_t b = (size_t(t) * H + h) * D;
          const float c = cs[pos[t] * D + i], s = cs[pos[t] * D + D / 2 + i];
          want[b + i] = x[b + i] * c - x[b + D / 2 + i] * s;
          want[b + D / 2 + i] = x[b + D / 2 + i] * c + x[b + i] * s;
        }
    Dev dx(x, DType::F16), dcs(cs, DType::F32), dp(pos);
    cuda::rope(dx.p, (int32_t*)dp.p, (float*)dcs.p, n, H, D, DType::F16);
    expect_close("rope n5 H3 D64", dx.get(), want, 4e-3f, 2e-3f);
  }
  // matmul_nt
  struct MM { int n, in, out; DType act, w; bool bias; };
  for (MM m : {MM{3, 4096, 1000, DType::F16, DType::F16, true}, MM{37, 576, 1536, DType::F16, DType::F16, false},
               MM{5, 70, 33, DType::F32, DType::F32, true}, MM{17, 130, 45, DType::F16, DType::BF16, true},
               MM{2, 64, 9, DType::F32, DType::F16, false}}) {
    auto x = round16(rand_vec(size_t(m.n) * m.in));
    auto w = round16(rand_vec(size_t(m.out) * m.in, -0.1f, 0.1f));
    if (m.w == DType::BF16) for (auto& v : w) v = __bfloat162float(__float2bfloat16_rn(v));
    auto b = round16(rand_vec(m.out));
    std::vector<float> want(size_t(m.n) * m.out);
    for (int r = 0; r < m.n; ++r)
      for (int c = 0; c < m.out; ++c) {
        double a = m.bias ? b[c] : 0;
        for (int k = 0; k < m.in; ++k) a += double(x[size_t(r) * m.in + k]) * w[size_t(c) * m.in + k];
        want[size_t(r) * m.out + c] = float(a);
      }
    Dev dx(x, m.act), dw(w, m.w), db(b, m.act == DType::F16 ? DType::F16 : DType::F32),
        dy(std::vector<float>(want.size(), NAN), m.act);
    cuda::matmul_nt(dx.p, dw.p, m.w, m.bias ? db.p : nullptr, db.dt, dy.p, m.n, m.in, m.out, m.act);
    const float tol = m.act == DType::F16 ? 3e-3f : 1e-4f;
    expect_close("matmul_nt n" + std::to_string(m.n) + " in" + std::to_string(m.in) + " out" + std::to_string(m.out) +
                     " w" + dtype_name_local(m.w),
                 dy.get(), want, tol, tol);
  }
  // silu_mul / add (odd and even sizes)
  for (int numel : {1, 4097, 11008}) {
    auto g = round16(rand_vec(numel, -20, 20)), u = round16(rand_vec(numel, -3, 3));
    std::vector<float> ws(numel), wa(numel);
    for (int i = 0; i < numel; ++i) ws[i] = float(g[i] / (1 + std::exp(-double(g[i]))) * u[i]), wa[i] = g[i] + u[i];
    Dev dg(g, DType::F16), du(u, DType::F16), dout(std::vector<float>(numel), DType::F16);
    cuda::silu_mul(dg.p, du.p, dout.p, numel, DType::F16);
    expect_close("silu_mul numel " + std::to_string(numel), dout.get(), ws, 1e-3f, 2e-3f);
    cuda::add(dg.p, du.p, dg.p, numel, DType::F16);  // out aliases a
    expect_close("add numel " + std::to_string(numel), dg.get(), wa, 1e-3f, 2e-3f);
  }
  // kv_write: 2 seqs, shuffled pages
  {
    const int n = 7, KV = 2, D = 64, page = 4, pps = 3;
    std::vector<int32_t> pt = {4, 0, 2, 5, 1, 3}, pos = {0, 5, 11, 3, 4, 9, 10}, seq = {0, 0, 0, 1, 1, 1, 0};
    auto k = round16(rand_vec(size_t(n) * KV * D)), v = round16(rand_vec(size_t(n) * KV * D));
    std::vector<float> wk(size_t(6) * page * KV * D, 0.f), wv(wk);
    for (int t = 0; t < n; ++t) {
      const int pg = pt[seq[t] * pps + pos[t] / page];
      for (int e = 0; e < KV * D; ++e) {
        wk[(size_t(pg) * page + pos[t] % page) * KV * D + e] = k[size_t(t) * KV * D + e];
        wv[(size_t(pg) * page + pos[t] % page) * KV * D + e] = v[size_t(t) * KV * D + e];
      }
    }
    Dev dk(k, DType::F16), dv(v, DType::F16), dkp(std::vector<float>(wk.size(), 0.f), DType::F16),
        dvp(std::vector<float>(wk.size(), 0.f), DType::F16), dpt(pt), dpos(pos), dseq(seq);
    cuda::kv_write(dk.p, dv.p, dkp.p, dvp.p, DType::F16, (int32_t*)dpos.p, (int32_t*)dseq.p, (int32_t*)dpt.p, pps, n,
                   page, KV, D, DType::F16);
    expect_close("kv_write k", dkp.get(), wk, 0, 0);
    expect_close("kv_write v", dvp.get(), wv, 0, 0);
  }
  // convert f32 -> f16 -> bf16 -> f32
  {
    auto x = rand_vec(1001, -70000, 70000);
    Dev a(x, DType::F32), b(std::vector<float>(x.size()), DType::F16), c(std::vector<float>(x.size()), DType::BF16);
    cuda::convert(a.p, DType::F32, b.p, DType::F16, 1001);
    cuda::convert(a.p, DType::F32, c.p, DType::BF16, 1001);
    std::vector<float> w16(x.size()), wbf(x.size());
    for (size_t i = 0; i < x.size(); ++i) w16[i] = r16(x[i]), wbf[i] = __bfloat162float(__float2bfloat16_rn(x[i]));
    expect_close("convert f32->f16 (inf beyond 65504)", b.get(), w16, 0, 0);
    expect_close("convert f32->bf16", c.get(), wbf, 0, 0);
  }
  // embedding with an out-of-range id (clamped, flagged)
  {
    const int V = 50, H = 33;
    auto table = rand_vec(size_t(V) * H);
    std::vector<int32_t> ids = {3, 0, 49, 7};
    std::vector<float> want;
    for (int id : ids) for (int i = 0; i < H; ++i) want.push_back(r16(table[id * H + i]));
    Dev dt(table, DType::F32), di(ids), dout(std::vector<float>(want.size()), DType::F16);
    cuda::embedding((int32_t*)di.p, 4, dt.p, DType::F32, V, H, dout.p, DType::F16);
    expect_close("embedding", dout.get(), want, 0, 0);
    const bool clean = !cuda::embedding_take_oob_flag();
    std::vector<int32_t> bad = {51};
    Dev db(bad);
    cuda::embedding((int32_t*)db.p, 1, dt.p, DType::F32, V, H, dout.p, DType::F16);
    const bool flagged = cuda::embedding_take_oob_flag();
    (clean && flagged ? g_pass : g_fail)++;
    std::printf("%s embedding out-of-range flag (clean %d, flagged %d)\n", clean && flagged ? "ok  " : "FAIL", clean,
                flagged);
  }
  // sampling: softmax with temperature, greedy one-hot, argmax, top-k with ties
  {
    const int rows = 3, V = 32001;
    auto x = rand_vec(size_t(rows) * V, -10, 10);
    x[5] = 50.f;                       // row 0 max
    x[V + 77] = 30.f, x[V + 78] = 30.f;  // row 1 tie: lower index wins
    std::vector<float> want(x.size());
    for (int r = 0; r < rows; ++r) {
      double mx = -1e30, l = 0;
      for (int i = 0; i < V; ++i) mx = std::max(mx, double(x[r * V + i]) / 0.7);
      for (int i = 0; i < V; ++i) l += std::exp(x[r * V + i] / 0.7 - mx);
      for (int i = 0; i < V; ++i) want[r * V + i] = float(std::exp(x[r * V + i] / 0.7 - mx) / l);
    }
    Dev dx(x, DType::F32), dp(std::vector<float>(x.size()), DType::F32), di{std::vector<int32_t>(size_t(rows))},
        tv(std::vector<float>(rows * 5), DType::F32), ti{std::vector<int32_t>(size_t(rows) * 5)};
    cuda::softmax_rows((float*)dx.p, (float*)dp.p, rows, V, 0.7f);
    expect_close("softmax_rows T=0.7", dp.get(), want, 1e-7f, 1e-4f);
    cuda::argmax_rows((float*)dx.p, rows, V, (int32_t*)di.p);
    auto am = di.get();
    std::vector<float> want_am(rows);
    for (int r = 0; r < rows; ++r) want_am[r] = float(std::max_element(x.begin() + r * V, x.begin() + (r + 1) * V) - (x.begin() + r * V));
    expect_close("argmax_rows", am, want_am, 0, 0);
    cuda::topk_rows((float*)dx.p, rows, V, 5, (float*)tv.p, (int32_t*)ti.p);
    std::vector<float> wv, wi;
    for (int r = 0; r < rows; ++r) {
      std::vector<int> idx(V);
      for (int i = 0; i < V; ++i) idx[i] = i;
      std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return x[r * V + a] > x[r * V + b]; });
      for (int k = 0; k < 5; ++k) wv.push_back(x[r * V + idx[k]]), wi.push_back(float(idx[k]));
    }
    expect_close("topk_rows values", tv.get(), wv, 0, 0);
    expect_close("topk_rows indices", ti.get(), wi, 0, 0);
    cuda::softmax_rows((float*)dx.p, (float*)dx.p, rows, V, 0.f);  // greedy, in place
    auto g = dx.get();
    std::vector<float> wg(x.size(), 0.f);
    for (int r = 0; r < rows; ++r) wg[r * V + int(want_am[r])] = 1.f;
    expect_close("softmax_rows greedy one-hot in place", g, wg, 0, 0);
  }
}

int main(int argc, char** argv) {
  // --reference: option cuda_reference on (the simple reference kernels), as load(options=) would set it
  if (argc > 1 && std::strcmp(argv[1], "--reference") == 0) {
    RuntimeOptions o = runtime_options();
    o.cuda_reference = true;
    set_runtime_options(o);
  }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("no CUDA device\n");
    return 2;
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  std::printf("check_kernels on %s (sm_%d%d), cuda_reference=%s\n", prop.name, prop.major, prop.minor,
              cuda::ref_kernels_enabled() ? "true" : "false");
  try {
    attention_cases();
    other_cases();
  } catch (const std::exception& e) {
    std::printf("FAIL exception: %s\n", e.what());
    ++g_fail;
  }
  std::printf("check_kernels: %d passed, %d failed\n", g_pass, g_fail);
  return g_fail ? 1 : 0;
}
