// Standalone benchmark and check of the experimental tiled EXL2 decode GEMV (dev/kernels/exl2_gemv_tiled.cuh) against the library kernel
// (cuda/exl2_gemv_kernel.cuh), without the library: random disk-layout layers (random q_weight words are
// valid random codes) of Llama shapes at 2.5/4.0/6.0 bpw (bench/bench_exl2.py's bit mixes, 128-row groups),
// repacked on the GPU by exl2_repack_kernel.
//   check: y vs a float64 CPU reference on exactly dequantized weights (decoded from the disk words by the spec
//          rule, independently of the repack), all m and split variants; exl2_dequant_kernel bit for bit.
//   time:  m = 1, 4, 8, 16; median over 5 runs of the mean of 200 launches (CUDA events), rotating enough weight
//          copies (>= 320 MB) that L2 holds none; stream launches and a CUDA graph of the same 200 launches.
//          GB/s = (q_weight + scales) bytes / time, next to the cudaMemcpy D2D bandwidth (2 * bytes / time).
// Build and run (any CUDA GPU, sm_80+):
//   nvcc -std=c++17 -O3 -arch=sm_90 -I. dev/kernels/exl2_gemv_bench.cu -o /tmp/gb && /tmp/gb [quick]
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "dev/kernels/exl2_gemv_tiled.cuh"
#include "cuda/exl2_gemv_kernel.cuh"  // the library kernel, the baseline

using namespace exl2::cuda::exl2t;

#define CK(x)                                                                                     \
  do {                                                                                            \
    cudaError_t e_ = (x);                                                                         \
    if (e_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));     \
      std::exit(1);                                                                               \
    }                                                                                             \
  } while (0)

