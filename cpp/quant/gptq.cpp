// GPTQ ops (validation, host/device copies, dispatch) and the CPU reference kernels of cpp/quant/gptq.h.
// Compiled without floating-point contraction: every fp32 expression below is one IEEE-rounded operation at a
// time, the same sequence as the CUDA kernels' __f*_rn intrinsics, so the two backends agree bit for bit.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "quant/gptq.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "backend/cpu/thread_pool.h"
#include "exl2/errors.h"

namespace exl2 {

namespace {

inline float f16_round(float v) { return f16_to_f32(f32_to_f16(v)); }

// p_i of the scale search, as float (computed in double like the Python reference).
inline float grid_p(int i) { return static_cast<float>(0.70 + 0.50 * static_cast<double>(i) / kGptqGrid); }

// Pairwise tree sum of kGptqChunk slots (the CUDA block's order).
double chunk_tree(double* slot) {
  for (int s = kGptqChunk / 2; s > 0; s >>= 1)
    for (int t = 0; t < s; ++t) slot[t] += slot[t + s];
  return slot[0];
}

struct Search {
  std::vector<float> qs;  // [out], 1..16
  float smax = 0.f;
};

Search search_base(const float* w, int64_t rows, int64_t out, int bits) {
  const int maxq = (1 << bits) - 1;
  const float den = static_cast<float>(static_cast<double>(maxq) / 2.0);
  Search s;
  s.qs.assign(static_cast<size_t>(out), 0.f);
  std::vector<float> base(static_cast<size_t>(out));
  for (int64_t j = 0; j < out; ++j) {
    float m = 0.f;
    for (int64_t r = 0; r < rows; ++r) m = std::max(m, std::fabs(w[r * out + j]));
    base[j] = (m + 1e-12f) / den;
    s.smax = std::max(s.smax, base[j]);
  }
  for (int64_t j = 0; j < out; ++j) {
    float q = std::nearbyint(16.0f * std::sqrt(base[j] / s.smax));
    s.qs[j] = std::min(16.0f, std::max(1.0f, q));
  }
  return s;
}

// The row weight of the Hessian-weighted searches: 1 / U[c, c]^2 (GPTQ's cost of an error in row c).
inline float row_weight(const float* u, int64_t in, int64_t c) {
  const float ucc = u[c * in + c];
  return 1.0f / (ucc * ucc);
}

// One term of a search error (see the header): |d|^2 * |d|^1.5 (absmax) or |d|^2 * h_r (hmse), in fp64.
inline double search_term(float d, float h, GptqSearch mode) {
  const float d2 = d * d;
  if (mode == GptqSearch::kHessianMse) return static_cast<double>(d2) * static_cast<double>(h);
  const float d15 = std::sqrt(d) * d;
  return static_cast<double>(d2) * static_cast<double>(d15);
}

// err_i for one grid point (see the header for the exact order); h: the group's row weights.
double search_err(const float* w, int64_t rows, int64_t out, int bits, const Search& s, int i, const float* h,
                  GptqSearch mode) {
  const int maxq = (1 << bits) - 1;
  const float lo = -static_cast<float>(1 << (bits - 1)), hi = static_cast<float>(maxq - (1 << (bits - 1)));
  const float p = grid_p(i);
  const int64_t n_chunks = (out + kGptqChunk - 1) / kGptqChunk;
  std::vector<double> chunk(static_cast<size_t>(n_chunks));
  cpu::parallel_for(n_chunks, 1, [&](int64_t c0, int64_t c1) {
    std::vector<double> slot(kGptqChunk);
    std::vector<float> sp(kGptqChunk);
    for (int64_t c = c0; c < c1; ++c) {
      std::fill(slot.begin(), slot.end(), 0.0);
      const int64_t j0 = c * kGptqChunk, nj = std::min<int64_t>(kGptqChunk, out - j0);
      for (int64_t t = 0; t < nj; ++t) {
        const float qs16 = s.qs[j0 + t] / 16.0f;
        sp[t] = (qs16 * qs16 * s.smax) * p;
      }
      for (int64_t r = 0; r < rows; ++r) {
        const float* wr = w + r * out + j0;
        for (int64_t t = 0; t < nj; ++t) {
          float q = std::nearbyint(wr[t] / sp[t]);
          q = std::min(hi, std::max(lo, q));
          const float d = std::fabs(q * sp[t] - wr[t]);
          slot[t] += search_term(d, h[r], mode);
        }
      }
      chunk[c] = chunk_tree(slot.data());
    }
  });
  double e = 0.0;
  for (double v : chunk) e += v;
  return e;
}

// hmse's per-column refinement: for every column j the scale code n in 1..16 with the least
// sum_r h_r * (w[r, j] - dq)^2 (dq as the runtime dequantizes with scale fp16(n^2 * msc); fp64, r increasing;
// ties keep the smaller n). Overwrites s.qs.
void refine_columns(const float* w, int64_t rows, int64_t out, int bits, float msc, const float* h, Search& s) {
  const int maxq = (1 << bits) - 1;
  const float z = static_cast<float>(1 << (bits - 1)), fmaxq = static_cast<float>(maxq);
  cpu::parallel_for(out, 64, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      double best_e = 0.0;
      float best_n = 0.f;
      for (int n = 1; n <= 16; ++n) {
        const float fn = static_cast<float>(n);
        const float scale = f16_round(fn * fn * msc);
        double e = 0.0;
        for (int64_t r = 0; r < rows; ++r) {
          const float x = w[r * out + j];
          float dq = 0.f;
          if (scale > 0.f) {
            float q = std::nearbyint(x / scale) + z;
            q = std::min(fmaxq, std::max(0.f, q));
            dq = f16_round((q - z) * scale);
          }
          const float d = x - dq;
          e += static_cast<double>(d * d) * static_cast<double>(h[r]);
        }
        if (n == 1 || e < best_e) best_e = e, best_n = fn;
      }
      s.qs[j] = best_n;
    }
  });
}

