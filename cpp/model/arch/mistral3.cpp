// Mistral3ForConditionalGeneration (Mistral Small 3.1 / 3.2): its text model, a MistralForCausalLM
// (arch/mistral.cpp) from text_config, under language_model.; the vision tower and the projector are not run.
#include "model/decoder.h"

namespace exl2 {

DecoderSpec mistral_arch(ArchConfig& c);  // arch/mistral.cpp

DecoderSpec mistral3_arch(ArchConfig& c) {
  c.accept_outer({"text_config", "vision_config", "image_token_index", "projector_hidden_act", "vision_feature_layer",
                  "multimodal_projector_bias", "spatial_merge_size", "tie_word_embeddings"});
  if (c.config().model_type != "mistral")
    c.unsupported("model_type", "the text model must be a mistral (text_config.model_type)");
  DecoderSpec s = mistral_arch(c);
  s.names.embed = "language_model.model.embed_tokens.weight";
  s.names.layers = "language_model.model.layers.";
  s.names.final_norm = "language_model.model.norm.weight";
  s.names.head = "language_model.lm_head";
  s.unused_prefixes = {"vision_tower.", "multi_modal_projector."};
  return s;
}

}  // namespace exl2