namespace {

uint64_t g_rng = 0x9E3779B97F4A7C15ull;
uint32_t rnd() {
  g_rng ^= g_rng << 13;
  g_rng ^= g_rng >> 7;
  g_rng ^= g_rng << 17;
  return uint32_t(g_rng >> 16);
}
float urand() { return (rnd() & 0xffffff) / float(0x1000000); }

float h2f(uint16_t h) {
  __half x;
  std::memcpy(&x, &h, 2);
  return __half2float(x);
}
uint16_t f2h(float f) {
  __half x = __float2half_rn(f);
  uint16_t h;
  std::memcpy(&h, &x, 2);
  return h;
}

struct Layer {
  int64_t in, out, out_pad, tiles, G;
  int max_bits = 0;
  std::vector<TileGroup> groups;
  std::vector<uint32_t> qw;      // disk [qrows][out_pad]
  std::vector<uint32_t> qs;      // disk [G][out_pad/8]
  std::vector<uint16_t> msc;     // [G]
  std::vector<int32_t> perm;     // [in]
  TileTables tt;
  std::vector<uint16_t> tscales;
  double bytes;  // q_weight + q_scale bytes (disk)
};

Layer make_layer(int64_t in, int64_t out, double bpw) {
  Layer L;
  L.in = in;
  L.out = out;
  L.out_pad = (out + 31) / 32 * 32;
  L.tiles = (L.out_pad + 127) / 128;
  const int64_t G = in / 128;
  L.G = G;
  std::vector<std::pair<int, double>> mix;
  if (bpw == 2.5) mix = {{4, 0.1}, {3, 0.3}, {2, 0.6}};
  else if (bpw == 4.0) mix = {{5, 0.1}, {4, 0.8}, {3, 0.1}};
  else mix = {{8, 0.05}, {6, 0.85}, {5, 0.1}};
  std::vector<int> bits;
  for (size_t i = 0; i + 1 < mix.size(); ++i)
    for (int n = int(std::lround(mix[i].second * G)); n > 0; --n) bits.push_back(mix[i].first);
  while (int64_t(bits.size()) < G) bits.push_back(mix.back().first);
  int64_t qrow = 0;
  for (int64_t g = 0; g < G; ++g) {
    L.groups.push_back({bits[g], qrow, g * 128, 128});
    L.max_bits = std::max(L.max_bits, bits[g]);
    qrow += 128 * bits[g] / 32;
  }
  L.qw.resize(size_t(qrow * L.out_pad));
  for (auto& w : L.qw) w = rnd();
  L.qs.resize(size_t(G * L.out_pad / 8));
  for (auto& w : L.qs) w = rnd();
  L.msc.resize(size_t(G));
  for (auto& m : L.msc) m = f2h(float(std::exp2(-4.0 - 12.0 * urand())) / 256.f);  // some subnormal
  L.perm.resize(size_t(in));
  for (int64_t i = 0; i < in; ++i) L.perm[i] = int32_t(i);
  for (int64_t i = in - 1; i > 0; --i) std::swap(L.perm[i], L.perm[rnd() % (i + 1)]);
  if (!make_tile_tables(L.groups, L.perm.data(), L.tt)) std::exit(2);
  L.tscales = make_tile_scales(L.qs.data(), G, L.out_pad, L.tiles);
  L.bytes = double(L.qw.size()) * 4 + double(L.qs.size()) * 4;
  return L;
}

// W [in (packed order)][out] f16 bits, decoded from the disk words by the spec rule.
std::vector<uint16_t> ref_dequant(const Layer& L) {
  std::vector<uint16_t> W(size_t(L.in * L.out));
  for (int64_t g = 0; g < L.G; ++g) {
    const TileGroup& gr = L.groups[g];
    const int b = gr.bits;
    for (int64_t n = 0; n < L.out; ++n) {
      const int nib = (L.qs[g * (L.out_pad / 8) + n / 8] >> (4 * (n % 8))) & 15;
      const __half s = __hmul_rn(__float2half_rn(float((nib + 1) * (nib + 1))), *(const __half*)&L.msc[g]);
      for (int64_t r = 0; r < gr.rows; ++r) {
        const int64_t bit = r * b, qr = gr.qrow_start + bit / 32, sh = bit % 32;
        uint64_t v = L.qw[qr * L.out_pad + n];
        if (sh + b > 32) v |= uint64_t(L.qw[(qr + 1) * L.out_pad + n]) << 32;
        const int q = int((v >> sh) & ((1u << b) - 1));
        const __half w = __hmul_rn(__float2half_rn(float(q - (1 << (b - 1)))), s);
        std::memcpy(&W[(gr.row_start + r) * L.out + n], &w, 2);
      }
    }
  }
  return W;
}

struct Dev {
  std::vector<uint32_t*> q;       // tiled copies
  std::vector<uint16_t*> sc;      // tiled scale copies
  std::vector<uint32_t*> qold;    // disk copies (old kernel)
  std::vector<uint32_t*> scold;
  __half* msc;
  int32_t *perm_u, *perm;
  int4 *units, *units_old;
  float* bias = nullptr;
  float* acc;
  unsigned* counters;
};

template <int M>
void launch_new(const Layer& L, const Dev& D, int copy, const __half* x, int m, __half* y, int bps, cudaStream_t st) {
  static bool attr = false;
  if (!attr) {
    CK(cudaFuncSetAttribute(exl2_gemv_kernel<M>, cudaFuncAttributeMaxDynamicSharedMemorySize, 160 * 1024));
    attr = true;
  }
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const GemvPlan p = gemv_plan(L.tt.n_units, L.tiles, L.max_bits, M, sms, bps);
  dim3 grid{unsigned(L.tiles), unsigned(p.splits)};
  exl2_gemv_kernel<M><<<grid, kGemvThreads, p.smem, st>>>(
      x, L.in, m, D.q[copy], L.tt.tile_words, D.sc[copy], L.tiles * 32, D.msc, D.perm_u, D.units, int(L.tt.n_units),
      p.ups, L.max_bits, D.bias, y, L.out, D.acc, L.tiles * 128, D.counters);
}

template <int M>
void launch_old(const Layer& L, const Dev& D, int copy, const __half* x, int m, __half* y, cudaStream_t st) {
  constexpr int kSmem = 32 * 1024;
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  static int resident = 0;
  if (!resident) {
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, exl2::cuda::exl2k::exl2_gemv_kernel<M>, 128, kSmem / 4));
    resident = std::max(1, std::min(resident, 8));
  }
  const int64_t col_tiles = (L.out_pad + 511) / 512;
  const int n_units = int(L.tt.n_units);
  const int max_ups = std::max(1, kSmem / (32 * M * 4));
  int64_t slices = std::min<int64_t>(std::max<int64_t>(1, (int64_t(sms) * resident + col_tiles - 1) / col_tiles), n_units);
  int ups = int((n_units + slices - 1) / slices);
  ups = std::min(ups, max_ups);
  slices = (n_units + ups - 1) / ups;
  dim3 grid{unsigned(col_tiles), unsigned(slices)};
  exl2::cuda::exl2k::exl2_gemv_kernel<M><<<grid, 128, size_t(ups) * 32 * M * 4, st>>>(
      x, L.in, m, D.qold[copy], D.scold[copy], D.msc, D.perm, D.units_old, n_units, ups, D.bias, y, L.out,
      L.out_pad, D.acc, D.counters);
}