// Runs the scale search; returns the best grid index.
int search_best(const float* w, int64_t rows, int64_t out, int bits, const Search& s, const float* h,
                GptqSearch mode) {
  std::vector<double> cache(kGptqGrid + 1, -1.0);
  auto e = [&](int i) {
    if (cache[i] < 0) cache[i] = search_err(w, rows, out, bits, s, i, h, mode);
    return cache[i];
  };
  int best = 0;
  for (int i = 0; i <= kGptqGrid; i += 4)
    if (e(i) < e(best)) best = i;
  const int c = best;
  best = std::max(0, c - 3);
  for (int i = std::max(0, c - 3); i <= std::min(kGptqGrid, c + 3); ++i)
    if (e(i) < e(best)) best = i;
  return best;
}

}  // namespace

namespace cpu {

void gptq_quantize(float* w, const float* u, const int* group_bits, const int64_t* group_rows, int64_t n_groups,
                   int64_t in, int64_t out, uint8_t* codes, uint8_t* nibbles, uint16_t* q_scale_max, float* deq,
                   GptqSearch search) {
  int64_t max_rows = 0;
  for (int64_t g = 0; g < n_groups; ++g) max_rows = std::max(max_rows, group_rows[g]);
  std::vector<float> err(static_cast<size_t>(max_rows * out));
  std::vector<float> scale(static_cast<size_t>(out));
  std::vector<float> h(static_cast<size_t>(max_rows));
  int64_t a = 0;
  for (int64_t g = 0; g < n_groups; ++g) {
    const int bits = group_bits[g];
    const int64_t rows = group_rows[g], b = a + rows;
    const int maxq = (1 << bits) - 1;
    const float z = static_cast<float>(1 << (bits - 1)), fmaxq = static_cast<float>(maxq);
    float* wg = w + a * out;
    for (int64_t r = 0; r < rows; ++r)
      h[r] = search == GptqSearch::kHessianMse ? row_weight(u, in, a + r) : 1.0f;
    Search s = search_base(wg, rows, out, bits);
    const int best = search_best(wg, rows, out, bits, s, h.data(), search);
    const float qsm = s.smax * grid_p(best);
    EXL2_CHECK(std::isfinite(qsm) && qsm <= 65504.f, "GPTQ: group ", g, " (input rows ", a, "..", b,
               ") needs scale ", qsm, ", beyond fp16; the weights are too large for EXL2's fp16 scales");
    const uint16_t qsm16 = f32_to_f16(qsm);
    q_scale_max[g] = qsm16;
    const float msc = f16_round(f16_to_f32(qsm16) * (1.0f / 256.0f));
    if (search == GptqSearch::kHessianMse) refine_columns(wg, rows, out, bits, msc, h.data(), s);
    for (int64_t j = 0; j < out; ++j) {
      nibbles[g * out + j] = static_cast<uint8_t>(s.qs[j] - 1.0f);
      scale[j] = f16_round(s.qs[j] * s.qs[j] * msc);
    }
    // row loop, columns in parallel
    parallel_for(out, 64, [&](int64_t j0, int64_t j1) {
      for (int64_t c = a; c < b; ++c) {
        const float ucc = u[c * in + c];
        float* wc = w + c * out;
        for (int64_t j = j0; j < j1; ++j) {
          float q = z, dq = 0.f;
          if (scale[j] > 0.f) {
            q = std::nearbyint(wc[j] / scale[j]) + z;
            q = std::min(fmaxq, std::max(0.f, q));
            dq = f16_round((q - z) * scale[j]);
          }
          const float e = (wc[j] - dq) / ucc;
          codes[c * out + j] = static_cast<uint8_t>(q);
          deq[c * out + j] = dq;
          err[(c - a) * out + j] = e;
        }
        for (int64_t r = c + 1; r < b; ++r) {
          const float ucr = u[c * in + r];
          float* wr = w + r * out;
          const float* ec = err.data() + (c - a) * out;
          for (int64_t j = j0; j < j1; ++j) wr[j] = wr[j] - ucr * ec[j];
        }
      }
    });
    // trailing update, rows in parallel
    if (b < in) {
      parallel_for(in - b, 4, [&](int64_t r0, int64_t r1) {
        std::vector<float> acc(static_cast<size_t>(out));
        for (int64_t r = b + r0; r < b + r1; ++r) {
          std::fill(acc.begin(), acc.end(), 0.f);
          for (int64_t k = a; k < b; ++k) {
            const float ukr = u[k * in + r];
            const float* ek = err.data() + (k - a) * out;
            for (int64_t j = 0; j < out; ++j) acc[j] = acc[j] + ukr * ek[j];
          }
          float* wr = w + r * out;
          for (int64_t j = 0; j < out; ++j) wr[j] = wr[j] - acc[j];
        }
      });
    }
    a = b;
  }
}

void gptq_hessian(const float* x, int64_t n, int64_t in, float* h, bool accumulate) {
  if (!accumulate) std::fill(h, h + in * in, 0.f);
  // rows of H in parallel; each H[i, :] += sum_t x[t, i] * x[t, :], tokens in blocks for cache reuse
  constexpr int64_t kTok = 64;
  parallel_for(in, 8, [&](int64_t i0, int64_t i1) {
    for (int64_t t0 = 0; t0 < n; t0 += kTok) {
      const int64_t t1 = std::min(n, t0 + kTok);
      for (int64_t i = i0; i < i1; ++i) {
        float* hi = h + i * in;
        for (int64_t t = t0; t < t1; ++t) {
          const float xi = x[t * in + i];
          if (xi == 0.f) continue;
          const float* xt = x + t * in;
          for (int64_t j = 0; j < in; ++j) hi[j] = hi[j] + xi * xt[j];
        }
      }
    }
  });
}

void gptq_sqdiff(const float* a, const float* b, int64_t rows, int64_t cols, int64_t parts, double* partial) {
  const int64_t per = (cols + parts - 1) / parts;
  parallel_for(rows * parts, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r = i / parts, p = i % parts;
      const int64_t c0 = std::min(cols, p * per), c1 = std::min(cols, c0 + per);
      const float* ar = a + r * cols;
      const float* br = b ? b + r * cols : nullptr;
      double s = 0.0;
      for (int64_t c = c0; c < c1; ++c) {
        const double d = br ? static_cast<double>(ar[c]) - static_cast<double>(br[c]) : static_cast<double>(ar[c]);
        s += d * d;
      }
      partial[i] = s;
    }
  });
}

}  // namespace cpu

