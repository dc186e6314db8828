// Gemma3ForConditionalGeneration (Gemma 3 4B / 12B / 27B): its text model (arch/gemma3.cpp) from text_config, under
// language_model., without a final soft-cap; the vision tower and the projector are not run (images are not supported).
#include "model/decoder.h"

namespace exl2 {

DecoderSpec gemma3_text(ArchConfig& c, const std::string& prefix);  // arch/gemma3.cpp

DecoderSpec gemma3_vlm_arch(ArchConfig& c) {
  c.accept_outer({"text_config", "vision_config", "mm_tokens_per_image", "boi_token_index", "eoi_token_index",
                  "image_token_index", "tie_word_embeddings"});
  DecoderSpec s = gemma3_text(c, "language_model.model.");
  if (s.final_softcap > 0)  // its head (transformers' reference) does not soft-cap, unlike Gemma3ForCausalLM's
    c.unsupported("final_logit_softcapping", "Gemma3ForConditionalGeneration's head has no soft-cap (HF applies none)");
  s.names.head = "language_model.lm_head";
  s.unused_prefixes = {"vision_tower.", "multi_modal_projector."};
  return s;
}

}  // namespace exl2
