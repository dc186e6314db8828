// The architecture registry: one line per architecture, keyed by config.json architectures[0].
#include <map>
#include <mutex>

#include "model/graph.h"

namespace exl2 {

DecoderTraits llama_traits(const ModelConfig& c);    // llama.cpp
DecoderTraits mistral_traits(const ModelConfig& c);  // mistral.cpp
DecoderTraits qwen2_traits(const ModelConfig& c);    // qwen2.cpp
DecoderTraits qwen3_traits(const ModelConfig& c);    // qwen3.cpp

namespace {

std::map<std::string, ArchTraitsFn>& table() {
  static std::map<std::string, ArchTraitsFn> t = {
      {"LlamaForCausalLM", llama_traits},
      {"MistralForCausalLM", mistral_traits},
      {"Qwen2ForCausalLM", qwen2_traits},
      {"Qwen3ForCausalLM", qwen3_traits},
  };
  return t;
}
std::mutex& table_mutex() {
  static std::mutex m;
  return m;
}

}  // namespace

void register_architecture(const std::string& name, ArchTraitsFn fn) {
  std::lock_guard<std::mutex> lock(table_mutex());
  table()[name] = fn;
}

std::vector<std::string> known_architectures() {
  std::lock_guard<std::mutex> lock(table_mutex());
  std::vector<std::string> names;
  for (const auto& kv : table()) names.push_back(kv.first);
  return names;
}

ArchTraitsFn find_architecture(const std::string& name) {
  {
    std::lock_guard<std::mutex> lock(table_mutex());
    auto it = table().find(name);
    if (it != table().end()) return it->second;
  }
  std::string known;
  for (const std::string& k : known_architectures()) known += (known.empty() ? "" : ", ") + k;
  EXL2_FAIL(Unsupported, "config.json: architecture \"", name, "\" is not supported; supported: ", known);
}

}  // namespace exl2