namespace ops {

void gptq_quantize(const Tensor& w, const Tensor& u, const std::vector<GptqGroup>& groups, Device device,
                   Tensor& codes, Tensor& nibbles, Tensor& q_scale_max, Tensor& deq, GptqSearch search) {
  EXL2_CHECK(w.defined() && w.dtype() == DType::F32 && w.dim() == 2, "gptq_quantize: weight must be f32 [in, out], "
             "got ", w.describe());
  const int64_t in = w.size(0), out = w.size(1);
  EXL2_CHECK(u.defined() && u.dtype() == DType::F32 && u.dim() == 2 && u.size(0) == in && u.size(1) == in,
             "gptq_quantize: u must be f32 [", in, ", ", in, "] (the weight has ", in, " input rows), got ",
             u.describe());
  EXL2_CHECK(!groups.empty(), "gptq_quantize: no groups given");
  int64_t total = 0;
  std::vector<int> bits;
  std::vector<int64_t> rows;
  for (size_t g = 0; g < groups.size(); ++g) {
    const int b = groups[g].bits;
    EXL2_CHECK(b == 2 || b == 3 || b == 4 || b == 5 || b == 6 || b == 8, "gptq_quantize: group ", g, " has ", b,
               " bits; EXL2 allows 2, 3, 4, 5, 6 or 8");
    EXL2_CHECK(groups[g].rows > 0, "gptq_quantize: group ", g, " has ", groups[g].rows, " rows; must be > 0");
    total += groups[g].rows;
    bits.push_back(b);
    rows.push_back(groups[g].rows);
  }
  EXL2_CHECK(total == in, "gptq_quantize: group rows sum to ", total, ", the weight has ", in, " input rows");
  const int64_t G = static_cast<int64_t>(groups.size());
  codes = Tensor::empty({in, out}, DType::U8);
  nibbles = Tensor::empty({G, out}, DType::U8);
  q_scale_max = Tensor::empty({G}, DType::F16);
  deq = Tensor::empty({in, out}, DType::F32);
  if (device.is_cpu()) {
    Tensor wk = w.to(Device::cpu());  // work copy
    Tensor uc = u.device().is_cpu() ? u : u.to(Device::cpu());
    cpu::gptq_quantize(wk.data_as<float>(), uc.data_as<float>(), bits.data(), rows.data(), G, in, out,
                       codes.data_as<uint8_t>(), nibbles.data_as<uint8_t>(), q_scale_max.data_as<uint16_t>(),
                       deq.data_as<float>(), search);
    return;
  }
#ifdef EXL2_WITH_CUDA
  Tensor wk = w.to(device), ud = u.device() == device ? u : u.to(device);
  Tensor cd = Tensor::empty({in, out}, DType::U8, device), nd = Tensor::empty({G, out}, DType::U8, device);
  Tensor qd = Tensor::empty({G}, DType::F16, device), dd = Tensor::empty({in, out}, DType::F32, device);
  cuda::gptq_quantize(wk.data_as<float>(), ud.data_as<float>(), bits.data(), rows.data(), G, in, out,
                      cd.data_as<uint8_t>(), nd.data_as<uint8_t>(), qd.data_as<uint16_t>(), dd.data_as<float>(),
                      search);
  codes.copy_from(cd);
  nibbles.copy_from(nd);
  q_scale_max.copy_from(qd);
  deq.copy_from(dd);
#else
  EXL2_FAIL(Unsupported, "gptq_quantize: device ", device.str(), " needs a build with the CUDA backend");
#endif
}

Tensor gptq_hessian(const Tensor& x, Device device) {
  EXL2_CHECK(x.defined() && x.dtype() == DType::F32 && x.dim() == 2, "gptq_hessian: x must be f32 [tokens, in], "
             "got ", x.describe());
  const int64_t n = x.size(0), in = x.size(1);
  Tensor h = Tensor::empty({in, in}, DType::F32);
  if (device.is_cpu()) {
    Tensor xc = x.device().is_cpu() ? x : x.to(Device::cpu());
    cpu::gptq_hessian(xc.data_as<float>(), n, in, h.data_as<float>(), false);
    return h;
  }
#ifdef EXL2_WITH_CUDA
  Tensor hd = Tensor::zeros({in, in}, DType::F32, device);
  const int64_t chunk = std::max<int64_t>(1, std::min(n, kHessianChunk));
  Tensor xd = Tensor::empty({chunk, in}, DType::F32, device);
  for (int64_t t0 = 0; t0 < n; t0 += chunk) {
    const int64_t m = std::min(chunk, n - t0);
    Tensor part = xd.slice(0, m);
    part.copy_from(x.slice(t0, t0 + m));
    cuda::gptq_hessian(part.data_as<float>(), m, in, hd.data_as<float>(), true);
  }
  h.copy_from(hd);
  return h;
#else
  EXL2_FAIL(Unsupported, "gptq_hessian: device ", device.str(), " needs a build with the CUDA backend");
#endif
}

}  // namespace ops
}  // namespace exl2
