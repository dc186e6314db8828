// Host-side check (no GPU needed) of the EXL2 CUDA kernels' decoding (cuda/exl2_decode.cuh) and unit table
// (cuda/exl2_gemm.cu) against quant::dequantize_into, on random layers of every bit width, mixed widths,
// partial and ragged groups, and padded columns. It runs the kernels' per-thread code (load_unit,
// decode_unit_any, DequantStore, GemvAcc) on the CPU for every (unit, 4-column) pair:
//   - the dequantized weights must equal the CPU reference bit for bit;
//   - the GEMV sums (x staged through q_perm, fp32 accumulation per unit) must match a float64 reference.
// Build and run (after scripts/dev_build.sh cuda):
//   dev/kernels/exl2_decode_check.sh
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "cuda/exl2_decode.cuh"
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

template <int M>
double gemv_check(const quant::Exl2Layout& L, const std::vector<int32_t>& units, const std::vector<int32_t>& qw,
                  const std::vector<int32_t>& qs, const std::vector<uint16_t>& msc, const std::vector<uint16_t>& W,
                  std::mt19937& rng) {
  // x [M, in] f16-representable values
  std::uniform_real_distribution<float> ux(-3.f, 3.f);
  std::vector<float> x(size_t(M * L.in));
  for (auto& v : x) v = f16_to_f32(f32_to_f16(ux(rng)));
  std::vector<float> y(size_t(M * L.out_pad), 0.f);
  const int n_units = int(units.size() / 4);
  std::vector<float> xs(32 * M);
  for (int u = 0; u < n_units; ++u) {
    const UnitInfo U = unit_info(reinterpret_cast<const int4*>(units.data()), u);
    for (int e = 0; e < 32 * M; ++e) {
      const int r = e / M, i = e % M;
      xs[e] = r < U.nvals ? x[size_t(i * L.in + L.perm[U.row + r])] : 0.f;
    }
    for (int64_t col = 0; col < L.out_pad; col += 4) {
      UnitData D;
      load_unit(U, reinterpret_cast<const uint32_t*>(qw.data()), reinterpret_cast<const uint32_t*>(qs.data()),
                reinterpret_cast<const __half*>(msc.data()), L.out_pad, col, D);
      GemvAcc<M> g;
      for (int c = 0; c < 4; ++c)
        for (int i = 0; i < M; ++i) g.acc[c][i] = 0.f;
      g.xu = xs.data();
      decode_unit_any(U.bits, D, g);
      for (int c = 0; c < 4; ++c)
        for (int i = 0; i < M; ++i) y[size_t(i * L.out_pad + col + c)] += g.acc[c][i];
    }
  }
  double num = 0, den = 0;
  for (int i = 0; i < M; ++i) {
    for (int64_t n = 0; n < L.out; ++n) {
      double ref = 0;
      for (int64_t k = 0; k < L.in; ++k) ref += double(x[size_t(i * L.in + k)]) * f16_to_f32(W[size_t(k * L.out + n)]);
      const double d = y[size_t(i * L.out_pad + n)] - ref;
      num += d * d;
      den += ref * ref;
    }
  }
  return std::sqrt(num / (den > 0 ? den : 1));
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
  const std::vector<int32_t> units = cuda::exl2_unit_table(L);

  // Dequantize through the kernel code into Wp [in, out_pad], packed row order.
  std::vector<uint16_t> Wp(size_t(L.in * L.out_pad), 0xFFFF);
  const int n_units = int(units.size() / 4);
  for (int u = 0; u < n_units; ++u) {
    const UnitInfo U = unit_info(reinterpret_cast<const int4*>(units.data()), u);
    for (int64_t col = 0; col < L.out_pad; col += 4) {
      UnitData D;
      load_unit(U, reinterpret_cast<const uint32_t*>(pk.q_weight.data()),
                reinterpret_cast<const uint32_t*>(pk.q_scale.data()), reinterpret_cast<const __half*>(msc.data()),
                L.out_pad, col, D);
      DequantStore<__half> st{reinterpret_cast<__half*>(Wp.data()) + int64_t(U.row) * L.out_pad + col, L.out_pad,
                              U.nvals};
      decode_unit_any(U.bits, D, st);
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
  const double e1 = gemv_check<1>(L, units, pk.q_weight, pk.q_scale, msc, W, rng);
  const double e4 = gemv_check<4>(L, units, pk.q_weight, pk.q_scale, msc, W, rng);
  const double e16 = gemv_check<16>(L, units, pk.q_weight, pk.q_scale, msc, W, rng);
  const bool ok = bad == 0 && e1 < 1e-5 && e4 < 1e-5 && e16 < 1e-5;
  std::printf("%s in=%lld out=%lld groups=%d units=%d: %lld weight mismatches, gemv rel err M1 %.2e M4 %.2e M16 %.2e\n",
              ok ? "ok  " : "FAIL", (long long)cs.in, (long long)cs.out, G, n_units, (long long)bad, e1, e4, e16);
  return ok;
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
  int fails = 0;
  for (const Case& c : cases) fails += run_case(c, rng) ? 0 : 1;
  std::printf("%s: %d of %zu cases failed\n", fails ? "FAIL" : "PASS", fails, cases.size());
  return fails ? 1 : 0;
}