// variant: -1 = old kernel, else new kernel with that many target blocks per SM.
void launch(int variant, const Layer& L, const Dev& D, int copy, const __half* x, int m, __half* y, cudaStream_t st) {
  const int M = m == 1 ? 1 : m == 2 ? 2 : m <= 4 ? 4 : m <= 8 ? 8 : 16;
  if (variant < 0) {
    switch (M) {
      case 1: launch_old<1>(L, D, copy, x, m, y, st); break;
      case 2: launch_old<2>(L, D, copy, x, m, y, st); break;
      case 4: launch_old<4>(L, D, copy, x, m, y, st); break;
      case 8: launch_old<8>(L, D, copy, x, m, y, st); break;
      default: launch_old<16>(L, D, copy, x, m, y, st); break;
    }
  } else {
    switch (M) {
      case 1: launch_new<1>(L, D, copy, x, m, y, variant, st); break;
      case 2: launch_new<2>(L, D, copy, x, m, y, variant, st); break;
      case 4: launch_new<4>(L, D, copy, x, m, y, variant, st); break;
      case 8: launch_new<8>(L, D, copy, x, m, y, variant, st); break;
      default: launch_new<16>(L, D, copy, x, m, y, variant, st); break;
    }
  }
  CK(cudaGetLastError());
}

