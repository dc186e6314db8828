// The CPU backend's instruction-set variants: which vector ISA the hot kernels run with, picked at run time.
//
// A kernel file that holds `EXL2_CPU_ISA_BEGIN` at the start of a line is compiled once per ISA (CMakeLists.txt
// finds such files by that marker): EXL2_CPU_ISA_BEGIN ... EXL2_CPU_ISA_END encloses its code in the namespace
// exl2::cpu::<isa> (baseline, avx2, avx512) under that ISA's `#pragma GCC target`, and the baseline copy also
// defines the public exl2::cpu:: entry, which forwards through EXL2_CPU_DISPATCH to the copy cpu_isa() names.
// Every translation unit is compiled with the same flags (no -m options): only code written after its headers,
// inside the marked region, gets the wider target, so inline and template code from std and project headers is
// emitted identically everywhere (one definition, never an AVX-512 copy picked by the linker for baseline code).
//
// Results: the ISAs differ only in the order of fp32 sums (vector widths 1 / 8 / 16 lanes) and in fused
// multiply-adds; f32 outputs agree to about 1e-6 relative (tests/test_cpu_isa.py states the bounds).
#pragma once

#include <string>
#include <vector>

namespace exl2::cpu {

enum class CpuIsa : int { Baseline = 0, Avx2 = 1, Avx512 = 2 };

// The ISA the dispatching kernels use now: set_cpu_isa's choice, else best_cpu_isa().
CpuIsa cpu_isa();
// The widest compiled ISA this CPU (and its OS, for the vector state) supports: avx512 needs AVX-512 F/BW/DQ/VL
// plus AVX2/FMA/F16C, avx2 needs AVX2/FMA/F16C. The one place that asks the CPU (__builtin_cpu_supports).
CpuIsa best_cpu_isa();
// Forces an ISA for all later kernel calls (tests, benchmarks). Unsupported error when this CPU or build lacks it.
void set_cpu_isa(CpuIsa isa);
// The ISAs this build compiled (baseline, avx2, avx512 on x86-64; baseline elsewhere), and those of them this CPU
// can run, baseline first.
std::vector<CpuIsa> compiled_cpu_isas();
std::vector<CpuIsa> supported_cpu_isas();
// "baseline", "avx2", "avx512"; and back (InvalidArgument naming the choices for another name).
const char* cpu_isa_name(CpuIsa isa);
CpuIsa parse_cpu_isa(const std::string& name);

}  // namespace exl2::cpu

#if defined(EXL2_CPU_ISA_VARIANT_AVX512)
#define EXL2_CPU_ISA_NS avx512
#define EXL2_CPU_ISA_LEVEL 2
#define EXL2_CPU_TARGET_STR "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c,bmi,bmi2"
#elif defined(EXL2_CPU_ISA_VARIANT_AVX2)
#define EXL2_CPU_ISA_NS avx2
#define EXL2_CPU_ISA_LEVEL 1
#define EXL2_CPU_TARGET_STR "avx2,fma,f16c,bmi,bmi2"
#elif defined(EXL2_CPU_ISA_VARIANT_BASELINE)
#define EXL2_CPU_ISA_NS baseline
#define EXL2_CPU_ISA_LEVEL 0
#else
// Not a variant file: code in cpu_common.h compiled with the build's own flags (-march=native under EXL2_NATIVE).
#define EXL2_CPU_ISA_NS build
#endif

#define EXL2_CPU_PRAGMA_(x) _Pragma(#x)
#define EXL2_CPU_PRAGMA(x) EXL2_CPU_PRAGMA_(x)  // expands x's macros first
#if defined(EXL2_CPU_TARGET_STR) && defined(__clang__)
#define EXL2_CPU_TARGET_PUSH \
  EXL2_CPU_PRAGMA(clang attribute push(__attribute__((target(EXL2_CPU_TARGET_STR))), apply_to = function))
#define EXL2_CPU_TARGET_POP _Pragma("clang attribute pop")
#elif defined(EXL2_CPU_TARGET_STR)
#define EXL2_CPU_TARGET_PUSH _Pragma("GCC push_options") EXL2_CPU_PRAGMA(GCC target(EXL2_CPU_TARGET_STR))
#define EXL2_CPU_TARGET_POP _Pragma("GCC pop_options")
#else
#define EXL2_CPU_TARGET_PUSH
#define EXL2_CPU_TARGET_POP
#endif

// Inside namespace exl2::cpu, after every #include of the file.
#define EXL2_CPU_ISA_BEGIN EXL2_CPU_TARGET_PUSH namespace EXL2_CPU_ISA_NS {
#define EXL2_CPU_ISA_END } EXL2_CPU_TARGET_POP

// Defined in the baseline copy only: the public entry points of a variant file.
#if defined(EXL2_CPU_ISA_VARIANT_BASELINE)
#define EXL2_CPU_ISA_DISPATCHER 1
#endif

// Declarations of every variant of the backend kernels (backend/kernels.h, cache/kv_quant.h), so the baseline copy
// can forward to the others. x86-64 builds have all three; other CPUs only the baseline.
#if defined(EXL2_CPU_ISA_X86)
#define EXL2_CPU_DISPATCH(fn, ...)                 \
  switch (::exl2::cpu::cpu_isa()) {                \
    case ::exl2::cpu::CpuIsa::Avx512:              \
      return ::exl2::cpu::avx512::fn(__VA_ARGS__); \
    case ::exl2::cpu::CpuIsa::Avx2:                \
      return ::exl2::cpu::avx2::fn(__VA_ARGS__);   \
    default:                                       \
      return ::exl2::cpu::baseline::fn(__VA_ARGS__); \
  }
#else
#define EXL2_CPU_DISPATCH(fn, ...) return ::exl2::cpu::baseline::fn(__VA_ARGS__);
#endif

// In the baseline copy: declares the avx2 / avx512 copies of a kernel list macro (e.g. EXL2_BACKEND_KERNELS) so the
// dispatching entries can name them.
#if defined(EXL2_CPU_ISA_X86)
#define EXL2_CPU_ISA_DECLARE(KERNELS) \
  namespace avx2 {                    \
  KERNELS                             \
  }                                   \
  namespace avx512 {                  \
  KERNELS                             \
  }
#else
#define EXL2_CPU_ISA_DECLARE(KERNELS)
#endif
