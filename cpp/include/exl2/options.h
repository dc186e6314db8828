// The runtime's options: one typed registry of every choice that used to be an environment switch. Each option is
// a field of RuntimeOptions with its default, allowed values, the place it acts and one line of documentation;
// docs/options.md is generated from this list (tests/test_options.py checks it). Options are passed, not read from
// the environment: Model.load(options=...) / Engine(options=...) in Python, set_runtime_options() in C++, and
// exl2cpp.options.scope(...) in tests. The settings that stay in the environment (server keys, CPU thread count,
// model cache folder) are listed in kEnvironmentSettings and on the same page.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace exl2 {

// X(type, name, default, allowed, scope, doc). type: bool, int or choice (a std::string, one of `allowed`, "|"-
// separated); int: `allowed` is "lo..hi". scope: where the option is read ("matmul", "load", "step", "attention",
// "kv_cache", "engine", "tensor_parallel", "debug").
#define EXL2_RUNTIME_OPTIONS(X)                                                                                     \
  X(int, gemv_max_rows, 32, "0..2147483647", "matmul",                                                                 \
    "Rows of x up to which an EXL2 linear runs the fused-dequantization GEMV; above it, dequantize + cuBLAS.")       \
  X(bool, gemv_group, true, "", "matmul",                                                                           \
    "One GEMV launch for the 2..3 EXL2 linears that share x (q/k/v, gate/up); measured +22% end to end (H200).")   \
  X(bool, gemv_fuse, true, "", "step",                                                                              \
    "Fold the decode step's rms_norm / silu_mul / residual add into the GEMV launch; measured +4% (H200).")         \
  X(bool, gemv_m32, false, "", "matmul",                                                                            \
    "17..32 rows of x in one launch of the 32-row v4 GEMV instead of two 16-row launches (not yet measured).")      \
  X(int, gemv_slices, 0, "0..65535", "matmul",                                                                      \
    "k slices per column block of the v4 GEMV; 0: the planner's split (1: every warp owns all of k).")              \
  X(int, gemv_chunks, 8, "1..1024", "matmul", "Chunks of 4 units per k slice the v4 GEMV's split aims at.")          \
  X(int, gemv_blocks_per_sm, 0, "0..32", "matmul",                                                                  \
    "Resident blocks per SM the v4 GEMV grid aims at; 0: what occupancy allows.")                                   \
  X(int, gemv_prefetch, 8192, "0..65536", "matmul", "Bytes of L2 bulk prefetch per warp at the start of the v4 GEMV.") \
  X(bool, gemv_prefetch_ahead, true, "", "matmul", "The v4 GEMV keeps 8 KB of weights prefetched ahead in its loop.") \
  X(bool, pdl, true, "", "step",                                                                                    \
    "Programmatic dependent launch of a step's kernels on sm_90+ (ignored where the GPU or build lacks it).")       \
  X(bool, cuda_graphs, true, "", "step", "Capture decode steps into CUDA graphs and replay them (false: eager).")    \
  X(bool, cuda_reference, false, "", "debug",                                                                       \
    "Run the simple reference CUDA kernels (dequantize + cuBLAS, plain attention) to bisect a fast path.")          \
  X(bool, sync_check, false, "", "debug", "Synchronize after every CUDA launch so an async fault names its kernel.") \
  X(bool, device_argmax, true, "", "engine", "Greedy rows pick their token on the logits' device.")                  \
  X(bool, device_sample, false, "", "engine",                                                                       \
    "Plain sampled rows draw their token on the logits' device (off until measured on a GPU).")                    \
  X(choice, kv_k_centre, "rope", "rope|fixed", "kv_cache",                                                          \
    "Quantized caches centre K RoPE-aware (rope) or by one fixed post-RoPE mean (fixed); read when a cache is made.") \
  X(bool, kv_sink, true, "", "kv_cache", "Quantized caches keep the first rows of each sequence in fp16 (sinks).")   \
  X(bool, weight_arena, true, "", "load", "Place a model's device weights in one arena per device at load.")         \
  X(bool, tp_threads, false, "", "tensor_parallel", "Run each tensor-parallel rank's step on its own host thread.")  \
  X(choice, tp_graphs, "off", "off|on|cpu-pad", "tensor_parallel",                                                 \
    "CUDA graphs for tensor-parallel decode steps (2+ ranks, with tp_threads; cpu-pad: CPU ranks run the padded "    \
    "decode layout, for tests).")                                                                                   \
  X(bool, tp_trace, false, "", "debug", "One stderr line per tensor-parallel executor decision and rank phase.")     \
  X(int, tp_test_fail_rank, -1, "-1..1023", "debug",                                                                \
    "Tests: this tensor-parallel rank throws after its first all-gather of every threaded step (-1: none).")       \
  X(choice, cpu_activations, "f32", "f32|f16", "debug",                                                             \
    "CPU backend activations; f16 rounds them as the GPU does, to tell its rounding from a kernel bug.")           \
  X(bool, gptq_rowloop_smem, true, "", "convert",                                                                   \
    "GPTQ on CUDA: the shared-memory row loop for groups of up to 256 rows (false: the global-memory loop).")

struct RuntimeOptions {
#define EXL2_OPTION_FIELD_bool(name, dflt) bool name = dflt;
#define EXL2_OPTION_FIELD_int(name, dflt) int name = dflt;
#define EXL2_OPTION_FIELD_choice(name, dflt) std::string name = dflt;
#define EXL2_OPTION_FIELD(type, name, dflt, allowed, scope, doc) EXL2_OPTION_FIELD_##type(name, dflt)
  EXL2_RUNTIME_OPTIONS(EXL2_OPTION_FIELD)
#undef EXL2_OPTION_FIELD
#undef EXL2_OPTION_FIELD_bool
#undef EXL2_OPTION_FIELD_int
#undef EXL2_OPTION_FIELD_choice
};

// The options in force (process-wide; defaults until set). Kernels read them when they launch, loaders when they
// load, caches when they are made: set them before the work they should govern (a CUDA graph keeps what it
// captured).
const RuntimeOptions& runtime_options();
void set_runtime_options(const RuntimeOptions& o);

// RAII: `o` in force for the scope, the previous options restored at its end.
class RuntimeOptionsScope {
 public:
  explicit RuntimeOptionsScope(const RuntimeOptions& o) : saved_(runtime_options()) { set_runtime_options(o); }
  ~RuntimeOptionsScope() { set_runtime_options(saved_); }
  RuntimeOptionsScope(const RuntimeOptionsScope&) = delete;
  RuntimeOptionsScope& operator=(const RuntimeOptionsScope&) = delete;

 private:
  RuntimeOptions saved_;
};

// One registry entry, as text (bindings, docs).
struct OptionInfo {
  std::string name, type, default_value, allowed, scope, doc;
};
const std::vector<OptionInfo>& option_registry();

// By name, as text: bool "true"/"false" (also "1"/"0"), int in decimal, choice one of its values. InvalidArgument
// naming the option, the value and what is allowed.
std::string get_option(const RuntimeOptions& o, const std::string& name);
void set_option(RuntimeOptions& o, const std::string& name, const std::string& value);

// The settings that stay environment variables (configuration, not code paths), for the same doc page.
struct EnvironmentSetting {
  const char* name;
  const char* doc;
};
const std::vector<EnvironmentSetting>& environment_settings();

}  // namespace exl2
