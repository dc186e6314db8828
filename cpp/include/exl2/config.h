// ModelConfig: the strict reader of a model folder's config.json. Required keys missing, wrong types or
// inconsistent values raise ModelFormatError naming the key; unknown rope_scaling types raise UnsupportedError.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "exl2/json.h"

namespace exl2 {

enum class RopeType { Default, Linear, Dynamic, Llama3, Yarn, Longrope };
const char* rope_type_name(RopeType t);

struct RopeScaling {
  RopeType type = RopeType::Default;
  double factor = 1.0;
  // llama3
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 0;  // llama3, yarn, dynamic (0: use max_position_embeddings)
  // yarn
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  double mscale = 1.0;
  double mscale_all_dim = 0.0;
  double attention_factor = 0.0;  // yarn: 0: derived (0.1 ln(factor) + 1); longrope: as derived at load
  bool truncate = true;
  // longrope (Phi-3/3.5/4): per-frequency divisors [head_dim/2], long ones when the context passes the original
  std::vector<double> short_factor, long_factor;
};

// The RoPE of one layer type, from rope_parameters keyed by layer type (transformers >= 5 writes Gemma 3's so:
// {"sliding_attention": {...}, "full_attention": {...}}).
struct LayerTypeRope {
  std::string layer_type;
  double theta = 10000.0;
  RopeScaling scaling;
};

// A multimodal config.json (Gemma3ForConditionalGeneration, Mistral3ForConditionalGeneration) nests the text
// model's keys under text_config: they are read from there (errors name "text_config.<key>"), architectures and
// the keys the top level alone holds (quantization_config, eos_token_id, tie_word_embeddings) from the top level.
struct ModelConfig {
  std::string architecture;  // architectures[0]
  std::string model_type;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;
  int64_t vocab_size = 0;
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  // rope_parameters keyed by layer type (read only by architectures with per-layer-type RoPE; rope_theta and
  // rope_scaling then hold full_attention's entry, if any); empty for one RoPE on every layer.
  std::vector<LayerTypeRope> layer_type_ropes;
  // The part of each head RoPE rotates (rope dict's partial_rotary_factor, else the top-level key): rotary_dim()
  // leading channels; only architectures that implement it accept a value below 1 (decoder_spec).
  double partial_rotary_factor = 1.0;
  int64_t rotary_dim() const { return static_cast<int64_t>(static_cast<double>(head_dim) * partial_rotary_factor); }
  bool tie_word_embeddings = false;
  bool attention_bias = false;  // q/k/v (and o for Llama with attention_bias) biases
  bool mlp_bias = false;
  std::string hidden_act = "silu";
  std::string torch_dtype;  // as written ("float16", "bfloat16", "float32" or empty)
  std::vector<int64_t> bos_token_ids;
  std::vector<int64_t> eos_token_ids;
  int64_t sliding_window = 0;  // 0: none
  Json quantization_config;    // null when absent
  Json raw;                    // the whole file; a multimodal file: its text_config
  Json outer;                  // a multimodal file: the whole file (text_config nested); null otherwise

  static ModelConfig from_json(const Json& j, const std::string& source = "config.json");
  static ModelConfig load(const std::string& model_dir);  // reads <model_dir>/config.json
};

}  // namespace exl2