Dev upload(const Layer& L, int copies) {
  Dev D;
  // Repack once on the GPU from the disk words, then copy.
  uint32_t* qdisk;
  int4* units;
  int32_t* qrow;
  const size_t tq = size_t(L.tiles * L.tt.tile_words * 128);
  CK(cudaMalloc(&qdisk, L.qw.size() * 4));
  CK(cudaMemcpy(qdisk, L.qw.data(), L.qw.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMalloc(&units, L.tt.units.size() * 4));
  CK(cudaMemcpy(units, L.tt.units.data(), L.tt.units.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMalloc(&qrow, L.tt.qrow.size() * 4));
  CK(cudaMemcpy(qrow, L.tt.qrow.data(), L.tt.qrow.size() * 4, cudaMemcpyHostToDevice));
  uint32_t* q0;
  CK(cudaMalloc(&q0, tq * 4));
  exl2_repack_kernel<<<dim3(unsigned(L.tt.n_units), unsigned(L.tiles)), 128>>>(qdisk, L.out_pad, units, qrow,
                                                                              L.tt.tile_words, q0);
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  D.units = units;
  std::vector<int32_t> uo = L.tt.units;
  for (int64_t u = 0; u < L.tt.n_units; ++u) uo[4 * u] = L.tt.qrow[u];
  CK(cudaMalloc(&D.units_old, uo.size() * 4));
  CK(cudaMemcpy(D.units_old, uo.data(), uo.size() * 4, cudaMemcpyHostToDevice));
  for (int c = 0; c < copies; ++c) {
    uint32_t* q;
    uint16_t* s;
    uint32_t *qo, *so;
    if (c == 0) q = q0;
    else {
      CK(cudaMalloc(&q, tq * 4));
      CK(cudaMemcpy(q, q0, tq * 4, cudaMemcpyDeviceToDevice));
    }
    CK(cudaMalloc(&s, L.tscales.size() * 2));
    CK(cudaMemcpy(s, L.tscales.data(), L.tscales.size() * 2, cudaMemcpyHostToDevice));
    if (c == 0) qo = qdisk;
    else {
      CK(cudaMalloc(&qo, L.qw.size() * 4));
      CK(cudaMemcpy(qo, qdisk, L.qw.size() * 4, cudaMemcpyDeviceToDevice));
    }
    CK(cudaMalloc(&so, L.qs.size() * 4));
    CK(cudaMemcpy(so, L.qs.data(), L.qs.size() * 4, cudaMemcpyHostToDevice));
    D.q.push_back(q);
    D.sc.push_back(s);
    D.qold.push_back(qo);
    D.scold.push_back(so);
  }
  CK(cudaFree(qrow));
  CK(cudaMalloc(&D.msc, L.msc.size() * 2));
  CK(cudaMemcpy(D.msc, L.msc.data(), L.msc.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMalloc(&D.perm_u, L.tt.perm_u.size() * 4));
  CK(cudaMemcpy(D.perm_u, L.tt.perm_u.data(), L.tt.perm_u.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMalloc(&D.perm, L.perm.size() * 4));
  CK(cudaMemcpy(D.perm, L.perm.data(), L.perm.size() * 4, cudaMemcpyHostToDevice));
  std::vector<float> bias(size_t(L.out));
  for (auto& b : bias) b = urand() - 0.5f;
  CK(cudaMalloc(&D.bias, bias.size() * 4));
  CK(cudaMemcpy(D.bias, bias.data(), bias.size() * 4, cudaMemcpyHostToDevice));
  const size_t accn = size_t(16 * L.tiles * 128);
  CK(cudaMalloc(&D.acc, accn * 4));
  CK(cudaMemset(D.acc, 0, accn * 4));
  CK(cudaMalloc(&D.counters, size_t(L.tiles * 4 + 64) * 4));
  CK(cudaMemset(D.counters, 0, size_t(L.tiles * 4 + 64) * 4));
  return D;
}

void release(Dev& D) {
  for (auto p : D.q) cudaFree(p);
  for (auto p : D.sc) cudaFree(p);
  for (auto p : D.qold) cudaFree(p);
  for (auto p : D.scold) cudaFree(p);
  cudaFree(D.msc);
  cudaFree(D.perm_u);
  cudaFree(D.perm);
  cudaFree(D.units);
  cudaFree(D.units_old);
  cudaFree(D.bias);
  cudaFree(D.acc);
  cudaFree(D.counters);
}

// rel L2 of y (m rows) vs float64 reference; returns -1 on unwritten/NaN outputs.
double check(const Layer& L, Dev& D, const std::vector<uint16_t>& W, int variant, int m, int* bad_dq) {
  std::vector<uint16_t> xh(size_t(m * L.in));
  for (auto& v : xh) v = f2h(urand() * 6.f - 3.f);
  __half *x, *y;
  CK(cudaMalloc(&x, xh.size() * 2));
  CK(cudaMalloc(&y, size_t(m * L.out) * 2));
  CK(cudaMemcpy(x, xh.data(), xh.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMemset(y, 0xff, size_t(m * L.out) * 2));  // NaN poison
  std::vector<float> bias(size_t(L.out));
  CK(cudaMemcpy(bias.data(), D.bias, bias.size() * 4, cudaMemcpyDeviceToHost));
  for (int rep = 0; rep < 2; ++rep) launch(variant, L, D, 0, x, m, y, 0);  // twice: acc must come back clean
  CK(cudaDeviceSynchronize());
  std::vector<uint16_t> yh(size_t(m * L.out));
  CK(cudaMemcpy(yh.data(), y, yh.size() * 2, cudaMemcpyDeviceToHost));
  double num = 0, den = 0;
  bool nan = false;
  for (int i = 0; i < m; ++i) {
    std::vector<double> r(size_t(L.out), 0.0);
    for (int64_t k = 0; k < L.in; ++k) {
      const double xv = h2f(xh[size_t(i * L.in + L.perm[k])]);
      const uint16_t* wr = &W[size_t(k * L.out)];
      for (int64_t n = 0; n < L.out; ++n) r[n] += xv * h2f(wr[n]);
    }
    for (int64_t n = 0; n < L.out; ++n) {
      const double ref = r[n] + bias[n], got = h2f(yh[size_t(i * L.out + n)]);
      if (!std::isfinite(got)) nan = true;
      num += (got - ref) * (got - ref);
      den += ref * ref;
    }
  }
  if (bad_dq) {  // dequant kernel, bit for bit (packed order)
    const int64_t Kp = L.tt.n_units * 32, width = L.tiles * 128;
    __half* wp;
    CK(cudaMalloc(&wp, size_t(Kp * width) * 2));
    exl2_dequant_kernel<__half><<<dim3(unsigned(L.tiles), unsigned((L.tt.n_units + 3) / 4)), 128>>>(
        D.q[0], L.tt.tile_words, D.sc[0], L.tiles * 32, D.msc, D.units, int(L.tt.n_units), 0, width, wp);
    CK(cudaGetLastError());
    std::vector<uint16_t> wh(size_t(Kp * width));
    CK(cudaMemcpy(wh.data(), wp, wh.size() * 2, cudaMemcpyDeviceToHost));
    CK(cudaFree(wp));
    int bad = 0;
    for (int64_t u = 0; u < L.tt.n_units; ++u) {
      const int row = L.tt.units[4 * u + 1], nv = (L.tt.units[4 * u + 3] >> 8) & 0xff;
      for (int v = 0; v < 32; ++v)
        for (int64_t n = 0; n < width; ++n) {
          const uint16_t got = wh[size_t((u * 32 + v) * width + n)];
          const uint16_t want = (v < nv && n < L.out) ? W[size_t((row + v) * L.out + n)] : got;
          if (v >= nv && (got & 0x7fff) != 0) ++bad;
          if (got != want) ++bad;
        }
    }
    *bad_dq = bad;
  }
  CK(cudaFree(x));
  CK(cudaFree(y));
  return nan ? -1.0 : std::sqrt(num / den);
}

struct Timing {
  double stream_us, graph_us;
};

Timing time_variant(const Layer& L, Dev& D, int variant, int m, __half* x, __half* y, cudaStream_t st) {
  const int iters = 200, copies = int(D.q.size());
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < 8; ++i) launch(variant, L, D, i % copies, x, m, y, st);
  std::vector<double> ts;
  for (int rep = 0; rep < 5; ++rep) {
    CK(cudaEventRecord(a, st));
    for (int i = 0; i < iters; ++i) launch(variant, L, D, (rep * iters + i) % copies, x, m, y, st);
    CK(cudaEventRecord(b, st));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    ts.push_back(ms * 1e3 / iters);
  }
  std::sort(ts.begin(), ts.end());
  Timing t;
  t.stream_us = ts[2];
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < iters; ++i) launch(variant, L, D, i % copies, x, m, y, st);
  CK(cudaStreamEndCapture(st, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));
  CK(cudaGraphLaunch(ge, st));
  ts.clear();
  for (int rep = 0; rep < 5; ++rep) {
    CK(cudaEventRecord(a, st));
    CK(cudaGraphLaunch(ge, st));
    CK(cudaEventRecord(b, st));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    ts.push_back(ms * 1e3 / iters);
  }
  std::sort(ts.begin(), ts.end());
  t.graph_us = ts[2];
  CK(cudaGraphExecDestroy(ge));
  CK(cudaGraphDestroy(g));
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::string(argv[1]) == "quick";
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("GPU %s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20);
  // Copy bandwidth: cudaMemcpy D2D of 1 GiB, best of 5.
  double copy_bw = 0;
  {
    const size_t n = size_t(1) << 30;
    void *a, *b;
    CK(cudaMalloc(&a, n));
    CK(cudaMalloc(&b, n));
    CK(cudaMemset(a, 1, n));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    for (int r = 0; r < 6; ++r) {
      CK(cudaEventRecord(e0));
      CK(cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice));
      CK(cudaEventRecord(e1));
      CK(cudaEventSynchronize(e1));
      float ms;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      if (r) copy_bw = std::max(copy_bw, 2.0 * n / (ms * 1e-3));
    }
    cudaFree(a);
    cudaFree(b);
  }
  std::printf("cudaMemcpy D2D bandwidth: %.0f GB/s\n", copy_bw / 1e9);

  const int variants[] = {-1, 1, 2, 3, 4};
  const int nvar = 5;
  // ---- checks
  int fails = 0;
  {
    struct C { int64_t in, out; double bpw; };
    const C cs[] = {{4096, 1024, 4.0}, {1024, 4096, 2.5}, {256, 20480, 6.0}, {11008, 256, 4.0}};
    for (const C& c : cs) {
      Layer L = make_layer(c.in, c.out, c.bpw);
      Dev D = upload(L, 1);
      const std::vector<uint16_t> W = ref_dequant(L);
      for (int m : {1, 2, 3, 4, 7, 8, 16}) {
        for (int v : variants) {
          int bad = 0;
          const double e = check(L, D, W, v, m, v == 1 && m == 1 ? &bad : nullptr);
          const bool ok = e >= 0 && e < (v < 0 ? 1e-3 : 2e-3) && bad == 0;
          if (!ok || m == 1 || m == 16)
            std::printf("check %s %5lldx%-5lld %.1fbpw m=%2d variant %2d: rel L2 %.2e%s%s\n", ok ? "ok  " : "FAIL",
                        (long long)c.in, (long long)c.out, c.bpw, m, v, e, v == 1 && m == 1 ? ", dequant mismatches " : "",
                        v == 1 && m == 1 ? std::to_string(bad).c_str() : "");
          fails += ok ? 0 : 1;
        }
      }
      release(D);
    }
  }
  std::printf("checks: %d failed\n", fails);

  // ---- timing
  struct S { const char* name; int64_t in, out; };
  const S shapes[] = {{"qkvo", 4096, 4096}, {"gate/up", 4096, 11008}, {"down", 11008, 4096}, {"l3 k/v", 4096, 1024},
                      {"l3 gate", 4096, 14336}, {"l3 down", 14336, 4096}};
  const double bpws[] = {2.5, 4.0, 6.0};
  std::vector<std::string> table;
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  __half *x, *y;
  CK(cudaMalloc(&x, 16 * 14336 * 2));
  CK(cudaMalloc(&y, 16 * 14336 * 2));
  {
    std::vector<uint16_t> xh(16 * 14336);
    for (auto& v : xh) v = f2h(urand() * 2.f - 1.f);
    CK(cudaMemcpy(x, xh.data(), xh.size() * 2, cudaMemcpyHostToDevice));
  }
  std::printf("\n%-8s %11s %4s %2s | %-21s | %s\n", "shape", "in x out", "bpw", "m",
              "old: us (graph us) %bw", "new bps1 / bps2 / bps3 / bps4: graph us (%bw)   stream us of best");
  for (const S& s : shapes) {
    if (quick && s.in != 4096) continue;
    for (double bpw : bpws) {
      Layer L = make_layer(s.in, s.out, bpw);
      const int copies = std::max(4, int(std::ceil(320e6 / L.bytes)));
      Dev D = upload(L, copies);
      for (int m : {1, 4, 8, 16}) {
        char line[512];
        int p = std::snprintf(line, sizeof line, "%-8s %5lldx%-5lld %.1f %2d |", s.name, (long long)s.in,
                              (long long)s.out, bpw, m);
        double best = 1e9, best_stream = 0;
        for (int vi = 0; vi < nvar; ++vi) {
          const Timing t = time_variant(L, D, variants[vi], m, x, y, st);
          const double pct = 100.0 * L.bytes / (t.graph_us * 1e-6) / copy_bw;
          if (variants[vi] < 0)
            p += std::snprintf(line + p, sizeof line - p, " %6.1f (%6.1f) %4.0f%% |", t.stream_us, t.graph_us, pct);
          else {
            p += std::snprintf(line + p, sizeof line - p, " %6.1f (%3.0f%%)", t.graph_us, pct);
            if (t.graph_us < best) best = t.graph_us, best_stream = t.stream_us;
          }
        }
        std::snprintf(line + p, sizeof line - p, "  | %6.1f", best_stream);
        std::printf("%s\n", line);
        std::fflush(stdout);
      }
      release(D);
    }
  }
  CK(cudaDeviceSynchronize());
  return fails ? 1 : 0;
}
