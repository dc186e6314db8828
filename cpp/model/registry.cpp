// The architecture registry: one line per architecture, keyed by config.json architectures[0]; and decoder_spec,
// which runs an architecture file over the config and checks what it made.
#include <algorithm>
#include <map>
#include <mutex>

#include "model/decoder.h"
#include "ops/ops.h"

namespace exl2 {

DecoderSpec llama_arch(ArchConfig& c);    // arch/llama.cpp
DecoderSpec mistral_arch(ArchConfig& c);  // arch/mistral.cpp
DecoderSpec mixtral_arch(ArchConfig& c);  // arch/mixtral.cpp
DecoderSpec qwen2_moe_arch(ArchConfig& c);  // arch/qwen2_moe.cpp
DecoderSpec qwen3_moe_arch(ArchConfig& c);  // arch/qwen3_moe.cpp
DecoderSpec qwen2_arch(ArchConfig& c);    // arch/qwen2.cpp
DecoderSpec qwen3_arch(ArchConfig& c);    // arch/qwen3.cpp
DecoderSpec gemma2_arch(ArchConfig& c);      // arch/gemma2.cpp
DecoderSpec gemma3_arch(ArchConfig& c);      // arch/gemma3.cpp
DecoderSpec gemma3_vlm_arch(ArchConfig& c);  // arch/gemma3_vlm.cpp
DecoderSpec mistral3_arch(ArchConfig& c);    // arch/mistral3.cpp
DecoderSpec granite_arch(ArchConfig& c);  // arch/granite.cpp
DecoderSpec phi3_arch(ArchConfig& c);     // arch/phi3.cpp
DecoderSpec cohere_arch(ArchConfig& c);   // arch/cohere.cpp
DecoderSpec cohere2_arch(ArchConfig& c);  // arch/cohere2.cpp

namespace {

// The MoE layers' numbers (an architecture file's reading of the config) are ones the ops run.
void check_moe_spec(const ModelConfig& config, const DecoderSpec& s) {
  const MoeSpec& m = s.moe;
  if (std::none_of(s.layers.begin(), s.layers.end(), [](const LayerSpec& l) { return l.moe; })) return;
  EXL2_CHECK_KIND(Unsupported, m.n_experts >= 1 && m.n_experts <= ops::kMoeMaxExperts, "config.json: ",
                  m.n_experts, " experts per MoE layer are not supported (1 to ", ops::kMoeMaxExperts, ")");
  EXL2_CHECK_KIND(Unsupported, m.top_k >= 1 && m.top_k <= m.n_experts, "config.json: num_experts_per_tok must be in [1, ",
                  m.n_experts, "] (the experts), got ", m.top_k);
  EXL2_CHECK_KIND(Unsupported, m.inter >= 1 && m.shared_inter >= 0, "config.json: the experts' intermediate size must ",
                  "be positive, got ", m.inter, " (shared expert ", m.shared_inter, ")");
  EXL2_CHECK_KIND(Unsupported, s.residual == Residual::Sequential, config.architecture,
                  ": MoE layers with a parallel residual are not supported");
}

std::map<std::string, ArchFn>& table() {
  static std::map<std::string, ArchFn> t = {
      {"LlamaForCausalLM", llama_arch},
      {"MistralForCausalLM", mistral_arch},
      {"MixtralForCausalLM", mixtral_arch},
      {"Qwen2MoeForCausalLM", qwen2_moe_arch},
      {"Qwen3MoeForCausalLM", qwen3_moe_arch},
      {"Qwen2ForCausalLM", qwen2_arch},
      {"Qwen3ForCausalLM", qwen3_arch},
      {"Gemma2ForCausalLM", gemma2_arch},
      {"Gemma3ForCausalLM", gemma3_arch},
      {"Gemma3ForConditionalGeneration", gemma3_vlm_arch},
      {"Mistral3ForConditionalGeneration", mistral3_arch},
      {"GraniteForCausalLM", granite_arch},
      {"Phi3ForCausalLM", phi3_arch},
      {"CohereForCausalLM", cohere_arch},
      {"Cohere2ForCausalLM", cohere2_arch},
  };
  return t;
}
std::mutex& table_mutex() {
  static std::mutex m;
  return m;
}

}  // namespace

void register_architecture(const std::string& name, ArchFn fn) {
  std::lock_guard<std::mutex> lock(table_mutex());
  table()[name] = fn;
}

std::vector<std::string> known_architectures() {
  std::lock_guard<std::mutex> lock(table_mutex());
  std::vector<std::string> names;
  for (const auto& kv : table()) names.push_back(kv.first);
  return names;
}

DecoderSpec decoder_spec(const ModelConfig& config) {
  ArchFn fn = nullptr;
  {
    std::lock_guard<std::mutex> lock(table_mutex());
    auto it = table().find(config.architecture);
    if (it != table().end()) fn = it->second;
  }
  if (!fn) {
    std::string known;
    for (const std::string& k : known_architectures()) known += (known.empty() ? "" : ", ") + k;
    EXL2_FAIL(Unsupported, "config.json: architecture \"", config.architecture, "\" is not supported; supported: ",
              known);
  }
  ArchConfig a(config);
  DecoderSpec s = fn(a);
  a.finish();
  check_moe_spec(config, s);
  const bool partial = std::any_of(s.ropes.begin(), s.ropes.end(), [](const RopeSpec& r) { return r.rotary_dim; });
  EXL2_CHECK_KIND(Unsupported, config.partial_rotary_factor == 1.0 || partial, "config.json: partial_rotary_factor ",
                  config.partial_rotary_factor, " is not supported for ", config.architecture,
                  " (RoPE over part of each head)");
  EXL2_CHECK_KIND(Unsupported, config.head_dim % 2 == 0, "config.json: head_dim must be even, got ", config.head_dim);
  EXL2_CHECK_KIND(Internal, !s.ropes.empty() && static_cast<int64_t>(s.layers.size()) == config.num_hidden_layers,
                  config.architecture, ": the architecture file made ", s.layers.size(), " layers and ",
                  s.ropes.size(), " RoPE tables for ", config.num_hidden_layers, " layers");
  for (const LayerSpec& l : s.layers)
    EXL2_CHECK_KIND(Internal, l.rope >= 0 && l.rope < static_cast<int>(s.ropes.size()) && l.window >= 0,
                    config.architecture, ": a layer names RoPE table ", l.rope, " of ", s.ropes.size(),
                    " (window ", l.window, ")");
  EXL2_CHECK_KIND(Unsupported, s.residual == Residual::Sequential || s.names.mlp_norm.empty(), config.architecture,
                  ": a parallel residual reads the attention norm's output; no mlp_norm");
  return s;
}

}  // namespace exl2
