// Run-time choice of the CPU backend's ISA variant (contract in isa.h).
#include "backend/cpu/isa.h"

#include <atomic>

#include "exl2/errors.h"

namespace exl2::cpu {
namespace {

constexpr int kUnset = -1;
std::atomic<int> g_forced{kUnset};

bool cpu_has(CpuIsa isa) {
  if (isa == CpuIsa::Baseline) return true;
#if defined(EXL2_CPU_ISA_X86)
  // libgcc's cpu model also checks that the OS saves the YMM / ZMM state (XGETBV) before it reports AVX2 / AVX-512.
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
                    __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2");
  if (isa == CpuIsa::Avx2) return avx2;
  return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
#else
  return false;
#endif
}

}  // namespace

CpuIsa best_cpu_isa() {
  static const CpuIsa best = cpu_has(CpuIsa::Avx512) ? CpuIsa::Avx512
                             : cpu_has(CpuIsa::Avx2) ? CpuIsa::Avx2
                                                     : CpuIsa::Baseline;
  return best;
}

CpuIsa cpu_isa() {
  const int forced = g_forced.load(std::memory_order_relaxed);
  return forced == kUnset ? best_cpu_isa() : static_cast<CpuIsa>(forced);
}

void set_cpu_isa(CpuIsa isa) {
  EXL2_CHECK_KIND(Unsupported, cpu_has(isa), "CPU ISA '", cpu_isa_name(isa),
                  "' is not supported by this CPU or build (best here: '", cpu_isa_name(best_cpu_isa()), "')");
  g_forced.store(static_cast<int>(isa), std::memory_order_relaxed);
}

std::vector<CpuIsa> compiled_cpu_isas() {
#if defined(EXL2_CPU_ISA_X86)
  return {CpuIsa::Baseline, CpuIsa::Avx2, CpuIsa::Avx512};
#else
  return {CpuIsa::Baseline};
#endif
}

std::vector<CpuIsa> supported_cpu_isas() {
  std::vector<CpuIsa> out;
  for (CpuIsa isa : {CpuIsa::Baseline, CpuIsa::Avx2, CpuIsa::Avx512})
    if (cpu_has(isa)) out.push_back(isa);
  return out;
}

const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::Avx2:
      return "avx2";
    case CpuIsa::Avx512:
      return "avx512";
    default:
      return "baseline";
  }
}

CpuIsa parse_cpu_isa(const std::string& name) {
  for (CpuIsa isa : {CpuIsa::Baseline, CpuIsa::Avx2, CpuIsa::Avx512})
    if (name == cpu_isa_name(isa)) return isa;
  EXL2_FAIL(InvalidArgument, "unknown CPU ISA '", name, "': expected 'baseline', 'avx2' or 'avx512'");
}

}  // namespace exl2::cpu
