// The checks Model::load makes on a config, its checkpoint and the requested sizes before it allocates anything for
// the model, and the one after the graph is built (every tensor of the checkpoint was read by some module).
#pragma once

#include <cstdint>
#include <string>

#include "exl2/config.h"
#include "exl2/safetensors.h"

namespace exl2 {

// Positions are int32 (model.h Batch): the longest max_seq_len a model can take.
constexpr int64_t kMaxSeqLen = 2147483647;

// max_seq_len in [1, kMaxSeqLen] (InvalidArgument naming it, or config.json's max_position_embeddings when it came
// from there: from_config), and its RoPE table (f32 [max_seq_len, head_dim], built on the host for every device) must
// fit in the host memory available now (OutOfMemory with the bytes).
void check_max_seq_len(const ModelConfig& config, int64_t max_seq_len, bool from_config, const std::string& source);

// The RoPE inverse frequencies for max_seq_len positions are finite and not negative as f32 (ModelFormat naming the
// config's rope section otherwise): the field checks of ModelConfig cannot see every combination (a tiny linear factor).
void check_rope(const ModelConfig& config, int64_t max_seq_len, const std::string& source);

// The checkpoint holds exactly config.num_hidden_layers decoder layers (<prefix><i>.*: the spec's names.layers): ModelFormat naming
// num_hidden_layers, the files and, for a config with fewer layers, the tensors that would be left unread
// (extra_layers_ok: at least num_hidden_layers, for sizing a checkpoint with stray layers).
void check_layers(const ModelConfig& config, const TensorMap& tensors, const std::string& source,
                  bool extra_layers_ok = false, const std::string& prefix = "model.layers.");

}  // namespace exl2
